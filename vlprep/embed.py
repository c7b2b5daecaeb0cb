"""`vlprep embed` and the image views of `vlprep pseudolabel`: L2-normalised ITC embeddings from an encoder object.

docs/PSEUDOLABEL.md is the contract: what an encoder object provides (vlprep never imports vltrain; the CLI hands
in vltrain's checkpoint encoder), which caption is embedded, the eval view (`center_view`) and the seeded crops
(`crop_views`, a function of (seed, key) alone), and the output files (embeddings.npy + keys.parquet, joined from
per-shard parts so that a stopped run resumes).

Cached tokens: when the dataset is a `vlprep features` output and the encoder says it reads that record's tokens
(`enc.reads_tokens(spec)`: a checkpoint trained on the same frozen encoder's tokens), an image sample's `npy`
member goes to `enc.tokens()` and its image is never decoded; a sample without one takes the pixel path. The
report counts the samples of each path (`image_input`). Crops (pseudolabel's) always come from pixels.
"""

import hashlib
import io
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from vlprep import VlprepError
from vlprep.dataset import batches, decode_rgb, image_ext, iter_aligned, sidecar_name
from vlprep.encoders import features_spec
from vlprep.engine import Work, check_engine, map_shards, merged_skips
from vlprep.output import Out, open_derived, publish, pull, write_json_atomic, writing_output
from vlprep.urls import redact

MODALITIES = ("image", "text")


def check_images(enc) -> None:
    """A one-line error when the encoder cannot embed pixels (before any output is written)."""
    if enc.image_size is None:
        raise VlprepError(f"{enc.name}: the image encoder reads precomputed features, not pixels; "
                          "it cannot embed images")


def center_view(image, size: int) -> np.ndarray:
    """PIL image -> uint8 (S, S, 3): vltrain's eval transform (resize, centre crop) before its float conversion."""
    from torchvision.transforms import v2

    tf = v2.Compose([v2.ToImage(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])
    return tf(image).permute(1, 2, 0).numpy()


def crop_views(image, key: str, seed: int, crops: int, size: int, min_scale: float) -> np.ndarray:
    """PIL image -> uint8 (c, S, S, 3): c RandomResizedCrops drawn from a generator seeded by (seed, key)."""
    from torchvision.transforms import v2

    # On the PIL image, not a tensor: PIL's uint8 crop + antialiased resize is several times faster than
    # torch's on small images, and the crop boxes drawn are the same.
    crop = v2.RandomResizedCrop(size, scale=(min_scale, 1.0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(crop_seed(seed, key))
        return np.stack([np.asarray(crop(image)) for _ in range(crops)])


def crop_seed(seed: int, key: str) -> int:
    """The per-key seed of the crop generator: blake2b('crop:{seed}:{key}') as a 63-bit integer."""
    h = hashlib.blake2b(f"crop:{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


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
        image = decode_rgb(raw[ext])
        image.load()
        return image, None
    except Exception:  # any decoder failure is a counted skip, never fatal
        return None, "undecodable"


# --- the stage ---------------------------------------------------------------------------------


@dataclass
class EmbedConfig:
    src: Path
    out: Path
    modality: str = "image"
    batch_size: int = 64
    deformed: bool = False      # text: embed `caption` even when `caption_raw` is there
    workers: int = 1            # each worker has its own copy of the encoder
    distributor: str = "local"  # local | ray (docs/SCALE.md)
    gpu: bool = False           # Ray: give each actor a GPU share (the CLI sets it for --device cuda)
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


_worker: dict = {}


def _init_worker(enc) -> None:
    _worker["enc"] = enc  # unpickled in a worker process: the encoder loads its weights there, once


def _part(out: Out, shard: str) -> Path:
    return out.root / "_parts" / sidecar_name(shard)


def cached_tokens(raw: dict, shape: tuple[int, int]):
    """The sample's `npy` tokens (N, D), or (None, reason) when it has none or they are not a (N, D) float array."""
    if "npy" not in raw:
        return None, "no_tokens"
    try:
        x = np.load(io.BytesIO(raw["npy"]), allow_pickle=False)
    except Exception:  # a truncated or foreign member is a counted skip, never fatal
        return None, "bad_tokens"
    if x.shape != shape or x.dtype.kind != "f":
        return None, "bad_tokens"
    return x, None


def embed_shard(out: Out, src: Path, shard: str, modality: str, deformed: bool, batch_size: int, tokens: tuple | None,
                fp: str) -> dict:
    """One input shard's embeddings -> OUT/_parts/SHARD.npy + SHARD.parquet (its keys, the fingerprint); `tokens`:
    (N, D) of the cached tokens to read where a sample has them, None for pixels only."""
    enc = _worker["enc"]
    side = pq.read_table(src / sidecar_name(shard))
    keys = side.column("key").to_pylist()
    skipped = Counter()
    paths = Counter()
    if modality == "text":
        captions = intact_captions(side, deformed)
        vectors = [enc.texts(captions[i:i + batch_size]) for i in range(0, len(captions), batch_size)]
        kept = list(range(len(keys)))
    else:
        vectors = []
        kept = []
        pixels_ok = enc.image_size is not None
        for batch in batches(iter_aligned(src / shard, keys), batch_size):
            cached, views, order = [], [], []  # order: per kept sample, (is cached, its index in its list)
            for i, raw in batch:
                if tokens is not None:
                    x, why = cached_tokens(raw, tokens)
                    if x is not None:
                        kept.append(i)
                        order.append((True, len(cached)))
                        cached.append(x)
                        continue
                    if not pixels_ok:  # a tokens-only model: the sample cannot be embedded
                        skipped[why] += 1
                        continue
                image, why = decode(raw)
                if image is None:
                    skipped[why] += 1
                else:
                    kept.append(i)
                    order.append((False, len(views)))
                    views.append(center_view(image, enc.image_size))
            got = {True: enc.tokens(np.stack(cached)) if cached else None,
                   False: enc.images(np.stack(views)) if views else None}
            paths.update(tokens=len(cached), pixels=len(views))
            if order:
                vectors.append(np.stack([got[c][j] for c, j in order]))
    x = np.concatenate(vectors) if vectors else np.zeros((0, enc.dim), np.float32)
    table = pa.table({"key": pa.array([keys[i] for i in kept], pa.string())})
    if modality == "text":
        table = table.append_column("caption", pa.array(captions, pa.string()))
    part = _part(out, shard)
    part.parent.mkdir(exist_ok=True)  # a worker on another machine than the driver's: its staging folder has none
    with open(part.with_suffix(".npy.tmp"), "wb") as f:  # a file object: np.save would append .npy to the name
        np.save(f, x, allow_pickle=False)
    os.replace(part.with_suffix(".npy.tmp"), part.with_suffix(".npy"))
    stats = {"in": len(keys), "written": len(kept), "skipped": dict(skipped), "paths": dict(paths)}
    meta = {b"fingerprint": fp.encode(), b"stats": json.dumps(stats, allow_nan=False).encode()}
    pq.write_table(table.replace_schema_metadata(meta), part.with_name(part.name + ".tmp"))
    os.replace(part.with_name(part.name + ".tmp"), part)  # last: a part is complete when its parquet is there
    names = [f"_parts/{part.stem}.npy", f"_parts/{part.name}"]
    publish(out, names, keep=names)  # a URL OUT: uploaded in the same order (vlprep.output)
    return stats


def _part_done(out: Out, work: Work) -> dict | None:
    part = _part(out, work.shard)
    if not (pull(out, f"_parts/{part.name}") and pull(out, f"_parts/{part.stem}.npy")):
        return None
    meta = pq.read_schema(part).metadata or {}
    if meta.get(b"fingerprint") != work.fingerprint.encode():
        return None
    return json.loads(meta[b"stats"])


def embed(cfg: EmbedConfig, enc, progress=None) -> dict:
    """Run `vlprep embed` with an encoder object (see the module docstring); returns the report (also OUT/report.json)."""
    if cfg.modality not in MODALITIES:
        raise VlprepError(f"--modality must be image or text, got {cfg.modality!r}")
    if cfg.batch_size < 1:
        raise VlprepError("--batch-size must be at least 1")
    check_engine(cfg.distributor, cfg.workers)
    spec = features_spec(cfg.src) if cfg.modality == "image" else None
    reads = getattr(enc, "reads_tokens", None)  # an encoder without it embeds pixels only
    tokens = (spec["tokens"], spec["dim"]) if spec is not None and reads is not None and reads(spec) else None
    if cfg.modality == "image" and tokens is None:
        check_images(enc)
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards, (getattr(enc, "path", None),))
    options = {"src": ds.location, "encoder": enc.name, "modality": cfg.modality, "deformed": cfg.deformed}
    if tokens is not None:  # recorded where it is so: outputs of pixel runs keep the options they had
        options["image_input"] = "tokens"
    with writing_output(out, "embed", options, cfg.overwrite) as out:
        for name in ("embeddings.npy", "keys.parquet"):  # a stale pair must not outlive a failed run
            (out.root / name).unlink(missing_ok=True)
        (out.root / "_parts").mkdir(exist_ok=True)
        salt = f"{enc.fingerprint}:{cfg.modality}:{cfg.deformed}:{cfg.batch_size}"
        salt = (salt + (":tokens" if tokens else "")).encode()  # a part from the other path is redone
        plan = [Work(s, (ds.source, s, cfg.modality, cfg.deformed, cfg.batch_size, tokens),
                     ds.fingerprint(s, salt), ds.sizes[s])
                for s in ds.shards]
        stats, resumed = map_shards(out, plan, embed_shard, init=_init_worker, initargs=(enc,), workers=cfg.workers,
                                    distributor=cfg.distributor, progress=progress, label=f"embed {cfg.modality}",
                                    total=ds.num_samples, start="spawn", gpu=cfg.gpu, done=_part_done)

        # --- join the parts in shard order (a memmap: memory stays at one part whatever N is)
        n = sum(st["written"] for st in stats.values())
        tmp = out.root / "embeddings.npy.tmp"
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, enc.dim))
        tables = []
        row = 0
        for shard in ds.shards:
            pull(out, f"_parts/{_part(out, shard).stem}.npy")  # made on another machine (a URL OUT)
            pull(out, f"_parts/{_part(out, shard).name}")
            x = np.load(_part(out, shard).with_suffix(".npy"))
            arr[row:row + len(x)] = x
            row += len(x)
            tables.append(pq.read_table(_part(out, shard)).replace_schema_metadata(None))
        arr.flush()
        del arr  # closes the memmap
        table = pa.concat_tables(tables) if tables else pa.table({"key": pa.array([], pa.string())})
        pq.write_table(table, out.root / "keys.parquet.tmp")
        os.replace(out.root / "keys.parquet.tmp", out.root / "keys.parquet")
        os.replace(tmp, out.root / "embeddings.npy")
        skipped, _ = merged_skips(stats.values())
        paths = {p: sum(st.get("paths", {}).get(p, 0) for st in stats.values()) for p in ("tokens", "pixels")}
        elapsed = time.perf_counter() - t0
        report = {"stage": "embed", "source": redact(str(cfg.src)), "encoder": enc.name, "modality": cfg.modality,
                  "dim": enc.dim, "samples_in": ds.num_samples, "written": n, "skipped": dict(skipped),
                  **({"image_input": paths} if cfg.modality == "image" else {}),
                  "device": str(enc.device), "shards": len(ds.shards), "shards_resumed": len(resumed),
                  "bad_shards": ds.bad, "elapsed_s": round(elapsed, 3),
                  "per_s": round(n / elapsed, 2) if elapsed > 0 else None,
                  "outputs": [str(out.root / "embeddings.npy"), str(out.root / "keys.parquet")]}
        write_json_atomic(out.root / "meta.json", {"stage": "embed", "options": options, "dim": enc.dim, "count": n,
                                              "encoder": enc.info, "encoder_fingerprint": enc.fingerprint})
        write_json_atomic(out.root / "report.json", report)
    return report


def load_embeddings(folder: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """(keys, (N, E) float32) from a `vlprep embed` output folder."""
    folder = Path(folder)
    if not (folder / "embeddings.npy").exists() or not (folder / "keys.parquet").exists():
        raise VlprepError(f"{folder}: not a `vlprep embed` output (needs embeddings.npy and keys.parquet)")
    keys = pq.read_table(folder / "keys.parquet", columns=["key"]).column(0).to_pylist()
    return keys, np.load(folder / "embeddings.npy")

"""`vlprep features`: cache a frozen image encoder's token grid as an `npy` member of every sample.

OUT has the samples of IN, every member copied byte for byte, plus `KEY.npy`: the encoder's tokens (N, D) for the
image (`np.save(..., allow_pickle=False)`, --dtype float16 or float32), computed from vltrain's eval view (resize
the shorter side to S, centre crop S x S, normalise with the encoder's statistics). OUT/meta.json records the
encoder under "features" (vlprep.encoders: `features_spec`, `encoder_from_spec`), which is how vltrain knows to
read tokens instead of pixels. Samples without an image or whose image does not decode are dropped and counted.

A sample's bytes depend on its image and the run's options alone, not on how the run happens to go. The float
result of a convolution depends on the kernel the library picks, and oneDNN picks by the input's shape and by the
number of threads it may use (at 1 and 2 threads its 1x1 convolutions split their work differently and round
differently, ~1e-6 in float32, enough to flip a float16's last bit). So on a CPU every encoder call has one fixed
shape, (--batch-size, 3, S, S), the last call of a shard padded with black images, and runs on one intra-op
thread; parallelism comes from several such calls at once on a pool of `encode_threads` threads (torch releases
the GIL), which on 2 cores is also about twice as fast as one call on two intra-op threads. The calls are formed
from a shard's decodable samples in order, so the same input gives the same bytes for any --workers,
--decode-threads, distributor and resume point. --batch-size is therefore an option of the result, like --dtype
(recorded in meta.json; another value is a new run): other sizes agree to float rounding only.
"""

import contextlib
import io
import json
import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from vlprep import VlprepError
from vlprep.dataset import batches, iter_aligned, sidecar_name
from vlprep.embed import decode
from vlprep.encoders import eval_view, load_token_encoder, normalise, resolve_device
from vlprep.engine import Work, check_engine, map_shards, merged_skips
from vlprep.output import Out, finish_dataset, open_derived, write_json_atomic, write_shard, writing_output
from vlprep.urls import redact

DTYPES = ("float16", "float32")
MAX_EXAMPLES = 5


@dataclass
class FeaturesConfig:
    src: Path
    out: Path
    image_model: str = "efficientnet-lite0"   # efficientnet-lite0 | torchvision:ARCH
    weights: Path | None = None
    size: int | None = None                   # None: the encoder's (224)
    dtype: str = "float16"
    # Images per encoder call, a fixed shape (see the module docstring); None: 4 on a CPU (fastest with one
    # intra-op thread per call on a small machine), 64 on CUDA.
    batch_size: int | None = None
    # Decode threads per worker: PIL decoding and torch's resize release the GIL, so two threads keep the encoder
    # fed on 2 cores while it runs; 0 decodes in the worker's main thread.
    decode_threads: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))
    workers: int = 1                          # processes (or Ray actors), each with its own encoder
    distributor: str = "local"                # local | ray (docs/SCALE.md)
    device: str = "auto"
    # auto: bf16 autocast on a CUDA card with native bf16, float32 elsewhere; fp32: float32 (TF32 off on CUDA, so a
    # GPU's tokens are a CPU's within float16 storage rounding); bf16: bf16 autocast (CUDA only)
    precision: str = "auto"
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


def _view(raw: dict, size: int) -> tuple[torch.Tensor | None, str | None]:
    """A raw sample's uint8 (3, S, S) eval view, or (None, skip reason)."""
    image, why = decode(raw)
    if image is None:
        return None, why
    return eval_view(image, size), None


def _prefetch(pool: ThreadPoolExecutor | None, fn, items, ahead: int):
    """fn(item) for each item, in order, with at most `ahead` calls in flight on the pool (inline without one)."""
    if pool is None:
        yield from map(fn, items)
        return
    pending = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def npy_bytes(tokens: np.ndarray) -> bytes:
    """(N, D) array -> the bytes of a .npy file (never pickled)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(tokens), allow_pickle=False)
    return buf.getvalue()


_worker: dict = {}


def _one_intra_op_thread() -> None:
    torch.set_num_threads(1)


def _init_worker(image_model: str, weights: Path | None, size: int | None, device: str, decode_threads: int,
                 encode_threads: int = 1) -> None:
    """Load the encoder once per worker (and once only in the driver, which checks it first)."""
    st = os.stat(weights) if weights is not None and os.path.exists(weights) else None
    key = (image_model, str(weights), st and (st.st_size, st.st_mtime_ns), size, device, decode_threads,
           encode_threads)
    if _worker.get("key") == key:
        return
    dev = resolve_device(device)
    # forget the old state before the new encoder loads: a load that fails must not leave the old key beside pools
    # that are shut down (the next call with that key would find them and fail)
    old = dict(_worker)
    _worker.clear()
    for pool in ("pool", "encode_pool"):
        if old.get(pool) is not None:
            old[pool].shutdown()
    # On a CPU every call runs on one intra-op thread (the module docstring says why); threads run calls side by
    # side. On CUDA one thread feeds the device.
    encode_pool = (ThreadPoolExecutor(encode_threads, thread_name_prefix="features-encode",
                                      initializer=_one_intra_op_thread) if dev.type == "cpu" else None)
    _worker.update(key=key, device=dev, enc=load_token_encoder(image_model, weights, size).to(dev),
                   pool=ThreadPoolExecutor(decode_threads, thread_name_prefix="features-decode")
                   if decode_threads else None, encode_pool=encode_pool, encode_threads=encode_threads)


PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device: torch.device) -> str:
    """fp32 or bf16: what --precision means on `device` (auto: bf16 only on a CUDA card that computes it natively,
    where float32 would waste the tensor cores; a CPU or an older card would only emulate it)."""
    if precision not in PRECISIONS:
        raise VlprepError(f"--precision must be auto, fp32 or bf16, got {precision!r}")
    native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "bf16" and not native:
        raise VlprepError(f"--precision bf16 needs a CUDA card with native bf16 (compute capability 8.0 or more); "
                          f"this is {device.type}: use fp32")
    if precision == "auto":
        return "bf16" if native else "fp32"
    return precision


@contextlib.contextmanager
def _numerics(device: torch.device, precision: str):
    """The encoder call's arithmetic: bf16 autocast, or float32 (TF32 off on CUDA)."""
    if precision == "bf16":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
        return
    with full_float32() if device.type == "cuda" else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def full_float32():
    """CUDA's matmuls and convolutions in float32, not TF32 (a 10-bit mantissa), within the block; the process's
    flags are put back after it."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]


def _encode(enc, device, batch: list, batch_size: int, dtype: np.dtype, precision: str) -> np.ndarray:
    """[(index, raw, uint8 view)] -> their tokens (len, N, D) in `dtype`, from one call of the fixed shape."""
    spec = enc.spec
    # The views are crops of HWC buffers (ToImage keeps PIL's layout): stacked as (B, S, S, 3) they copy row by row
    # (much faster than stacking the CHW views) into the channels_last (B, 3, S, S) layout the encoder's convolutions
    # want, so it needs no second copy. Elementwise ops: same numbers either way.
    hwc = torch.stack([v.permute(1, 2, 0) for _, _, v in batch])
    if len(batch) < batch_size:  # the fixed shape: black images fill the shard's last call
        hwc = torch.cat([hwc, hwc.new_zeros(batch_size - len(batch), *hwc.shape[1:])])
    x = normalise(hwc.permute(0, 3, 1, 2), spec["mean"], spec["std"]).to(device, non_blocking=True)
    with torch.inference_mode(), _numerics(device, precision):
        return enc(x)[:len(batch)].cpu().numpy().astype(dtype, copy=False)  # (B, N, D)


def features_shard(out: Out, src: Path, shard: str, dtype: str, batch_size: int, precision: str, fp: str) -> dict:
    """Encode one shard's images and write the shard with npy members; returns its stats."""
    enc = _worker["enc"]
    device = _worker["device"]
    pool = _worker["pool"]
    encode_pool = _worker["encode_pool"]
    side = pq.read_table(src / sidecar_name(shard))
    rows_in = side.replace_schema_metadata(None).to_pylist()
    size = enc.spec["size"]
    dtype = np.dtype(dtype)
    samples = []
    rows = []
    skipped = Counter()
    examples = {}
    ahead = batch_size * (_worker["encode_threads"] + 1)
    views = _prefetch(pool, lambda item: (*item, *_view(item[1], size)),
                      iter_aligned(src / shard, [r["key"] for r in rows_in]), ahead=ahead)

    def decodable():
        """The shard's samples with an image, in order; the others are counted here."""
        for i, raw, view, why in views:
            if view is None:
                skipped[why] += 1
                if len(examples.setdefault(why, [])) < MAX_EXAMPLES:
                    examples[why].append(raw["__key__"])
            else:
                yield i, raw, view

    calls = _prefetch(encode_pool, lambda batch: (batch, _encode(enc, device, batch, batch_size, dtype, precision)),
                      batches(decodable(), batch_size), ahead=2 * _worker["encode_threads"])
    for batch, tokens in calls:
        for (i, raw, _), t in zip(batch, tokens):
            samples.append({**{k: v for k, v in raw.items() if k != "__url__"}, "npy": npy_bytes(t)})
            rows.append(rows_in[i])
    stats = {"in": len(rows_in), "written": len(samples), "skipped": dict(skipped),
             "skipped_examples": examples, "fingerprint": fp}
    write_shard(out, shard, samples, rows, schema=side.schema.remove_metadata(), stats=stats)
    return stats


def default_batch_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 4


def features(cfg: FeaturesConfig, progress=None) -> dict:
    """Run the stage (plan -> map_shards -> summarise); returns the report (also written to OUT/report.json)."""
    threads = torch.get_num_threads()
    try:
        return _features(cfg, progress)
    finally:  # the encode threads set torch's process-wide intra-op count to 1: give the caller theirs back
        torch.set_num_threads(threads)


def _features(cfg: FeaturesConfig, progress) -> dict:
    if cfg.dtype not in DTYPES:
        raise VlprepError(f"--dtype must be float16 or float32, got {cfg.dtype!r}")
    if cfg.batch_size is not None and cfg.batch_size < 1:
        raise VlprepError("--batch-size must be at least 1")
    if cfg.decode_threads < 0:
        raise VlprepError("--decode-threads must be 0 (decode in the worker's main thread) or more")
    check_engine(cfg.distributor, cfg.workers)
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards, (cfg.weights,))
    # Each worker's calls run side by side on this many threads of one intra-op thread each: the cores, shared.
    encode_threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    initargs = (cfg.image_model, cfg.weights, cfg.size, cfg.device, cfg.decode_threads, encode_threads)
    _init_worker(*initargs)  # checks the encoder and weights before OUT is touched; one worker reuses it
    enc = _worker["enc"]
    device = _worker["device"]
    batch_size = cfg.batch_size or default_batch_size(device)
    precision = resolve_precision(cfg.precision, device)
    spec = {**enc.spec, "dtype": cfg.dtype}
    options = {"image_model": cfg.image_model, "weights": spec["weights"], "size": spec["size"],
               "dtype": cfg.dtype, "batch_size": batch_size, "src": ds.location}
    if precision != "fp32":  # recorded where it changes the tokens; fp32 keeps the options of earlier runs
        options["precision"] = precision
    with writing_output(out, "features", options, cfg.overwrite) as out:
        # A shard is redone when its input sidecar or anything that changes the tokens (weights bytes and the call
        # shape included) differs.
        # (bf16 tokens are other tokens; fp32 keeps the salt of the runs before --precision existed)
        salt = json.dumps({**spec, "batch_size": batch_size, **({"precision": precision} if precision != "fp32"
                                                                  else {})}, sort_keys=True).encode()
        plan = [Work(s, (ds.source, s, cfg.dtype, batch_size, precision),
                     ds.fingerprint(s, salt), ds.sizes[s])
                for s in ds.shards]
        t_work = time.perf_counter()
        stats, resumed = map_shards(out, plan, features_shard, init=_init_worker,
                                    initargs=initargs,
                                    workers=cfg.workers, distributor=cfg.distributor, progress=progress,
                                    label="features", total=ds.num_samples, start="spawn", gpu=cfg.device == "cuda")
        processed = sum(ds.sizes[s] for s in ds.shards if s not in resumed)
        work_s = time.perf_counter() - t_work
        skipped, examples = merged_skips(stats.values(), limit=MAX_EXAMPLES)
        n_in = sum(st["in"] for st in stats.values())
        written = sum(st["written"] for st in stats.values())
        sizes = {s: stats[s]["written"] for s in ds.shards}
        finish_dataset(out, sizes, {"stage": "features", "input": redact(str(cfg.src)), "options": options,
                                    "counts": {"in": n_in, "written": written}, "features": spec})
        elapsed = time.perf_counter() - t0
        report = {
            "stage": "features", "source": redact(str(cfg.src)), "features": spec, "samples_in": n_in,
            "written": written,
            "skipped": dict(sorted(skipped.items())), "skipped_examples": dict(sorted(examples.items())),
            "npy_bytes": spec["tokens"] * spec["dim"] * np.dtype(cfg.dtype).itemsize, "device": str(device),
            "shards": len(ds.shards), "shards_resumed": len(resumed), "bad_shards": ds.bad,
            "elapsed_s": round(elapsed, 3),
            "images_per_s": round(processed / work_s, 2) if processed else None,
        }
        write_json_atomic(out.root / "report.json", report)
    return report

"""Datasets in object storage against the same data on local disk, in the same run, on servers of this machine only
(127.0.0.1: Python's http.server and moto's standalone S3 server, tests/integration/servers.py).

A: vltrain's loader throughput, samples/s over one epoch of the random stream (ShardStream through the run's
   DataLoader, pixel decode, crop and tokenisation included), the shards read from disk (baseline) and from
   http://127.0.0.1 (vlprep.objstore's ranged reads; the server in a process of its own, as a real one is).
   Target: >= 0.9x the local throughput on loopback.
B: `vlprep bow` wall time with OUT on the local S3 endpoint (staging folder, uploads, listing, lock object) against
   a local OUT, the same input, --workers as given. Informational (no target: the upload cost is the store's).
Rounds alternate the order of the sides after one untimed warm-up round (benchmarks/common.py); medians decide.
Needs the [cloud] and [test] extras (s3fs, aiohttp, moto). Load averages are printed at start and end.

    .venv/bin/python benchmarks/remote.py [--samples 2000] [--per-shard 250] [--repeats 3] [--workers 2]
"""

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
from common import load_line, print_table, ratio_row, time_sides, value_row  # noqa: E402

# The servers the object-storage tests use (a benchmark reuses them rather than keeping a copy of its own).
from tests.integration.servers import http_server_process, moto_s3, s3_env  # noqa: E402


def make_source(folder: Path, n: int) -> Path:
    """n captioned 160 x 120 JPEG photos-like images (noise over a colour, ~8 KB each)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = "a red cat sits on the green grass near a small wooden house by the lake at dusk".split()
    for i in range(n):
        base = rng.integers(0, 255, 3)
        img = np.clip(base + rng.integers(-40, 40, (120, 160, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(folder / f"{i:05d}.jpg", quality=90)
        (folder / f"{i:05d}.txt").write_text(" ".join(rng.choice(words, size=10)))
    return folder


def loader_epoch(data: str, workers: int, batch: int) -> tuple[int, float]:
    """(samples, seconds) of one epoch of the run's training loader over `data` (a folder or a URL)."""
    import torch

    from vltrain.data.feed import make_loader
    from vltrain.config_load import load_config
    from vltrain.trainset import prepare

    cfg = load_config("clip", sets=["model.text_model=tiny", "model.image_model=tiny", "data.image_size=96",
                                    f"data.workers={workers}", "data.val_frac=0"],
                      shards=[data], batch_size=batch, device="cpu")
    cfg, d, _ = prepare(cfg, torch.device("cpu"))
    loader = make_loader(cfg.seed, d.train, None, d.collate, cfg.batch_size, workers, torch.device("cpu"))
    d.train.set_epoch(0)
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(b["keys"]) if b is not None else 0
    return n, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--per-shard", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="loader workers (A) and bow workers (B)")
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    for name in ("fsspec", "aiohttp", "s3fs", "moto"):
        try:
            __import__(name)
        except ImportError:
            sys.exit(f"{name} is not installed: this benchmark needs the [cloud] and [test] extras")
    print(load_line("start"))
    from vlprep.bow import BowConfig, bow
    from vlprep.shards import ShardsConfig, build_shards

    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        tmp = Path(tmp)
        src = make_source(tmp / "src", args.samples)
        build_shards(ShardsConfig(src=src, out=tmp / "raw", samples_per_shard=args.per_shard, workers=args.workers))
        rows = []

        # --- A: loader throughput, disk vs http://127.0.0.1
        with http_server_process(tmp) as base:
            rates = {"local": [], "http": []}

            def side(name: str):
                data = str(tmp / "raw") if name == "local" else f"{base}/raw/"

                def fn(out: Path) -> None:
                    n, secs = loader_epoch(data, args.workers, args.batch_size)
                    rates[name].append(n / secs)
                return fn

            print(f"A: loader, one epoch of {args.samples} samples in shards of {args.per_shard}, "
                  f"{args.workers} workers, batch {args.batch_size}")
            times = time_sides({"local": side("local"), "http": side("http")}, args.repeats, tmp, label="A ")
            rates = {k: v[1:] for k, v in rates.items()}  # the warm-up round is not counted
            rows.append(ratio_row("A loader epoch, http/disk", times["local"], times["http"], None))
            ratio = statistics.median(rates["http"]) / statistics.median(rates["local"])
            print(f"  loader throughput: disk {statistics.median(rates['local']):.0f} samples/s, http "
                  f"{statistics.median(rates['http']):.0f} samples/s: {ratio:.2f}x", flush=True)
            rows.append(value_row("A http / disk throughput", ratio, 0.9, "x"))

        # --- B: vlprep bow, OUT on the local S3 endpoint vs a local OUT
        with moto_s3(tmp / "moto.log") as endpoint:
            os.environ.update(s3_env(endpoint))
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir("bench")
            count = itertools.count()
            cfg = {"ops": "shuffle,rmstop,keep:4", "base_frac": 0.1, "workers": args.workers}

            def bow_local(out: Path) -> None:
                bow(BowConfig(src=tmp / "raw", out=out / "bow", **cfg))

            def bow_s3(out: Path) -> None:
                bow(BowConfig(src=tmp / "raw", out=f"s3://bench/bow-{next(count)}", **cfg))

            print(f"B: vlprep bow of {args.samples} samples, --workers {args.workers}")
            times = time_sides({"local OUT": bow_local, "s3 OUT": bow_s3}, args.repeats, tmp, label="B ")
            rows.append(ratio_row("B bow, s3 OUT / local OUT", times["local OUT"], times["s3 OUT"], None))
    print_table(rows)
    print(load_line("end"))


if __name__ == "__main__":
    main()

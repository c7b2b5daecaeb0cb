"""Benchmark vlprep's shard engine: `--distributor ray` against the local process pool, same work, same run.

The work is the second pass of `vlprep bow` (default ops) over a synthetic 40-shard dataset (`--shards`,
`--per-shard` samples each, a small PNG-like payload per sample, which bow copies untouched): for every shard,
`bow.bow_shard` reads the sidecar and the tar, deforms the captions and writes the new tar + sidecar under .tmp
names, then renames them. Every side runs the same function on the same plan with 2 workers that each ran bow's
initializer (the base vocabulary and top set) once, and writes into a fresh empty folder.

- baseline: the fastest plain way, no vlprep engine: `concurrent.futures.ProcessPoolExecutor(2, fork,
  initializer)` and `pool.map(bow_shard, ...)` over the shards, in order.
- local: `map_shards(..., workers=2, distributor="local")` (the same process pool, plus resume checks,
  bounded in-flight submission and the counts).
- ray: `map_shards(..., workers=2, distributor="ray")` on a local Ray (this machine's CPUs; 2 actors of 1 CPU).

Start-up is excluded and reported on its own: each side's executor is created and every worker has run its
initializer (a warm-up task per worker) before the clock starts; Ray's start-up is `ray.init` plus the actors.
The sides are interleaved (baseline, local, ray, baseline, ...) `--repeats` times; medians decide. Target: ray /
baseline <= 1.2.

    .venv/bin/python benchmarks/engine.py [--shards 40] [--per-shard 1000] [--repeats 3]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from vlprep.bow import DEFAULT_OPS, _init_worker, base_statistics, bow_shard, parse_ops, shard_fingerprints
from vlprep.dataset import finish_dataset, open_dataset, shard_name, write_shard
from vlprep.engine import PoolExecutor, RayExecutor, Work, map_shards, ray_connect

TARGET = 1.2
WORDS = ("a the of in and with on dog cat man woman car tree house red blue green small big old young runs sits "
         "stands near under over beach street park table chair kite boat bird horse field sky water road").split()


def make_dataset(root: Path, shards: int, per_shard: int) -> None:
    root.mkdir()
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 255, 2048, dtype=np.uint8).tobytes()  # bow copies image bytes untouched
    sizes = {}
    for s in range(shards):
        name = shard_name("bench", s)
        samples, rows = [], []
        for i in range(per_shard):
            key = f"bench_{s * per_shard + i:09d}"
            caption = " ".join(rng.choice(WORDS, size=int(rng.integers(6, 16))))
            samples.append({"__key__": key, "png": payload, "txt": caption, "json": {"uid": key}})
            rows.append({"key": key, "caption": caption})
        sizes[name] = write_shard(root, name, samples, rows)
    finish_dataset(root, sizes, {"stage": "benchmark"})


def _nothing(seconds: float) -> int:
    time.sleep(seconds)  # long enough that each worker takes one: every worker has started and run its init
    return os.getpid()


def baseline(pool, ds, out: Path, fps: dict) -> None:
    list(pool.map(bow_shard, [out] * len(ds.shards), [ds.root] * len(ds.shards), ds.shards,
                  [fps[s] for s in ds.shards]))


def engine(ex, ds, out: Path, fps: dict) -> None:
    plan = [Work(s, (ds.root, s), fps[s], ds.sizes[s]) for s in ds.shards]
    stats, resumed = map_shards(out, plan, bow_shard, workers=2, executor=ex)
    assert not resumed and len(stats) == len(ds.shards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    try:
        t = time.perf_counter()
        make_dataset(tmp / "src", args.shards, args.per_shard)
        ds = open_dataset(tmp / "src")
        cascade = parse_ops(DEFAULT_OPS)
        ctx, _ = base_statistics(ds, cascade, 0.1, 0)
        fps = shard_fingerprints(ds, ctx)
        initargs = (DEFAULT_OPS, ctx, 0, 0.1, False)
        print(f"data: {args.shards} shards x {args.per_shard} samples ({ds.num_samples:,}), built in "
              f"{time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs", flush=True)

        # --- start-up, excluded from the timings below
        t = time.perf_counter()
        plain = ProcessPoolExecutor(2, mp_context=get_context("fork"), initializer=_init_worker, initargs=initargs)
        assert len(set(plain.map(_nothing, [0.3, 0.3]))) == 2
        t_plain = time.perf_counter() - t - 0.3
        t = time.perf_counter()
        local = PoolExecutor(2, _init_worker, initargs)
        assert len({f.result() for f in [local.submit(_nothing, 0.3) for _ in range(2)]}) == 2
        t_local = time.perf_counter() - t - 0.3
        t = time.perf_counter()
        ray_connect()  # as the stages do: RAY_ADDRESS, else a local Ray with this machine's CPUs
        t_init = time.perf_counter() - t
        on_ray = RayExecutor(2, _init_worker, initargs)
        on_ray.ready()
        t_ray = time.perf_counter() - t
        print(f"start-up (excluded): plain pool {t_plain:.2f} s, map_shards local pool {t_local:.2f} s, "
              f"ray {t_ray:.2f} s (ray.init {t_init:.2f} s + 2 actors with bow's initializer "
              f"{t_ray - t_init:.2f} s)", flush=True)

        times = {"baseline": [], "local": [], "ray": []}
        runs = {"baseline": lambda out: baseline(plain, ds, out, fps),
                "local": lambda out: engine(local, ds, out, fps),
                "ray": lambda out: engine(on_ray, ds, out, fps)}
        for r in range(args.repeats):
            for name, run in runs.items():
                out = tmp / f"{name}-{r}"
                out.mkdir()
                t = time.perf_counter()
                run(out)
                times[name].append(time.perf_counter() - t)
                shutil.rmtree(out)
            print(f"  repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
        plain.shutdown()
        local.shutdown()
        on_ray.shutdown()
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["ray"] / med["baseline"]
        print(f"median: baseline (plain ProcessPoolExecutor.map, 2 workers) {med['baseline']:.2f} s "
              f"({ds.num_samples / med['baseline']:,.0f} samples/s); map_shards local 2 workers {med['local']:.2f} s "
              f"({med['local'] / med['baseline']:.3f}x); map_shards ray 2 actors {med['ray']:.2f} s")
        print(f"ray / baseline: {ratio:.3f}x (ray / map_shards local {med['ray'] / med['local']:.3f}x); "
              f"target <= {TARGET}: {'PASS' if ratio <= TARGET else 'FAIL'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

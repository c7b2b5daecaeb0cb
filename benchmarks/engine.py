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
Rounds alternate the order of the sides (baseline, local, ray, then ray, local, baseline, ...) `--repeats` times
after one untimed round; medians of wall and CPU time (this process and its reaped children; a live pool's workers
are not reaped, so the CPU column counts the driver only) decide. With `--isolate` every timed call runs in a fresh
process that builds its own executor before its clock starts. Target: ray / baseline <= 1.2. The load average is
printed at the start and the end.

    .venv/bin/python benchmarks/engine.py [--shards 40] [--per-shard 1000] [--repeats 3] [--isolate]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from vlprep.bow import (DEFAULT_OPS, init_worker, base_statistics, bow_shard, parse_ops,  # noqa: E402
                        shard_fingerprints)
from vlprep.dataset import open_dataset  # noqa: E402
from vlprep.engine import PoolExecutor, RayExecutor, Work, map_shards, ray_connect  # noqa: E402
from vlprep.output import Out, finish_dataset, shard_name, write_shard  # noqa: E402

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
        samples = []
        rows = []
        for i in range(per_shard):
            key = f"bench_{s * per_shard + i:09d}"
            caption = " ".join(rng.choice(WORDS, size=int(rng.integers(6, 16))))
            samples.append({"__key__": key, "png": payload, "txt": caption, "json": {"uid": key}})
            rows.append({"key": key, "caption": caption})
        sizes[name] = write_shard(Out(root), name, samples, rows)
    finish_dataset(Out(root), sizes, {"stage": "benchmark"})


def _nothing(seconds: float) -> int:
    time.sleep(seconds)  # long enough that each worker takes one: every worker has started and run its init
    return os.getpid()


def baseline(pool, ds, out: Path, fps: dict) -> None:
    list(pool.map(bow_shard, [Out(out)] * len(ds.shards), [ds.root] * len(ds.shards), ds.shards,
                  [fps[s] for s in ds.shards]))


def engine(ex, ds, out: Path, fps: dict) -> None:
    plan = [Work(s, (ds.root, s), fps[s], ds.sizes[s]) for s in ds.shards]
    stats, resumed = map_shards(Out(out), plan, bow_shard, workers=2, executor=ex)
    assert not resumed and len(stats) == len(ds.shards)


def make_sides(root: Path, names: tuple[str, ...]) -> tuple[dict[str, common.Side], list]:
    """The sides named, over root/src, each with its executor started and warm (not timed); and the executors."""
    ds = open_dataset(root / "src")
    ctx, _ = base_statistics(ds, parse_ops(DEFAULT_OPS), 0.1, 0)
    fps = shard_fingerprints(ds, ctx)
    initargs = (DEFAULT_OPS, ctx, 0, 0.1, False)
    sides = {}
    executors = []
    startup = {}
    if "baseline" in names:
        t = time.perf_counter()
        plain = ProcessPoolExecutor(2, mp_context=get_context("fork"), initializer=init_worker, initargs=initargs)
        assert len(set(plain.map(_nothing, [0.3, 0.3]))) == 2
        startup["plain pool"] = time.perf_counter() - t - 0.3
        sides["baseline"] = lambda out: baseline(plain, ds, out, fps)
        executors.append(plain)
    if "local" in names:
        t = time.perf_counter()
        local = PoolExecutor(2, init_worker, initargs)
        assert len({f.result() for f in [local.submit(_nothing, 0.3) for _ in range(2)]}) == 2
        startup["map_shards local pool"] = time.perf_counter() - t - 0.3
        sides["local"] = lambda out: engine(local, ds, out, fps)
        executors.append(local)
    if "ray" in names:
        t = time.perf_counter()
        ray_connect()  # as the stages do: RAY_ADDRESS, else a local Ray with this machine's CPUs
        t_init = time.perf_counter() - t
        on_ray = RayExecutor(2, init_worker, initargs)
        on_ray.ready()
        startup["ray"] = time.perf_counter() - t
        startup["of which ray.init"] = t_init
        sides["ray"] = lambda out: engine(on_ray, ds, out, fps)
        executors.append(on_ray)
    print("start-up (excluded): " + ", ".join(f"{k} {v:.2f} s" for k, v in startup.items()), flush=True)
    return sides, executors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    common.add_options(ap)
    args = ap.parse_args()
    if args.side is not None:  # a child of --isolate: the dataset exists; start only this side's executor
        sides, _ = make_sides(args.side_dir, (args.side,))
        common.run_child(args, sides)  # exits: the executors go with the process
    print(common.load_line("start"), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    executors = []
    try:
        t = time.perf_counter()
        make_dataset(tmp / "src", args.shards, args.per_shard)
        n = open_dataset(tmp / "src").num_samples
        print(f"data: {args.shards} shards x {args.per_shard} samples ({n:,}), built in "
              f"{time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs", flush=True)
        names = ("baseline", "local", "ray")
        if args.isolate:
            sides = {name: None for name in names}  # time_sides starts a child per call
        else:
            sides, executors = make_sides(tmp, names)
        times = common.time_sides(sides, args.repeats, tmp, args.isolate)
        rows = [common.ratio_row("ray / plain pool", times["baseline"], times["ray"], TARGET),
                common.ratio_row("map_shards local / plain pool", times["baseline"], times["local"], None),
                common.ratio_row("ray / map_shards local", times["local"], times["ray"], None)]
        print(f"baseline (plain ProcessPoolExecutor.map, 2 workers): {n / common.median(times['baseline']['wall']):,.0f}"
              " samples/s")
    finally:
        for ex in executors:
            ex.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    common.print_table(rows)
    print(common.load_line("end"))


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check's end-to-end rows (scripts/gpu-check.sh): `vltrain run` trained from JPEG shards of photograph-like
images, to hold against benchmarks/gpu.py's synthetic-batch rows (the same towers, preset, batch and precision).

    python scripts/gpu_e2e.py shards OUT N [--copies C] [--small]
        N photograph-like JPEGs (benchmarks/loader.py's `photo`, quality 90; 500x375 and 640x480, --small: 160x120
        and 200x150) with captions, generated on every CPU this process may use, each written C times under its own
        key into shards of 100 by vlprep's shard writer: OUT/shards. C copies make an epoch long enough that the
        timed steps never cross an epoch's start (where the loader's workers each begin a batch afresh), as on a
        real dataset; decoding a copy costs what decoding the original does.
    python scripts/gpu_e2e.py run SHARDS RUN_DIR --size base --preset clip --batch 128 --steps 40
        [--device cuda] [--precision bf16] [--log-every 5]
        `vltrain run` in this process, with the towers and options of benchmarks/gpu.py's row of that size and
        preset (its `config_sets`) except data.workers (auto: the node's cores); no held-out split, no evaluation.
        The main process's wait for each batch (`Feed.next`, timed from the outside: the trainer's metrics rows
        hold samples/s but no data time) goes to RUN_DIR/data_wait.jsonl: a header {workers, prefetch}, then one
        {step, wait_s, end_s} per step.

`python scripts/gpu_check.py e2e` reads those two files into the check's row.
"""

import argparse
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_SIZES = ((160, 120), (200, 150))  # the dry run's photographs: the same generator, decoded quickly


def bench_module(name: str):
    """benchmarks/NAME.py as a module (the benchmarks folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_photos(src: Path, first: int, count: int, sizes, copies: int, seed: int) -> int:
    """Photos first..first+count-1 into `src`, photo i drawn from its own seed (seed, i) so that any split of the
    work among processes writes the same files; each as C hard-linked copies (key PHOTO_COPY). Their bytes."""
    import numpy as np

    loader = bench_module("loader")
    nbytes = 0
    for i in range(first, first + count):
        rng = np.random.default_rng((seed, i))
        path = src / f"{i:06d}_0.jpg"
        loader.photo(rng, *sizes[i % len(sizes)]).save(path, "JPEG", quality=90)
        caption = " ".join(rng.choice(loader.WORDS, size=int(rng.integers(8, 15))))
        (src / f"{i:06d}_0.txt").write_text(caption)
        for c in range(1, copies):
            os.link(path, src / f"{i:06d}_{c}.jpg")
            (src / f"{i:06d}_{c}.txt").write_text(caption)
        nbytes += path.stat().st_size
    return nbytes


def make_shards(out: Path, n: int, copies: int, small: bool, seed: int = 0) -> Path:
    """OUT/shards from n photos x `copies` (module docstring); prints what it made and how long it took."""
    from vlprep.shards import ShardsConfig, build_shards

    t0 = time.perf_counter()
    src = out / "src"
    src.mkdir(parents=True)
    cpus = len(os.sched_getaffinity(0))
    sizes = SMALL_SIZES if small else bench_module("loader").SIZES
    chunk = -(-n // cpus)
    with ProcessPoolExecutor(max_workers=cpus) as pool:
        jobs = [pool.submit(write_photos, src, a, min(chunk, n - a), sizes, copies, seed) for a in range(0, n, chunk)]
        nbytes = sum(j.result() for j in jobs)
    made = time.perf_counter() - t0
    build_shards(ShardsConfig(src=src, out=out / "shards", samples_per_shard=100, workers=cpus), progress=None)
    print(f"{n} photograph-like JPEGs ({nbytes / n / 1e3:.0f} KB mean) x {copies} copies in {made:.1f} s on {cpus} "
          f"processes; shards in {time.perf_counter() - t0 - made:.1f} s", flush=True)
    return out / "shards"


def run(args) -> int:
    """`vltrain run` as the module docstring says; its exit status."""
    from vltrain import cli
    from vltrain.data import feed

    sets = [s for s in bench_module("gpu").config_sets(args.size, args.preset, args.precision, "off", False)
            if not s.startswith("data.workers=")]
    sets += ["data.workers=-1", f"log_every={args.log_every}", f"eval_every={10 * args.steps}",
             f"ckpt_every={10 * args.steps}"]
    argv = ["run", str(args.shards), "--preset", args.preset, "--out", str(args.run_dir), "--steps", str(args.steps),
            "--batch-size", str(args.batch), "--device", args.device]
    for s in sets:
        argv += ["--set", s]
    waits, header = [], {}
    original = feed.Feed.next

    def timed_next(self, state):
        header.setdefault("workers", self.workers)
        header.setdefault("prefetch", self.prefetch)
        t0 = time.perf_counter()
        try:
            return original(self, state)
        finally:
            waits.append((t0, time.perf_counter()))

    print("vltrain " + " ".join(argv), flush=True)
    feed.Feed.next = timed_next
    saved_argv = sys.argv
    sys.argv = ["vltrain", *argv]
    try:
        cli.main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        feed.Feed.next = original
        sys.argv = saved_argv
    args.run_dir.mkdir(parents=True, exist_ok=True)
    start = waits[0][0] if waits else 0.0
    with open(args.run_dir / "data_wait.jsonl", "w") as f:
        f.write(json.dumps(header) + "\n")
        for step, (t0, t1) in enumerate(waits, 1):
            f.write(json.dumps({"step": step, "wait_s": round(t1 - t0, 6), "end_s": round(t1 - start, 6)}) + "\n")
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("shards")
    sh.add_argument("out", type=Path)
    sh.add_argument("n", type=int)
    sh.add_argument("--copies", type=int, default=1)
    sh.add_argument("--small", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("shards", type=Path)
    r.add_argument("run_dir", type=Path)
    r.add_argument("--size", default="base")
    r.add_argument("--preset", default="clip")
    r.add_argument("--batch", type=int, default=128)
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--device", default="cuda")
    r.add_argument("--precision", default="bf16")
    r.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args(argv)
    if args.cmd == "shards":
        if args.n < 1 or args.copies < 1:
            ap.error("N and --copies must be at least 1")
        make_shards(args.out, args.n, args.copies, args.small)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

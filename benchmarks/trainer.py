"""Benchmark vltrain's loop and data pipeline against bare baselines measured in the same run (DESIGN.md section 9).

A: loop overhead. `vltrain.train.train` itself runs (tiny model, preset albef, batch 16, image size 32) with its
   DataLoader monkeypatched to yield ~20 batches pre-loaded in memory, so each step is exactly the loop's body
   (data-RNG fork, lr update, train_step, loss floats, backward, grad clip, AdamW, momentum update, enqueue,
   metric rows, progress). A step's time is the gap between two consecutive batch fetches. Baseline: the same
   model and batches, train_step + loss.backward() + opt.step() + opt.zero_grad() and nothing else.
B: loader throughput. vltrain's ShardStream + Collate (MiniLM tokenizer, train_transform 224, DataLoader with
   2 workers, batch 32) vs a plain `webdataset` pipeline with the same decode (`to_rgb`), transform and collate,
   on the same shards; samples/s from creating the loader iterator to exhausting it.
Runs are interleaved (baseline, candidate, baseline, ...) so drift hits both sides alike; medians decide.

    .venv/bin/python benchmarks/trainer.py [--repeats 5] [--steps 40] [--shards DIR] [--images 1500]
"""

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer runs in forked workers in B

import torch  # noqa: E402
import webdataset as wds  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import vltrain.train as vt  # noqa: E402
from vltrain.config import load_config  # noqa: E402
from vltrain.data import Collate, ShardStream, to_rgb, train_transform  # noqa: E402
from vltrain.model import IMAGE_STATS, ModelConfig, build_model, build_tokenizer  # noqa: E402

DEMO_SHARDS = Path(__file__).resolve().parent.parent / "demo-out" / "openclipart" / "shards"
CLIPART = Path("/usr/share/openclipart/png")
N_BATCHES = 20
SKIP = 5  # first steps of every run left out of the median: allocator and autograd warm-up


# --- the shards -----------------------------------------------------------------------------------


def get_shards(arg: Path | None, images: int, tmp: Path) -> tuple[Path, str]:
    """An existing shard folder (--shards, else the demo one), or ~`images` clip-art PNGs built at --resize 256."""
    if arg is not None or DEMO_SHARDS.is_dir():
        folder = arg or DEMO_SHARDS
        return folder, f"existing shards {folder}"
    from vlprep.shards import ShardsConfig, build_shards

    src = tmp / "src"
    src.mkdir()
    paths = sorted(CLIPART.rglob("*.png"))[:images]
    if not paths:
        sys.exit(f"no shards at {DEMO_SHARDS} and no PNGs under {CLIPART}")
    for i, p in enumerate(paths):
        shutil.copyfile(p, src / f"{i:06d}.png")
        words = " ".join([p.parent.name, *p.stem.replace("-", "_").split("_")]).strip()
        (src / f"{i:06d}.txt").write_text(f"a clipart of {words}\n", encoding="utf-8")
    out = tmp / "shards"
    report = build_shards(ShardsConfig(src=src, out=out, samples_per_shard=1000, resize=256),
                          progress=None)
    return out, f"{report['written']} samples from {CLIPART} built with build_shards --resize 256"


# --- A: loop overhead ---------------------------------------------------------------------------


def small_config(shards: Path, out: Path, steps: int):
    return load_config("albef", None, [f"shards=[{shards}]", f"out={out}", f"steps={steps}", "batch_size=16",
                                       "data.image_size=32", "data.workers=0", "model.text_model=tiny",
                                       "model.image_model=tiny", "device=cpu"])


def preload(cfg) -> list[dict]:
    """N_BATCHES training batches (B=16, 3x32x32) read once through vltrain's own pipeline, kept in memory."""
    stats = IMAGE_STATS["tiny"]
    stream = ShardStream(cfg.shards, "train", cfg.data.val_frac,
                         train_transform(cfg.data.image_size, stats["mean"], stats["std"], cfg.data.min_crop_scale))
    tok = build_tokenizer(ModelConfig(text_model="tiny"))
    loader = DataLoader(stream, batch_size=cfg.batch_size, drop_last=True, collate_fn=Collate(tok, cfg.data.max_len))
    return list(itertools.islice(loader, N_BATCHES))


class FakeLoader:
    """Stands in for torch's DataLoader inside vltrain.train: yields the pre-loaded batches, stamping each fetch."""

    batches: list[dict] = []
    stamps: list[float] = []

    def __init__(self, dataset, drop_last: bool = False, **kwargs):
        self.training = drop_last  # the training loader drops the last batch; the eval loader (_embed) does not

    def __iter__(self):
        if not self.training:
            return  # no validation batches: the final evaluation finds nothing and is skipped
        for batch in itertools.cycle(FakeLoader.batches):
            FakeLoader.stamps.append(time.perf_counter())
            yield batch


def run_vltrain(cfg) -> float:
    """Median per-step seconds of one `train()` run fed from memory."""
    FakeLoader.stamps = []
    shutil.rmtree(cfg.out, ignore_errors=True)
    vt.train(cfg)
    gaps = [b - a for a, b in zip(FakeLoader.stamps, FakeLoader.stamps[1:])]
    return statistics.median(gaps[SKIP:])


def run_bare(cfg, batches: list[dict]) -> float:
    """Median per-step seconds of forward (train_step) + backward + optimiser step, same model and batches."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).train()
    generator = torch.Generator().manual_seed(cfg.seed)
    tok = vt.tokenizer_for(cfg.model.text_model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr)
    stamps = []
    for batch in itertools.islice(itertools.cycle(batches), cfg.steps):
        stamps.append(time.perf_counter())
        losses = vt.train_step(model, batch, cfg.loss, generator, tok, masked_text_all=cfg.data.masked_text_all)
        losses["total"].backward()
        opt.step()
        opt.zero_grad()
    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps[SKIP:])


def bench_loop(shards: Path, tmp: Path, steps: int, repeats: int) -> dict[str, list[float]]:
    cfg = small_config(shards, tmp / "run", steps)
    cfg.eval_every = cfg.ckpt_every = 10**9  # still runs once at the last step, after the last timed gap
    FakeLoader.batches = preload(cfg)
    vt.DataLoader = FakeLoader
    print(f"A: {len(FakeLoader.batches)} pre-loaded batches of {cfg.batch_size}, image {cfg.data.image_size}, "
          f"tiny model, preset albef (queue {cfg.model.queue_size}, momentum), {steps} steps per run, "
          f"first {SKIP} steps not counted, log_every {cfg.log_every}, torch threads {torch.get_num_threads()}",
          flush=True)
    sides = {"bare": lambda: run_bare(cfg, FakeLoader.batches), "vltrain": lambda: run_vltrain(cfg)}
    for fn in sides.values():  # untimed: lazy imports (tensorboard) and first-call costs
        fn()
    times = {k: [] for k in sides}
    for r in range(repeats):
        for side, fn in sides.items():
            times[side].append(fn())
        print(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms/step" for k, v in times.items()),
              flush=True)
    return times


# --- B: loader throughput -------------------------------------------------------------------------


def vltrain_loader(shards: Path, tf, collate, workers: int, batch: int) -> DataLoader:
    stream = ShardStream([shards], "train", 0.0, tf, seed=0)
    return DataLoader(stream, batch_size=batch, collate_fn=collate, drop_last=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(0))


def wds_loader(urls: list[str], tf, collate, workers: int, batch: int):
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
          .shuffle(1000)
          .map(lambda s: (tf(to_rgb(s["png"])), s["txt"].decode("utf-8"), s["__key__"]))
          .batched(batch, collation_fn=collate, partial=False))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def drain(make) -> float:
    """Samples/s from creating the loader iterator (worker start-up included) to exhausting it."""
    t0 = time.perf_counter()
    n = sum(len(b["captions"]) for b in make())
    return n / (time.perf_counter() - t0), n


def bench_loader(shards: Path, repeats: int, workers: int = 2, batch: int = 32) -> dict[str, list[float]]:
    stats = IMAGE_STATS["efficientnet-lite0"]
    tf = train_transform(224, stats["mean"], stats["std"])
    tok = build_tokenizer(ModelConfig())
    collate = Collate(tok, 32)
    urls = [str(p) for p in sorted(shards.glob("*.tar"))]
    sides = {"webdataset": lambda: wds_loader(urls, tf, collate, workers, batch),
             "vltrain": lambda: vltrain_loader(shards, tf, collate, workers, batch)}
    counts = {}
    for side, make in sides.items():  # untimed: page cache and first-call costs
        counts[side] = drain(make)[1]
    print(f"\nB: {len(urls)} shards, image 224 train_transform, MiniLM tokenizer, batch {batch}, {workers} workers, "
          f"full batches delivered per pass: " + ", ".join(f"{k} {v} samples" for k, v in counts.items()), flush=True)
    if len(set(counts.values())) != 1:
        print("  note: the two sides deliver different sample counts (samples/s stays comparable)")
    rates = {k: [] for k in sides}
    for r in range(repeats):
        for side, make in sides.items():
            rates[side].append(drain(make)[0])
        print(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.1f} samples/s" for k, v in rates.items()),
              flush=True)
    return rates


# --- report ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side (default 5)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run in A (default 40)")
    ap.add_argument("--shards", type=Path, default=None, help=f"shard folder (default {DEMO_SHARDS} if present)")
    ap.add_argument("--images", type=int, default=1500, help="clip-art PNGs to shard when no folder exists")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in A (default 1: on a small shared box more threads oversubscribe the CPUs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps <= SKIP + 2:
        sys.exit(f"--steps must be more than {SKIP + 2}")

    with tempfile.TemporaryDirectory(prefix="vltrain-bench-") as tmp:
        tmp = Path(tmp)
        shards, what = get_shards(args.shards, args.images, tmp)
        print(f"shards: {what}; python {sys.version.split()[0]}, torch {torch.__version__}, "
              f"webdataset {wds.__version__}, {os.cpu_count()} CPUs\n", flush=True)
        loop = bench_loop(shards, tmp, args.steps, args.repeats)
        load = bench_loader(shards, args.repeats)

    base, cand = statistics.median(loop["bare"]) * 1e3, statistics.median(loop["vltrain"]) * 1e3
    rows = [("A loop ms/step", base, cand, cand / base, "<= 1.10x", cand / base <= 1.10)]
    base, cand = statistics.median(load["webdataset"]), statistics.median(load["vltrain"])
    rows.append(("B loader samples/s", base, cand, cand / base, ">= 0.95x", cand / base >= 0.95))
    print(f"\n{'measure':<20} {'baseline':>10} {'candidate':>10} {'ratio':>7} {'target':>9}  result")
    for name, b, c, ratio, target, ok in rows:
        print(f"{name:<20} {b:>10.2f} {c:>10.2f} {ratio:>6.3f}x {target:>9}  {'PASS' if ok else 'FAIL'}")
    print("A: baseline = train_step + backward + AdamW step + zero_grad; candidate = vltrain.train() itself, "
          "its DataLoader\n   monkeypatched to yield pre-loaded batches, a step timed from one batch fetch to the next.")
    print("B: baseline = wds.WebDataset + shuffle(1000) + map(to_rgb, transform) + batched(Collate) in a WebLoader; "
          "candidate\n   = ShardStream (val_frac 0, shuffle buffer 1000) + Collate in a DataLoader; same workers.")


if __name__ == "__main__":
    main()

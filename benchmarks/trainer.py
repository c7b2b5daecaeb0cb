"""Benchmark vltrain's loop and data pipeline against bare baselines measured in the same run.

A: loop overhead. `vltrain.train.train` itself runs (tiny model, preset albef, batch 16, image size 32) fed 20
   batches pre-loaded in memory (train's `batches` argument), so each step is exactly the loop's body
   (data-RNG fork, lr update, train_step, loss floats, backward, grad clip, AdamW, momentum update, enqueue,
   metric rows every log_every steps, progress). A step's time is the gap between two consecutive batch fetches.
   Baseline ("bare"): the same work the step must do and nothing else, on the pieces `vltrain.session.setup`
   builds for the same config and batches (model, speed options, step function, optimiser, the global torch
   modes and freed memory kept as on a CPU): a plain loop of the step function under the run's precision, then
   `optimizer_step` (zero_grad, backward, clip_grad_norm_ at the preset's grad_clip, fused AdamW over the two
   parameter groups, momentum_update and dequeue_and_enqueue; albef has both).
   Reported per side: the median step and the mean over every step after the first SKIP (logging steps
   included; the median alone hides them), with its CPU time. The final step (evaluation, checkpoint) is not
   a timed gap. Target: mean and median <= 1.10x the bare step.
B: loader throughput. vltrain's ShardStream + Collate (MiniLM tokenizer, train_transform 224, DataLoader with
   2 workers, batch 32) vs a plain `webdataset` pipeline with the same decode (`decode_rgb`), transform and collate,
   on the same shards; samples/s from creating the loader iterator to exhausting it. Target >= 0.95x.
Rounds alternate the order of the sides (benchmarks/common.py) after one untimed warm-up round; medians over
rounds decide. `--isolate` runs every timed call in a fresh process. Load averages are printed at start and end.

    .venv/bin/python benchmarks/trainer.py [--repeats 5] [--steps 40] [--shards DIR] [--images 1500] [--parts a,b]
                                           [--isolate]
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
from vltrain.config import ModelConfig  # noqa: E402
from vltrain.config_load import load_config
from vlprep.dataset import decode_rgb  # noqa: E402
from vltrain.data.collate import Collate, to_device  # noqa: E402
from vltrain.data.samples import train_transform  # noqa: E402
from vltrain.data.stream import ShardStream  # noqa: E402
from vltrain.model import IMAGE_STATS, autocast, build_tokenizer  # noqa: E402
from vltrain.optim import optimizer_step  # noqa: E402
from vltrain.session import setup  # noqa: E402
from vltrain.step import distill_alpha_at  # noqa: E402
from vltrain.trainset import prepare  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_options, cpu_now, load_line, print_table_ms, ratio_row, run_child_figures,  # noqa: E402
                    time_sides_figures)

DEMO_SHARDS = Path(__file__).resolve().parent.parent / "demo-out" / "openclipart" / "shards"
CLIPART = Path("/usr/share/openclipart/png")
N_BATCHES = 20
SKIP = 5  # first steps of every run left out of the figures: allocator and autograd warm-up


# --- the shards -----------------------------------------------------------------------------------


def get_shards(arg: Path | None, images: int, tmp: Path) -> tuple[Path, str]:
    """An existing shard folder (--shards, else the demo one), or ~`images` clip-art PNGs built at --resize 256."""
    if arg is not None or DEMO_SHARDS.is_dir():
        folder = arg or DEMO_SHARDS
        return folder, f"existing shards {folder}"
    if (tmp / "shards").is_dir():  # an isolated child: its parent built them
        return tmp / "shards", "shards built by the parent process"
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
                                       "model.image_model=tiny", "model.fusion_layers=1", "device=cpu"])


def preload(cfg) -> list[dict]:
    """N_BATCHES training batches (B=16, 3x32x32) read once through vltrain's own pipeline, kept in memory."""
    stats = IMAGE_STATS["tiny"]
    tf = train_transform(cfg.data.image_size, stats["mean"], stats["std"], cfg.data.min_crop_scale)
    stream = ShardStream(cfg.shards, "train", cfg.data.val_frac, tf)
    tok = build_tokenizer(ModelConfig(text_model="tiny"))
    loader = DataLoader(stream, batch_size=cfg.batch_size, drop_last=True,
                        collate_fn=Collate(tok, cfg.data.max_len, norm=tf.norm))
    return list(itertools.islice(loader, N_BATCHES))


def step_figures(stamps: list[tuple[float, float]]) -> dict:
    """Per-step seconds from (wall, cpu) stamps taken at every batch fetch, the first SKIP steps left out: the
    median gap, and the mean and CPU-time mean over every step in between (logging steps included)."""
    kept = stamps[SKIP:]
    gaps = [b[0] - a[0] for a, b in zip(kept, kept[1:])]
    n = len(gaps)
    return {"median_s": statistics.median(gaps), "mean_s": (kept[-1][0] - kept[0][0]) / n,
            "cpu_mean_s": (kept[-1][1] - kept[0][1]) / n, "max_s": max(gaps)}


class Stamped:
    """The pre-loaded batches, cycled without end (one endless epoch), each fetch stamped (wall, CPU)."""

    def __init__(self, batches: list[dict]):
        self.batches = batches
        self.stamps: list[tuple[float, float]] = []

    def __iter__(self):
        for batch in itertools.cycle(self.batches):
            self.stamps.append((time.perf_counter(), cpu_now()))
            yield batch


def run_vltrain(cfg, batches: list[dict]) -> dict:
    """Per-step figures of one `train()` run fed from memory."""
    fed = Stamped(batches)
    shutil.rmtree(cfg.out, ignore_errors=True)
    vt.train(cfg, batches=fed)
    return step_figures(fed.stamps)


def run_bare(cfg, batches: list[dict]) -> dict:
    """Per-step figures of the step's own work and nothing else, on setup's pieces for the same config and batches."""
    s = setup(cfg, overwrite=True, quiet=True, batches=batches)
    s.close()  # only the pieces are used: no loader, and OUT is left to the next run
    stamps = []
    for step, batch in enumerate(itertools.islice(itertools.cycle(batches), s.cfg.steps), 1):
        stamps.append((time.perf_counter(), cpu_now()))
        batch = to_device(batch, s.device)  # as the loop: uint8 views normalised on the device
        with autocast(s.device, s.precision):
            losses = s.step_fn(batch, s.cfg.loss, s.generator, s.data.tokenizer, distill_alpha_at(step, s.cfg))
        queue_feats = losses.pop("queue_feats")
        optimizer_step(s.model, s.optimizer, s.params, losses["total"], s.cfg.optim.grad_clip, queue_feats)
    stamps.append((time.perf_counter(), cpu_now()))
    return step_figures(stamps)


def loop_sides(shards: Path, tmp: Path, steps: int) -> tuple[dict, object, list[dict]]:
    cfg = small_config(shards, tmp / "run", steps)
    cfg.eval_every = cfg.ckpt_every = 10**9  # still runs once at the last step, after the last timed gap
    batches = preload(cfg)
    resolved = prepare(cfg, torch.device(cfg.device))[0]  # what both sides train: the queue clamped to the data
    sides = {"bare": lambda out: run_bare(cfg, batches), "vltrain": lambda out: run_vltrain(cfg, batches)}
    return sides, resolved, batches


def bench_loop(sides: dict, cfg, n_batches: int, steps: int, repeats: int, isolate: bool, scratch: Path) -> dict:
    m = cfg.model
    print(f"A: {n_batches} pre-loaded batches of {cfg.batch_size}, image {cfg.data.image_size}, "
          f"tiny model, preset albef (queue {m.queue_size if m.queue_size else 'none'}, "
          f"momentum {'on' if m.momentum else 'off'}, grad_clip {cfg.optim.grad_clip}), {steps} steps per run, "
          f"first {SKIP} steps not counted, log_every {cfg.log_every}, torch threads {torch.get_num_threads()}"
          f"{', each run in a fresh process' if isolate else ''}", flush=True)
    times = time_sides_figures(sides, repeats, scratch, isolate, label="A ", show="mean_s", scale=1e3,
                               unit="ms/step (mean)")
    for side, t in times.items():
        print(f"  {side}: median step {statistics.median(t['median_s']) * 1e3:.2f} ms, mean step "
              f"{statistics.median(t['mean_s']) * 1e3:.2f} ms (CPU {statistics.median(t['cpu_mean_s']) * 1e3:.2f} "
              f"ms), slowest step {statistics.median(t['max_s']) * 1e3:.2f} ms (medians over runs)", flush=True)
    return times


# --- B: loader throughput -------------------------------------------------------------------------


def vltrain_loader(shards: Path, tf, collate, workers: int, batch: int) -> DataLoader:
    stream = ShardStream([shards], "train", 0.0, tf, seed=0)
    return DataLoader(stream, batch_size=batch, collate_fn=collate, drop_last=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(0))


def wds_loader(urls: list[str], tf, collate, workers: int, batch: int):
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
          .shuffle(1000)
          .map(lambda s: (tf(decode_rgb(s["png"])), s["txt"].decode("utf-8"), s["__key__"]))
          .batched(batch, collation_fn=collate, partial=False))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def drain(make) -> dict:
    """Samples/s from creating the loader iterator (worker start-up included) to exhausting it."""
    t0 = time.perf_counter()
    n = sum(len(b["captions"]) for b in make())
    rate = n / (time.perf_counter() - t0)
    return {"samples_per_s": rate, "s_per_sample": 1 / rate, "samples": n}


def loader_sides(shards: Path, workers: int = 2, batch: int = 32) -> dict:
    stats = IMAGE_STATS["efficientnet-lite0"]
    tf = train_transform(224, stats["mean"], stats["std"])
    tok = build_tokenizer(ModelConfig())
    collate = Collate(tok, 32, norm=tf.norm)
    urls = [str(p) for p in sorted(shards.glob("*.tar"))]
    return {"webdataset": lambda out: drain(lambda: wds_loader(urls, tf, collate, workers, batch)),
            "vltrain-loader": lambda out: drain(lambda: vltrain_loader(shards, tf, collate, workers, batch))}


def bench_loader(sides: dict, shards: Path, repeats: int, isolate: bool, scratch: Path,
                 workers: int = 2, batch: int = 32) -> dict:
    print(f"\nB: {len(list(shards.glob('*.tar')))} shards, image 224 train_transform, MiniLM tokenizer, batch {batch}, "
          f"{workers} workers{', each pass in a fresh process' if isolate else ''}", flush=True)
    rates = time_sides_figures(sides, repeats, scratch, isolate, label="B ", show="samples_per_s",
                               unit="samples/s")
    print("  median samples/s: " + ", ".join(f"{k} {statistics.median(v['samples_per_s']):.1f}"
                                           for k, v in rates.items()), flush=True)
    counts = {k: v["samples"][-1] for k, v in rates.items()}
    print("  full batches delivered per pass: " + ", ".join(f"{k} {v:.0f} samples" for k, v in counts.items()))
    if len(set(counts.values())) != 1:
        print("  note: the two sides deliver different sample counts (samples/s stays comparable)")
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
    ap.add_argument("--parts", default="a,b", help="which parts to run: a (loop), b (loader); default a,b")
    add_options(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps <= SKIP + 2:
        sys.exit(f"--steps must be more than {SKIP + 2}")
    parts = set(args.parts.split(","))
    if args.side is None:
        print(load_line("start"), flush=True)

    with tempfile.TemporaryDirectory(prefix="vltrain-bench-") as tmp:
        scratch = args.side_dir or Path(tmp)  # an isolated child works in its parent's set-up folder
        shards, what = get_shards(args.shards, args.images, scratch)
        if args.side is None:
            print(f"shards: {what}; python {sys.version.split()[0]}, torch {torch.__version__}, "
                  f"webdataset {wds.__version__}, {os.cpu_count()} CPUs\n", flush=True)
        rows = []
        if "a" in parts and args.side in (None, "bare", "vltrain"):
            sides, cfg, batches = loop_sides(shards, scratch, args.steps)
            run_child_figures(args, sides)
            t = bench_loop(sides, cfg, len(batches), args.steps, args.repeats, args.isolate, scratch)
            mean = {k: {"wall": v["mean_s"], "cpu": v["cpu_mean_s"]} for k, v in t.items()}
            med = {k: {"wall": v["median_s"], "cpu": v["cpu_mean_s"]} for k, v in t.items()}
            rows.append(ratio_row("A loop, mean step", mean["bare"], mean["vltrain"], 1.10,
                                  note="every step, logging steps included"))
            rows.append(ratio_row("A loop, median step", med["bare"], med["vltrain"], 1.10,
                                  note="cpu ratio of the means"))
        if "b" in parts and args.side in (None, "webdataset", "vltrain-loader"):
            sides = loader_sides(shards)
            run_child_figures(args, sides)
            t = bench_loader(sides, shards, args.repeats, args.isolate, scratch)
            per = {k: {"wall": v["s_per_sample"], "cpu": [c / n for c, n in zip(v["cpu"], v["samples"])]}
                   for k, v in t.items()}
            rows.append(ratio_row("B loader, time per sample", per["webdataset"], per["vltrain-loader"],
                                  round(1 / 0.95, 3), note="samples/s >= 0.95x the baseline's"))

    print("\n" + load_line("end"))
    print_table_ms(rows, "vltrain")
    if "a" in parts:
        print("A: baseline = train_step + zero_grad + backward + clip_grad_norm_ + fused AdamW (the trainer's "
              "groups) + momentum\n   update + enqueue; candidate = vltrain.train() itself, fed "
              "pre-loaded batches (train's batches\n   argument); a step is timed from one batch fetch to the next.")
    if "b" in parts:
        print("B: baseline = wds.WebDataset + shuffle(1000) + map(decode_rgb, transform) + batched(Collate) in a "
              "WebLoader; candidate\n   = ShardStream (val_frac 0, shuffle buffer 1000) + Collate in a DataLoader; "
              "same workers.")


if __name__ == "__main__":
    main()

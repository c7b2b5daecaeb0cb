"""Cost of the index-based samplers against a training step measured in the same run (DESIGN.md section 9).

A: GRIT's collect + group time per step as a fraction of one `grit`-preset training step (forward, backward,
   AdamW) at N = 96, M = 960, L = 48,000 with 256-dim ITC features on CPU. The GRIT side feeds L / N = 500
   steps' worth of random L2-normalised features through `GritSampler.collect`, which groups once when the
   L-queue fills (example shuffle, 50 sub-queues through `grit_order`), then builds the next epoch's order;
   that total over 500 steps is the per-step cost. Target: at most 2% (the paper's 2h27m -> 2h30m per epoch).
   The step is timed on in-memory tensors (no data loading), which makes the step shorter and the fraction
   larger than in a real run.
B: TOnICS sampling cost per batch (`TonicsBatchSampler.batch`: node draw + N_B distinct-image instances) at the
   paper's scale, 5.8M triplets of 2.84M images in 244 nodes, N_B = 256, for P(entity) = 1 and after 14
   refreshes (P(entity) = 0.23); also as a fraction of the step in A.

    .venv/bin/python benchmarks/samplers.py [--model default|tiny] [--steps 3] [--repeats 3]
"""

import argparse
import statistics
import time

import numpy as np
import torch

from vltrain.config import load_config
from vltrain.model import build_model
from vltrain.samplers import GritSampler, TonicsBatchSampler, TonicsCurriculum
from vltrain.model import tokenizer_for
from vltrain.train import train_step


def step_time(model_kind: str, n: int, steps: int) -> float:
    """Median seconds of one grit-preset optimiser step on a fixed in-memory batch of n pairs."""
    sets = [] if model_kind == "default" else ["model.text_model=tiny", "model.image_model=tiny", "data.image_size=32"]
    cfg = load_config("grit", sets=sets, batch_size=n, device="cpu")
    model = build_model(cfg.model).train()
    tok = tokenizer_for(cfg.model.text_model)
    size = cfg.data.image_size
    words = "a red cat sits on the green grass near a small wooden house by the lake".split()
    rng = np.random.default_rng(0)
    captions = [" ".join(rng.choice(words, size=12)) for _ in range(n)]
    enc = tok(captions, padding="longest", truncation=True, max_length=cfg.data.max_len, return_tensors="pt")
    batch = {"images": torch.randn(n, 3, size, size), "input_ids": enc["input_ids"],
             "attention_mask": enc["attention_mask"]}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 1):  # the first step warms up allocators and is not counted
        t0 = time.perf_counter()
        losses = train_step(model, batch, cfg.loss, gen, tok, masked_text_all=cfg.data.masked_text_all)
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def grit_cost(n: int, m: int, l_size: int, dim: int, seed: int) -> tuple[float, float]:
    """(seconds per step of collect + group over L/N steps incl. the next epoch's order, seconds per sub-queue)."""
    steps = l_size // n
    size = steps * n
    rng = np.random.default_rng(seed)
    img = torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(size, dim)).astype(np.float32)), dim=1)
    txt = torch.nn.functional.normalize(img + 0.5 * torch.from_numpy(rng.normal(size=(size, dim)).astype(np.float32)),
                                        dim=1)
    sampler = GritSampler(size, n, m, l_size, seed)
    batches = list(sampler)
    t0 = time.perf_counter()
    for b in batches:
        idx = torch.tensor(b)
        sampler.collect(idx, img[idx], txt[idx])
    sampler.set_epoch(1)
    total = time.perf_counter() - t0
    from vltrain.samplers import grit_order

    t1 = time.perf_counter()
    grit_order(img[:m], txt[:m], start=0)
    return total / steps, time.perf_counter() - t1


def tonics_cost(batch: int, refreshes: int, draws: int) -> float:
    """Median seconds per TOnICS batch at 5.8M triplets / 2.84M images / 244 nodes."""
    rng = np.random.default_rng(0)
    n_trip, n_img, n_nodes = 5_800_000, 2_840_000, 244
    image_of = np.sort(rng.integers(0, n_img, n_trip))
    cls = rng.zipf(1.3, n_trip) % n_nodes  # skewed node sizes, as in real data
    order = np.argsort(cls, kind="stable")
    bounds = np.searchsorted(cls[order], np.arange(n_nodes + 1))
    nodes = [order[bounds[k]:bounds[k + 1]] for k in range(n_nodes)]
    nodes = [x for x in nodes if len(np.unique(image_of[x])) >= batch]
    cur = TonicsCurriculum([len(x) for x in nodes])
    for _ in range(refreshes):
        cur.refresh()
    sampler = TonicsBatchSampler(cur, nodes, image_of, batch, period=draws)
    times = []
    for b in range(draws):
        t0 = time.perf_counter()
        sampler.batch(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["default", "tiny"], default="default",
                    help="the step to compare with: the packaged MiniLM + EfficientNet-Lite0 at 224 px, or tiny")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps")
    ap.add_argument("--repeats", type=int, default=3, help="GRIT epochs of L/N steps to time")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--search-space", type=int, default=960)
    ap.add_argument("--queue-size", type=int, default=48_000)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)

    print(f"training step ({args.model} model, grit preset, N={args.batch}, {args.steps} steps) ...", flush=True)
    step = step_time(args.model, args.batch, args.steps)
    print(f"  median step: {step:.3f} s")

    runs = [grit_cost(args.batch, args.search_space, args.queue_size, args.dim, seed) for seed in range(args.repeats)]
    per_step = statistics.median(r[0] for r in runs)
    per_queue = statistics.median(r[1] for r in runs)
    print(f"A. GRIT collect + group, N={args.batch} M={args.search_space} L={args.queue_size} D={args.dim}: "
          f"{per_step * 1e3:.2f} ms per step (median of {args.repeats}; "
          f"{', '.join(f'{r[0] * 1e3:.2f}' for r in runs)}), grit_order on one sub-queue {per_queue * 1e3:.1f} ms")
    frac = per_step / step
    print(f"   fraction of a training step: {100 * frac:.3f}%  (target <= 2%: {'PASS' if frac <= 0.02 else 'MISS'})")

    for refreshes in (0, 14):
        t = tonics_cost(256, refreshes, 300)
        print(f"B. TOnICS batch of 256 from 5.8M triplets, {refreshes:2d} refreshes: {t * 1e3:.3f} ms per batch "
              f"({100 * t / step:.4f}% of the step above)")


if __name__ == "__main__":
    main()

"""Cost of the index-based samplers per training step, at the papers' sizes.

A: GRIT collect + group, in milliseconds per training step, against a budget of 2% of a 1 s step (20 ms; the
   paper: 2h27m -> 2h30m per epoch, ~2%, on GPU steps of 0.2-1 s). At N = 96, M = 960, L = 48,000 (§5.1) with
   256-wide random L2-normalised ITC features, a side feeds one epoch of L / N = 500 steps through
   `GritSampler.collect` (the queue fills once: example shuffle, 50 sub-queues grouped) and builds the next
   epoch's order (`set_epoch(1)`); total time / 500 is the per-step cost. Sides:
   - grit: the features are CPU tensors (a CPU run);
   - grit-cuda (only when CUDA is present): the features are device tensors, as the trainer passes them; the
     clock stops after a synchronise;
   - grit-former (informational): the former implementation, kept here as the reference: features
     copied to numpy at every collect, then one sub-queue at a time, one Python step per example.
   Informational too: that cost as a fraction of one `grit`-preset CPU training step (--model tiny or default;
   none to skip), which says little about a GPU run, where the step is 0.2-1 s.
B: TOnICS sampling cost per batch (`TonicsBatchSampler.batch`: node draw + N_B distinct-image instances) at the
   paper's scale, 5.8M triplets of 2.84M images in 244 nodes, N_B = 256, for P(entity) = 1 and after 14
   refreshes (P(entity) = 0.23).
Rounds alternate the order of the sides after one untimed warm-up round (benchmarks/common.py); medians over
rounds decide. `--isolate` runs each timed epoch in a fresh process. Load averages are printed at start and end.

    .venv/bin/python benchmarks/samplers.py [--repeats 5] [--model tiny|default|none] [--steps 3] [--isolate]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vltrain.config_load import load_config
from vltrain.model import build_model, tokenizer_for
from vltrain.samplers import GritSampler, TonicsBatchSampler, TonicsCurriculum
from vltrain.step import train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_options, cpu_now, load_line, run_child_figures, time_sides_figures  # noqa: E402

BUDGET_S = 0.02  # 2% of a 1 s step


def step_time(model_kind: str, n: int, steps: int) -> float:
    """Median seconds of one grit-preset optimiser step on a fixed in-memory batch of n pairs."""
    sets = [] if model_kind == "default" else ["model.text_model=tiny", "model.image_model=tiny", "data.image_size=32",
                                               "model.fusion_layers=1"]
    cfg = load_config("grit", sets=sets, batch_size=n, device="cpu")
    model = build_model(cfg.model).train()
    tok = tokenizer_for(cfg.model.text_model)
    size = cfg.data.image_size
    words = "a red cat sits on the green grass near a small wooden house by the lake".split()
    rng = np.random.default_rng(0)
    captions = [" ".join(rng.choice(words, size=12)) for _ in range(n)]
    enc = tok(captions, padding="longest", truncation=True, max_length=cfg.data.max_len, return_tensors="pt")
    batch = {"images": torch.randn(n, 3, size, size), "input_ids": enc["input_ids"],
             "attention_mask": enc["attention_mask"], "captions": captions}  # as Collate's batches carry them
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 1):  # the first step warms up allocators and is not counted
        t0 = time.perf_counter()
        losses = train_step(model, batch, cfg.loss, gen, tok)
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- A: GRIT ----------------------------------------------------------------------------------------------


class FormerGrit(GritSampler):
    """GritSampler as it was formerly (the reference side): host copies at every collect, then
    `grit_order` one sub-queue at a time, one Python step per example."""

    def collect(self, positions, image_feats, text_feats):
        super().collect(torch.as_tensor(positions).cpu(), image_feats.detach().float().cpu(),
                        text_feats.detach().float().cpu())

    def _group_queue(self):
        n = self.q_len
        perm = self.rng.permutation(n)
        idx = self.q_idx[:n].numpy()[perm]
        img = self.q_img[:n].numpy()[perm]
        txt = self.q_txt[:n].numpy()[perm]
        for a in range(0, n, self.m):
            b = min(a + self.m, n)
            start = int(self.rng.integers(b - a))
            self.grouped.append(idx[a:b][former_grit_order(img[a:b], txt[a:b], start)])
        self.q_len = 0


def former_grit_order(img: np.ndarray, txt: np.ndarray, start: int) -> np.ndarray:
    m = img.shape[0]
    sim = (torch.from_numpy(img) @ torch.from_numpy(txt).t()).numpy()
    rows = (sim, np.ascontiguousarray(sim.T))
    blocked = np.zeros(m, dtype=np.float32)
    order = np.empty(m, dtype=np.int64)
    k = order[0] = start
    blocked[k] = -np.inf
    for i in range(1, m):
        k = order[i] = int(np.argmax(rows[(i - 1) % 2][k] + blocked))
        blocked[k] = -np.inf
    return order


def grit_sides(n: int, m: int, l_size: int, dim: int, seed: int = 0) -> dict:
    """{side: fn(out) -> {"per_step_s", "cpu_per_step_s"}}: one epoch of L / N collects + the next epoch's order."""
    steps = l_size // n
    size = steps * n
    rng = np.random.default_rng(seed)
    img = torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(size, dim)).astype(np.float32)), dim=1)
    txt = torch.nn.functional.normalize(img + 0.5 * torch.from_numpy(rng.normal(size=(size, dim)).astype(np.float32)),
                                        dim=1)
    batches = [torch.tensor(b) for b in GritSampler(size, n, m, l_size, seed)]  # epoch 0: a function of the seed
    feeds = {"grit": [(b, img[b], txt[b]) for b in batches]}
    feeds["grit-former"] = feeds["grit"]
    if torch.cuda.is_available():
        feeds["grit-cuda"] = [tuple(t.cuda() for t in f) for f in feeds["grit"]]

    def run(side: str) -> dict:
        sampler = (FormerGrit if side == "grit-former" else GritSampler)(size, n, m, l_size, seed)
        if side == "grit-cuda":
            torch.cuda.synchronize()
        c0 = cpu_now()
        t0 = time.perf_counter()
        for pos, a, b in feeds[side]:
            sampler.collect(pos, a, b)
        sampler.set_epoch(1)  # the order comes back to the host: nothing is left queued on the device
        return {"per_step_s": (time.perf_counter() - t0) / steps, "cpu_per_step_s": (cpu_now() - c0) / steps}

    return {side: (lambda out, side=side: run(side)) for side in feeds}


# --- B: TOnICS --------------------------------------------------------------------------------------------


def tonics_cost(batch: int, refreshes: int, draws: int) -> float:
    """Median seconds per TOnICS batch at 5.8M triplets / 2.84M images / 244 nodes."""
    rng = np.random.default_rng(0)
    n_trip = 5_800_000
    n_img = 2_840_000
    n_nodes = 244
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
    ap.add_argument("--model", choices=["default", "tiny", "none"], default="tiny",
                    help="the CPU step of the informational fraction: the packaged MiniLM + EfficientNet-Lite0 at "
                         "224 px, the tiny model, or none")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps")
    ap.add_argument("--repeats", type=int, default=5, help="GRIT epochs of L/N steps timed per side")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--search-space", type=int, default=960)
    ap.add_argument("--queue-size", type=int, default=48_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a, b")
    add_options(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    skip = set(args.skip.split(","))
    sides = grit_sides(args.batch, args.search_space, args.queue_size, args.dim) if "a" not in skip else {}
    run_child_figures(args, sides)

    print(load_line("start"), flush=True)
    rows = []
    if "a" in skip:
        pass
    else:
        print(f"A. GRIT collect + group, N={args.batch} M={args.search_space} L={args.queue_size} D={args.dim}, "
              f"{args.queue_size // args.batch} steps per epoch, torch threads {torch.get_num_threads()}"
              f"{', each epoch in a fresh process' if args.isolate else ''}"
              f"{'' if torch.cuda.is_available() else '; no CUDA device: CPU tensors only'}", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-samplers-") as tmp:
            t = time_sides_figures(sides, args.repeats, Path(tmp), args.isolate, label="A ", show="per_step_s",
                                   scale=1e3, unit="ms/step")
        med = {k: {f: statistics.median(v[f]) for f in ("per_step_s", "cpu_per_step_s")} for k, v in t.items()}
        for side in ("grit", "grit-cuda"):
            if side in med:
                rows.append({"name": f"A {side}: collect+group / step", "base": BUDGET_S,
                             "cand": med[side]["per_step_s"], "target": 1.0,
                             "ratio": med[side]["per_step_s"] / BUDGET_S,
                             "cpu_ratio": med[side]["cpu_per_step_s"] / BUDGET_S,
                             "note": "baseline = the budget, 2% of a 1 s step"})
        former = med["grit-former"]
        now = med["grit"]
        rows.append({"name": "A grit vs grit-former, CPU", "base": former["per_step_s"], "cand": now["per_step_s"],
                     "target": None, "ratio": now["per_step_s"] / former["per_step_s"],
                     "cpu_ratio": now["cpu_per_step_s"] / former["cpu_per_step_s"],
                     "note": "the former implementation"})
        if args.model != "none":
            print(f"   training step ({args.model} model, grit preset, N={args.batch}, {args.steps} steps, CPU) ...",
                  flush=True)
            step = step_time(args.model, args.batch, args.steps)
            print(f"   median step {step:.3f} s; GRIT per step is {100 * now['per_step_s'] / step:.3f}% of it "
                  "(informational: a GPU step is far shorter)", flush=True)
            rows.append({"name": f"A grit / {args.model} CPU step", "base": step, "cand": now["per_step_s"],
                         "target": None, "ratio": now["per_step_s"] / step, "cpu_ratio": float("nan"),
                         "note": f"{100 * now['per_step_s'] / step:.3f}% of a CPU step, informational"})

    if "b" not in skip:
        for refreshes in (0, 14):
            tb = tonics_cost(256, refreshes, 300)
            print(f"B. TOnICS batch of 256 from 5.8M triplets, {refreshes:2d} refreshes: {tb * 1e3:.3f} ms per batch",
                  flush=True)
            rows.append({"name": f"B tonics batch, {refreshes} refreshes", "base": BUDGET_S, "cand": tb,
                         "target": 1.0, "ratio": tb / BUDGET_S, "cpu_ratio": float("nan"),
                         "note": "baseline = the 20 ms budget"})

    print("\n" + load_line("end"))
    print(f"\n{'measure':<34} {'baseline ms':>11} {'sampler ms':>11} {'ratio':>8} {'cpu ratio':>9} {'target':>8}"
          "  result")
    for r in rows:
        verdict = "info" if r["target"] is None else ("PASS" if r["ratio"] <= r["target"] else "FAIL")
        target = f"<= {r['target']}x" if r["target"] is not None else "-"
        print(f"{r['name']:<34} {r['base'] * 1e3:>11.2f} {r['cand'] * 1e3:>11.3f} {r['ratio']:>7.3f}x "
              f"{r['cpu_ratio']:>8.3f}x {target:>8}  {verdict}  ({r['note']})")


if __name__ == "__main__":
    main()

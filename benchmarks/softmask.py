"""SoftMask++'s training step against ALBEF's, measured in the same run (the SoftMask++ paper: 1.98 s vs 1.94 s).

Both sides run the full step the trainer runs: `train_step` (forward and named losses), `backward`, gradient
clipping, AdamW, the momentum update and the enqueue, on the same batches. Each call of an arm runs 2 untimed and
--steps timed steps; --repeats rounds of calls alternate the arms' order after one untimed warm-up round
(benchmarks/common.py), so drift hits all alike; medians of per-step times decide. `--isolate` runs each call in a
fresh process. Load averages are printed at start and end.
- baseline: preset `albef` (ITC with distillation over the queue, ITM with sampled hard negatives, MLM on a second
  text pass of the masked caption, with its momentum MLM targets);
- candidate: preset `softmask` (focal ITC, ITM whose cross-attention maps are kept, Grad-CAM by autograd.grad of the
  positives' match probability, one more fusion pass of the masked positives for soft ITM, MLM on the one masked
  caption every loss reads, so no second text pass);
- breakdown: `softmask` with `loss.softmask_itm=0` (what focal ITC + masked text cost alone), and
  `loss.softmask_source=random:0.3` (soft ITM without Grad-CAM), so the table says where the time goes.
Models: the tiny random model (pixels, 32 px) and the packaged encoders over cached tokens (MiniLM text, 49 x 1280
tokens as `vlprep features` writes for EfficientNet-Lite0 at 224; random tokens time the same as real ones).

    .venv/bin/python benchmarks/softmask.py [--steps 6] [--repeats 3] [--batch 32] [--only tiny|packaged]
                                            [--isolate]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from vltrain.config_load import load_config
from vltrain.model import build_model, tokenizer_for
from vltrain.optim import build_optimizer, optimizer_step
from vltrain.step import train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_options, load_line, run_child_figures, time_sides_figures  # noqa: E402

WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()


def setup(arm: str, model_kind: str, batch: int):
    sets = {"albef": [], "softmask": [], "softmask-noitm": ["loss.softmask_itm=0"],
            "softmask-random": ["loss.softmask_source=random:0.3"]}[arm]
    preset = "albef" if arm == "albef" else "softmask"
    common = ["model.queue_size=256", "loss.distill_warmup_steps=0"] if arm == "albef" else ["model.queue_size=256"]
    if model_kind == "tiny":
        common += ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
                   "model.fusion_layers=1"]
    else:
        common += ["model.image_model=features", "model.feature_dim=1280"]
    cfg = load_config(preset, sets=common + sets)
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    opt, params = build_optimizer(model, cfg.optim, torch.device("cpu"))  # the trainer's groups and fused AdamW
    tok = tokenizer_for(cfg.model.text_model)
    g = torch.Generator().manual_seed(0)
    caps = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (6,), generator=g)) for _ in range(batch)]
    enc = tok(caps, padding="longest", truncation=True, max_length=cfg.data.max_len, return_tensors="pt")
    x = (torch.randn(batch, 3, 32, 32, generator=g) if model_kind == "tiny"
         else torch.randn(batch, 49, 1280, generator=g))
    b = {"features" if model_kind != "tiny" else "images": x, "input_ids": enc["input_ids"],
         "attention_mask": enc["attention_mask"], "captions": caps}
    return cfg, model, params, opt, tok, b


def step(cfg, model, params, opt, tok, batch, gen) -> float:
    t0 = time.perf_counter()
    losses = train_step(model, batch, cfg.loss, gen, tok)
    feats = losses.pop("queue_feats")
    optimizer_step(model, opt, params, losses["total"], cfg.optim.grad_clip, feats)
    return time.perf_counter() - t0


ARMS = ["albef", "softmask", "softmask-noitm", "softmask-random"]


def arm_sides(model_kind: str, steps: int, batch: int, only: str | None = None) -> dict:
    """{arm: fn(out) -> {"step_s": median seconds of `steps` steps after 2 untimed ones}}; arms built once here."""
    built = {a: setup(a, model_kind, batch) for a in ARMS if only in (None, a)}
    gens = {a: torch.Generator().manual_seed(1) for a in built}

    def run(arm: str) -> dict:
        times = [step(*built[arm], gens[arm]) for _ in range(steps + 2)]
        return {"step_s": statistics.median(times[2:])}  # the first two: allocator and autograd warm-up

    return {a: (lambda out, a=a: run(a)) for a in built}


def measure(model_kind: str, args, scratch) -> dict:
    sides = arm_sides(model_kind, args.steps, args.batch)
    t = time_sides_figures(sides, args.repeats, scratch, args.isolate, label=f"{model_kind} ", show="step_s",
                           scale=1e3, unit="ms/step")
    return {a: statistics.median(v["step_s"]) for a, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per call (after 2 untimed ones)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of calls, alternating the arms' order")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", choices=["tiny", "packaged"])
    add_options(ap)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(False)
    kinds = [args.only] if args.only else ["tiny", "packaged"]
    if args.side is not None:  # an isolated child: "KIND:ARM"
        kind, arm = args.side.split(":")
        sides = arm_sides(kind, args.steps, args.batch, only=arm)
        args.side = arm
        run_child_figures(args, sides)
    print(load_line("start"), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-softmask-") as tmp:
        for kind in kinds:
            if args.isolate:  # children are told the model kind in the side's name
                t = time_sides_figures({f"{kind}:{a}": None for a in ARMS}, args.repeats, Path(tmp), True,
                                       label=f"{kind} ", show="step_s", scale=1e3, unit="ms/step")
                med = {k.split(":")[1]: statistics.median(v["step_s"]) for k, v in t.items()}
            else:
                med = measure(kind, args, Path(tmp))
            base = med["albef"]
            print(f"\n{kind} model, batch {args.batch}, median of {args.repeats} x {args.steps} steps (torch threads "
                  f"{torch.get_num_threads()}{', each call in a fresh process' if args.isolate else ''}):")
            for arm, label in (("albef", "albef (baseline)"), ("softmask", "softmask"),
                               ("softmask-noitm", "  softmask without soft ITM (focal ITC + masked text)"),
                               ("softmask-random", "  softmask, random:0.3 masks (no Grad-CAM)")):
                print(f"  {label:<56} {med[arm] * 1e3:8.1f} ms/step  {med[arm] / base:5.2f}x")
            print(f"  soft ITM costs {1e3 * (med['softmask'] - med['softmask-noitm']):.1f} ms/step, of which Grad-CAM "
                  f"{1e3 * (med['softmask'] - med['softmask-random']):.1f} ms", flush=True)
            rows.append((f"{kind}: softmask / albef", base, med["softmask"]))
    print("\n" + load_line("end"))
    print(f"\n{'measure':<28} {'albef ms':>9} {'softmask ms':>12} {'ratio':>7} {'target':>8}  result")
    for name, b, c in rows:
        print(f"{name:<28} {b * 1e3:>9.1f} {c * 1e3:>12.1f} {c / b:>6.2f}x {'<= 1.3x':>8}  "
              f"{'PASS' if c / b <= 1.3 else 'FAIL'}")


if __name__ == "__main__":
    main()

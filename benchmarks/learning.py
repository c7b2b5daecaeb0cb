"""Does a speed option change what a run learns? `make learns` under several arms, paired by seed.

Each arm is `make learns` (`vltrain run` of the demo's `bow-feat`, preset clip, 100 steps, batch 32, held-out
evaluation at steps 50 and 100) with some `--set` options, run once per seed; arms share the seed, so each seed
gives one paired difference per metric (the same initial weights, the same held-out split and, where the options
allow, the same data order). Printed per arm: the final held-out TR@1, IR@1 and mean recall per seed and the
steady samples/s (metrics.jsonl, after the first log interval). Then, for every arm against the first: the mean
paired difference with a 95% paired t interval over the seeds (t with n - 1 degrees of freedom; the seeds are
the units, which is honest about the variation between runs but wide at n = 3), and whether it excludes zero.

    .venv/bin/python benchmarks/learning.py [--data demo-out/openclipart/bow-feat] [--seeds 0,1,2] [--steps 100]
        [--arm NAME=KEY=VALUE,KEY=VALUE ...] [--eval DIR]

--eval DIR scores each run's last.pt on every image and caption of the shard folder DIR instead (`vltrain eval`'s
retrieval, multi-caption where DIR has several captions an image), for a held-out set larger than the run's own
split: the recipes' `heldout-retrieval-feat` (1,198 images, 2,499 captions, none of them in the demo's training
data) is the one the default looks for.

Default arms: fp32 without bucketing (the trainer before these options), fp32 with bucketing (the default
`data.bucket`), bf16 with bucketing. The load average is printed at the start and the end; exits 0.
"""

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipelines"))
from verdicts import t_interval  # noqa: E402
ARMS = {"fp32, no bucketing": ["train.precision=fp32", "data.bucket=0"],
        "fp32, bucketed": ["train.precision=fp32"],
        "bf16, bucketed": ["train.precision=bf16"]}
METRICS = (("i2t_r1", "TR@1"), ("t2i_r1", "IR@1"), ("mean_recall", "mean R"))


def one_run(data: Path, sets: list[str], seed: int, steps: int, out: Path, heldout: Path | None = None) -> dict:
    from vltrain.config_load import load_config
    from vltrain.evaluate import evaluate_checkpoint
    from vltrain.train import train

    cfg = load_config(preset="clip", sets=[*sets, "eval_every=50", "log_every=10"], shards=[str(data)], out=str(out),
                      steps=steps, batch_size=32, device="cpu", seed=seed)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        result = train(cfg)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r][1:]
    if heldout is not None:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            scores = evaluate_checkpoint(out / "last.pt", [str(heldout)], device="cpu")
        return {**{k: scores["retrieval"][k] for k, _ in METRICS}, "samples_s": statistics.median(rates)}
    return {**{k: result["eval"][k] for k, _ in METRICS}, "samples_s": statistics.median(rates)}


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of b - a and its 95% paired t interval (the recipes' own, pipelines/verdicts.py)."""
    return t_interval([y - x for x, y in zip(a, b)], 0.95)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT / "demo-out" / "openclipart" / "bow-feat")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--arm", action="append", default=[], help="NAME=KEY=VALUE,KEY=VALUE (repeatable; replaces the "
                    "default arms; the first arm is the reference)")
    ap.add_argument("--eval", type=Path, default=None, help="score each run on this shard folder's images and "
                    "captions instead of its own held-out split (e.g. demo-out/openclipart/recipes/"
                    "heldout-retrieval-feat)")
    args = ap.parse_args()
    if args.eval is not None and not (args.eval / "sizes.json").is_file():
        print(f"no dataset at {args.eval}: `make ablation` builds the recipes' held-out set", file=sys.stderr)
        return
    if not (args.data / "sizes.json").is_file():
        print(f"no dataset at {args.data}: run `make demo` first, or give --data", file=sys.stderr)
        return
    arms = dict(ARMS)
    if args.arm:
        arms = {}
        for spec in args.arm:
            name, _, sets = spec.partition("=")
            arms[name] = [s for s in sets.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",")]
    print(common.load_line("start"), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-learning-"))
    try:
        res = {name: [] for name in arms}
        for seed in seeds:  # seed-major: a change of machine load spreads over every arm alike
            for i, (name, sets) in enumerate(arms.items()):
                r = one_run(args.data, sets, seed, args.steps, tmp / f"arm{i}-seed{seed}", args.eval)
                res[name].append(r)
                print(f"  seed {seed} {name:<22} " + "  ".join(f"{h} {r[k]:6.2f}" for k, h in METRICS)
                      + f"  {r['samples_s']:6.1f} samples/s", flush=True)
        ref = next(iter(arms))
        print(f"\n  paired differences against '{ref}' over seeds {args.seeds} (mean [95% t interval]):")
        for name in list(arms)[1:]:
            cells = []
            for k, h in METRICS + (("samples_s", "samples/s"),):
                m, lo, hi = paired([r[k] for r in res[ref]], [r[k] for r in res[name]])
                cells.append(f"{h} {m:+.2f} [{lo:+.2f}, {hi:+.2f}]" + (" *" if lo > 0 or hi < 0 else ""))
            print(f"  {name:<22} " + "; ".join(cells))
        print("  (* the interval excludes zero)")
        print(common.load_line("end"), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

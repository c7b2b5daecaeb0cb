"""The verdict rule's error rates and power, from simulated recipes (the table in pipelines/README.md).

    .venv/bin/python pipelines/error_rates.py [--reps 4000] [--seeds 3,5,10] [--seed 0] [--out FILE]

Each simulated recipe has one finding whose per-seed differences are drawn from a normal distribution of sd 1 (so
effects are in units of that sd), judged by pipelines/verdicts.py exactly as a recipe's findings are (`judge`, with
the test against 0 and against the paper's effect, or a tie claim's TOST and its test against the margin, in one
Holm family). A cell is the share of `--reps` recipes that got the verdicts its row names; its 95% binomial
interval is at most ±1.6 points at 4,000 recipes. The last row is a whole family: seven findings with no true effect
in one recipe. An "error" row should stay under 5%; a "power" row is the chance of the right verdict. Prints
Markdown.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module pipelines/verdicts.py
import verdicts  # noqa: E402

SIDE = ("agrees", verdicts.SMALLER, verdicts.LARGER, "disagrees")  # a claim that the difference is not 0
SIZE_REJECTED = ("rules out the paper's effect", "disagrees", verdicts.SMALLER, verdicts.LARGER)

# (the simulated truth, what is counted, what it measures, true effect, the paper's effect, tie margin or None, the
# verdicts counted)
CASES = [
    ("no true effect, paper's = 1", "a side claimed (agrees, in either direction, or disagrees)", "error",
     0.0, 1.0, None, SIDE),
    ("true = paper's = 1", "agrees", "power", 1.0, 1.0, None, ("agrees",)),
    ("true = paper's = 1", "its size rejected (rules out, disagrees, smaller, larger)", "error", 1.0, 1.0, None,
     SIZE_REJECTED),
    ("no true effect, paper's = 3", "rules out the paper's effect", "power", 0.0, 3.0, None,
     ("rules out the paper's effect",)),
    ("true = 1, paper's = 3", "agrees in direction, smaller than the paper's", "power", 1.0, 3.0, None,
     (verdicts.SMALLER,)),
    ("tie claim within ±1, true = 0", "equivalent within ±1", "power", 0.0, 0.0, 1.0,
     (verdicts.EQUIVALENT.format(margin=1.0),)),
    ("tie claim within ±1, true = 1 (on the margin)", "equivalent within ±1", "error", 1.0, 0.0, 1.0,
     (verdicts.EQUIVALENT.format(margin=1.0),)),
    ("tie claim within ±1, true = 3", "not equivalent", "power", 3.0, 0.0, 1.0, (verdicts.NOT_EQUIVALENT,)),
]


def simulate(true: float, effect, margin, n: int, reps: int, rng: np.random.Generator, k: int = 1) -> list[list[str]]:
    """The verdicts of `reps` simulated recipes of k findings, each with n seeds of differences ~ N(true, 1)."""
    finding = {"paper": "p", "metric": "m", "paper_effect": effect}
    if margin is not None:
        finding["tie_margin"] = margin
    found = [{**finding, "better": f"b{j}", "than": f"c{j}"} for j in range(k)]
    out = []
    for _ in range(reps):
        diffs = rng.normal(true, 1.0, size=(k, n))
        rows = [{"arm": f"b{j}", "seed": s, "m": float(diffs[j, s])} for j in range(k) for s in range(n)]
        rows += [{"arm": f"c{j}", "seed": s, "m": 0.0} for j in range(k) for s in range(n)]
        out.append([f["verdict"] for f in verdicts.judge(found, rows, power=False)])
    return out


def share(verdict_lists: list[list[str]], counted) -> float:
    return sum(v[0] in counted for v in verdict_lists) / len(verdict_lists)


def table(reps: int, seeds: list[int], seed: int) -> str:
    """The Markdown table: one row per case, one column per seed count, and a row for a family of seven null
    findings in one recipe."""
    rng = np.random.default_rng(seed)
    head = ["simulated truth", "verdicts counted", "kind"] + [f"{n} seeds" for n in seeds]
    md = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for truth, counted_text, kind, true, effect, margin, counted in CASES:
        cells = [f"{100 * share(simulate(true, effect, margin, n, reps, rng), counted):.1f}%" for n in seeds]
        md.append(f"| {truth} | {counted_text} | {kind} | " + " | ".join(cells) + " |")
    family = [simulate(0.0, 1.0, None, n, reps, rng, k=7) for n in seeds]
    md.append("| seven findings in one recipe, no true effect, paper's = 1 | any side claimed in the recipe | "
              "error (family-wise) | "
              + " | ".join(f"{100 * sum(any(x in SIDE for x in v) for v in f) / reps:.1f}%" for f in family) + " |")
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4000, help="simulated recipes per cell (default 4000)")
    ap.add_argument("--seeds", default="3,5,10", help="seeds per arm, one row each (default 3,5,10)")
    ap.add_argument("--seed", type=int, default=0, help="the simulation's random seed (default 0)")
    ap.add_argument("--out", type=Path, help="also write the table there (pipelines/results/error-rates.md is the "
                    "copy pipelines/README.md shows)")
    args = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: a comma-separated list of counts, e.g. 3,5,10")
    if args.reps < 1 or any(n < 2 for n in seeds):
        ap.error("--reps is at least 1 and every --seeds count at least 2 (a t test needs two differences)")
    text = (f"`pipelines/error_rates.py --reps {args.reps} --seeds {args.seeds} --seed {args.seed}`: {args.reps:,} "
            "simulated recipes per cell, per-seed differences ~ N(true effect, 1), so effects are in units of the "
            "sd of a difference.\n\n" + table(args.reps, seeds, args.seed))
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

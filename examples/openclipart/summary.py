"""The demo's final table: held-out retrieval of the bow-only and bow + pseudo arms, mean and spread over seeds.

Reads OUT/cmp/{bow,pseudo}-s{SEED}/eval-heldout.json (`vltrain eval` on the same eval set), prints a table of
mean +- standard deviation (sample, n-1) per column with chance beside it, and writes OUT/summary.json and
OUT/summary.md. The learning curve of the first run is OUT/learning_curve.png.
"""

import json
import statistics
import sys
from pathlib import Path

COLS = [("i2t_r1", "i→t R@1"), ("i2t_r5", "i→t R@5"), ("i2t_r10", "i→t R@10"), ("t2i_r1", "t→i R@1"),
        ("t2i_r5", "t→i R@5"), ("t2i_r10", "t→i R@10"), ("mean_recall", "mean")]
ARMS = {"bow": "bow only", "pseudo": "bow + pseudo"}


def main() -> int:
    out = Path(sys.argv[1])
    runs = {arm: sorted((out / "cmp").glob(f"{arm}-s*/eval-heldout.json")) for arm in ARMS}
    if not all(runs.values()):
        print(f"no eval results under {out}/cmp", file=sys.stderr)
        return 1
    res = {arm: [json.loads(p.read_text()) for p in paths] for arm, paths in runs.items()}
    first = res["bow"][0]
    n, chance = first["n_samples"], first["chance"]
    summary = {"n_pairs": n, "chance": chance, "arms": {}}
    lines = [f"held-out retrieval (%) on {n} eval pairs, mean ± sd over {len(res['bow'])} seeds (vltrain eval)",
             f"{'':14}" + "".join(f"{h:>14}" for _, h in COLS)]
    md = ["| | " + " | ".join(h for _, h in COLS) + " |", "|---" * (len(COLS) + 1) + "|"]
    for arm, name in ARMS.items():
        stats = {}
        for key, _ in COLS:
            vals = [r["retrieval"][key] for r in res[arm]]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            stats[key] = {"mean": round(statistics.fmean(vals), 2), "sd": round(sd, 2), "values": vals}
        summary["arms"][name] = stats
        cells = [f"{stats[k]['mean']:.1f} ± {stats[k]['sd']:.1f}" for k, _ in COLS]
        lines.append(f"{name:14}" + "".join(f"{c:>14}" for c in cells))
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"{'chance':14}" + "".join(f"{chance[k]:>14.1f}" if k in chance else f"{'':>14}" for k, _ in COLS))
    md.append("| chance | " + " | ".join(f"{chance[k]:.1f}" if k in chance else "" for k, _ in COLS) + " |")
    print("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/summary.json, summary.md; learning curve: {out}/learning_curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's final tables: the bow-only and bow + pseudo arms on three benchmarks, mean and spread over seeds.

Reads OUT/cmp/{bow,pseudo}-s{SEED}/eval-heldout.json (`vltrain eval` on the same eval set) and prints a table of
mean +- standard deviation (sample, n-1) per column with chance beside it. When the runs also have
eval-karpathy.json (`vltrain eval` on the multi-caption split from make_karpathy.py, with --zeroshot-folder), two more
tables follow: multi-caption retrieval in the papers' layout (TR = text retrieval = image→text, IR = image
retrieval = text→image; an image→text query is a hit when any of its captions ranks in the top K) and zero-shot
classification on the image folder (top-1, top-5, mean per-class accuracy; chance 100/classes and 500/classes).
Each table uses the runs that have its results. Writes OUT/summary.json and OUT/summary.md (each table under its
title; the first table's keys as before, the new ones under the keys "karpathy" and "zeroshot" and after it). The
learning curve of the first run is OUT/learning_curve.png.
"""

import json
import statistics
import sys
from pathlib import Path

# The papers' columns (and vltrain eval's): TR = text retrieval (image→text), IR = image retrieval (text→image)
COLS = KARPATHY_COLS = [("i2t_r1", "TR@1"), ("i2t_r5", "TR@5"), ("i2t_r10", "TR@10"), ("t2i_r1", "IR@1"),
                        ("t2i_r5", "IR@5"), ("t2i_r10", "IR@10"), ("mean_recall", "mean")]
ZEROSHOT_COLS = [("top1", "top-1"), ("top5", "top-5"), ("mean_per_class", "mean/class")]
ARMS = {"bow": "bow only", "pseudo": "bow + pseudo"}


def table(res: dict[str, list[dict]], cols: list, chance: dict) -> tuple[dict, list[str], list[str]]:
    """Per-arm mean/sd/values of each column of `res` (arm name -> result dicts), as text lines and Markdown rows."""
    arms, lines = {}, [f"{'':14}" + "".join(f"{h:>14}" for _, h in cols)]
    md = ["| | " + " | ".join(h for _, h in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, results in res.items():
        stats = {}
        for key, _ in cols:
            vals = [r[key] for r in results]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            stats[key] = {"mean": round(statistics.fmean(vals), 2), "sd": round(sd, 2), "values": vals}
        arms[name] = stats
        cells = [f"{stats[k]['mean']:.1f} ± {stats[k]['sd']:.1f}" for k, _ in cols]
        lines.append(f"{name:14}" + "".join(f"{c:>14}" for c in cells))
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"{'chance':14}" + "".join(f"{chance[k]:>14.1f}" if k in chance else f"{'':>14}" for k, _ in cols))
    md.append("| chance | " + " | ".join(f"{chance[k]:.1f}" if k in chance else "" for k, _ in cols) + " |")
    return arms, lines, md


def seeds_text(res: dict[str, list]) -> str:
    """'3 seeds', or '3 / 2 seeds (bow only / bow + pseudo)' when the arms have different numbers of results."""
    counts = [len(v) for v in res.values()]
    if len(set(counts)) == 1:
        return f"{counts[0]} seed{'s' * (counts[0] > 1)}"
    return f"{' / '.join(map(str, counts))} seeds ({' / '.join(res)})"


def same(results: list[dict], keys: tuple[str, ...], what: str) -> dict:
    """The first result's `keys`, with a warning when another run was scored on a different set."""
    first = {k: results[0].get(k) for k in keys}
    if any({k: r.get(k) for k in keys} != first for r in results[1:]):
        print(f"warning: the runs' {what} differ in size ({', '.join(keys)}): some were scored on an older set; "
              "re-run run.sh to score them all on the current one", file=sys.stderr)
    return first


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
    summary["arms"], rows, md = table({ARMS[arm]: [r["retrieval"] for r in rs] for arm, rs in res.items()}, COLS,
                                      chance)
    title = f"held-out retrieval (%) on {n} eval pairs, mean ± sd over {seeds_text(res)} (vltrain eval)"
    lines = [title, *rows]
    md = [f"**{title}**", "", *md]

    extra = {ARMS[arm]: [json.loads(p.read_text()) for p in sorted((out / "cmp").glob(f"{arm}-s*/eval-karpathy.json"))]
             for arm in ARMS}
    kar = {name: [r for r in rs if r.get("retrieval")] for name, rs in extra.items()}
    kar = {name: rs for name, rs in kar.items() if rs}
    if kar:
        all_runs = [r for rs in kar.values() for r in rs]
        size = same([r["retrieval"] for r in all_runs], ("n_images", "n_captions"), "multi-caption sets")
        chance = all_runs[0].get("chance", {})
        arms, rows, md_rows = table({name: [r["retrieval"] for r in rs] for name, rs in kar.items()}, KARPATHY_COLS,
                                    chance)
        title = (f"multi-caption retrieval (%) on {size['n_images']} images, {size['n_captions']} captions "
                 f"(TR = image→text, IR = text→image), mean ± sd over {seeds_text(kar)} (vltrain eval)")
        summary["karpathy"] = {**size, "chance": chance, "arms": arms}
        lines += ["", title, *rows]
        md += ["", f"**{title}**", "", *md_rows]
    zs = {name: [r["zeroshot"] for r in rs if r.get("zeroshot")] for name, rs in extra.items()}
    zs = {name: rs for name, rs in zs.items() if rs}
    if zs:
        size = same([r for rs in zs.values() for r in rs], ("classes", "images"), "zero-shot sets")
        c = size["classes"]
        chance = next(iter(zs.values()))[0].get("chance") or {  # vltrain eval's, else the same figures here
            "top1": round(100 / c, 2), "top5": round(min(100, 500 / c), 2), "mean_per_class": round(100 / c, 2)}
        arms, rows, md_rows = table(zs, ZEROSHOT_COLS, chance)
        title = (f"zero-shot classification (%) on {size['images']} images in {c} classes, "
                 f"mean ± sd over {seeds_text(zs)} (vltrain eval --zeroshot-folder)")
        summary["zeroshot"] = {**size, "chance": chance, "arms": arms}
        lines += ["", title, *rows]
        md += ["", f"**{title}**", "", *md_rows]

    print("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/summary.json, summary.md; learning curve: {out}/learning_curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

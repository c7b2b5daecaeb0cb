"""`vlprep filter`'s terminal table, the embedding rules' part of report.json, and its figures."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlprep.filterembed import ClipScore, Exclude, NearDup
from vlprep.filterphash import PHash

EXAMPLES = 5  # example keys per rule in report.json and the terminal table


def embed_report(report: dict, out, ds, rules: list) -> None:
    """The embedding rules' part of the report, and OUT/clip_score.png, near_dup.png, clip_score_low.png."""
    for rule in rules:
        if isinstance(rule, PHash):
            report["phash"] = {"distance": rule.distance,
                               "pairs": [{"key": a, "kept": b, "distance": h} for a, b, h in rule.pairs]}
        elif isinstance(rule, NearDup):
            report["near_dup"] = {"threshold": rule.threshold,
                                  "pairs": [{"key": a, "kept": b, "cosine": c} for a, b, c in rule.pairs]}
            if rule.pairs:
                cells = [cell for a, b, c in rule.pairs[:12] for cell in ((a, f"dropped, {c:.3f}"), (b, "kept"))]
                report["outputs"].append(image_grid(out.root / "near_dup.png", ds, cells,
                                                    f"near duplicates (cosine >= {rule.threshold:g}): dropped, kept"))
        elif isinstance(rule, Exclude):
            report["exclude"] = {"eval_sets": rule.shown, "pairs": rule.pairs}
        elif isinstance(rule, ClipScore):
            report["clip_score"] = {"min": rule.least, "top": rule.top, "threshold": rule.threshold,
                                    "cached": rule.cached,
                                    "histogram": {"range": [-1.0, 1.0], "bins": 40, "counts": rule.histogram},
                                    "lowest": [{"key": k, "clip_score": s} for k, s in rule.lowest]}
            report["outputs"].append(histogram_png(out.root / "clip_score.png", rule))
            if rule.lowest:
                cells = [(k, f"{s:.3f}") for k, s in rule.lowest]
                report["outputs"].append(image_grid(out.root / "clip_score_low.png", ds, cells,
                                                    "lowest clip scores (score, caption)", captions=True))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def histogram_png(path: Path, rule: ClipScore) -> str:
    """The scored samples' clip scores, with the threshold drawn."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.linspace(-1, 1, 41)
    ax.bar(edges[:-1], rule.histogram, width=edges[1] - edges[0], align="edge", color="tab:blue")
    if rule.threshold is not None:
        ax.axvline(rule.threshold, color="tab:red", label=f"threshold {rule.threshold:.4f}")
        ax.legend()
    ax.set(title="clip score (image-caption cosine) of the samples scored", xlabel="clip score", ylabel="samples")
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path.name


def image_grid(path: Path, ds, cells: list[tuple[str, str]], title: str, captions: bool = False) -> str:
    """A grid of the given keys' images (read from the shards that hold them), each with its label."""
    import textwrap

    from vlprep.dataset import iter_tar
    from vlprep.report import grid_axes, thumbnails

    plt = _pyplot()
    wanted = {k for k, _ in cells}
    images = {}
    texts = {}
    for shard in ds.shards:
        side = pq.read_table(ds.sidecar(shard), columns=["key", "caption"])
        here = wanted & set(side.column(0).to_pylist())
        if not here:
            continue
        texts.update((k, c) for k, c in zip(side.column(0).to_pylist(), side.column(1).to_pylist()) if k in here)
        thumbnails(iter_tar(ds.tar(shard)), here, images)
    fig, axes = grid_axes(plt, len(cells), top=0.92)
    for ax, (key, label) in zip(axes, cells):
        if key in images:
            ax.imshow(images[key])
        lines = [f"{key}: {label}"] + (textwrap.wrap(texts.get(key) or "", 26)[:2] if captions else [])
        ax.text(0.5, -0.03, "\n".join(lines), transform=ax.transAxes, ha="center", va="top", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path.name


def print_filter_report(r: dict, console) -> None:
    """The terminal table: kept, then dropped per rule in the fixed order with example keys."""
    from rich.table import Table

    t = Table(title=f"vlprep filter: {r['kept']:,} of {r['samples_in']:,} kept", show_header=True)
    t.add_column("rule")
    t.add_column("dropped", justify="right")
    t.add_column("examples", overflow="fold")
    for name, n in r["dropped"].items():
        t.add_row(name, f"{n:,}", ", ".join(r["examples"][name]))
    t.add_row("kept", f"{r['kept']:,}", "")
    console.print(t)
    if "clip_score" in r:
        c = r["clip_score"]
        cut = "none" if c["threshold"] is None else f"{c['threshold']:.4f}"
        console.print(f"clip score: threshold {cut}; histogram clip_score.png, lowest pairs clip_score_low.png",
                      highlight=False)
    if r.get("exclude", {}).get("pairs"):
        console.print(f"exclude: {len(r['exclude']['pairs'])} pair(s) with the eval sets in report.json",
                      highlight=False)
    extra = f", {r['shards_resumed']} shard(s) resumed" if r["shards_resumed"] else ""
    console.print(f"{r['elapsed_s']:.1f}s{extra}; every dropped key: dropped.parquet", highlight=False)


DROPPED_SCHEMA = pa.schema([("key", pa.string()), ("shard", pa.string()), ("rule", pa.string()),
                            ("detail", pa.string()), ("match_dataset", pa.string()), ("match_key", pa.string()),
                            ("cosine", pa.float32()), ("distance", pa.int32())])


def write_dropped(out, d) -> tuple[dict[str, int], dict[str, list[str]]]:
    """OUT/dropped.parquet, a shard at a time in dataset order; (dropped per rule, up to 5 example keys each)."""
    dropped = {r.name: 0 for r in d.rules}
    examples = {r.name: [] for r in d.rules}
    path = out.root / "dropped.parquet"
    tmp = path.with_name(path.name + ".tmp")
    with pq.ParquetWriter(tmp, DROPPED_SCHEMA) as w:
        for i in range(len(d.shards)):
            rows = d.dropped_rows(i)
            for row in rows:
                dropped[row["rule"]] += 1
                if len(examples[row["rule"]]) < EXAMPLES:
                    examples[row["rule"]].append(row["key"])
            if rows:
                w.write_table(pa.Table.from_pylist(rows, schema=DROPPED_SCHEMA))
    tmp.replace(path)
    return dropped, examples

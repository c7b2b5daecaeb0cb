"""The terminal tables and plots the stages share."""

from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from vlprep.output import Out, pull


def print_shards_report(report: dict, console: Console) -> None:
    t = Table(title=f"vlprep shards -> {report['written']:,} samples in {report['shards']} shards", show_header=True)
    t.add_column("count")
    t.add_column("samples", justify="right")
    examples = bool(report["skipped"])  # the column names skipped samples: none skipped, no column
    if examples:
        t.add_column("examples", overflow="fold")
    t.add_row("read", f"{report['samples_in']:,}", *[""] * examples)
    t.add_row("written", f"{report['written']:,}", *[""] * examples)
    for reason, n in report["skipped"].items():
        t.add_row(f"skipped: {reason}", f"{n:,}", ", ".join(report["skipped_examples"].get(reason, [])[:3]))
    console.print(t)
    if "image_outside_root" in report["skipped"]:  # a symlinked val2014/ is common, and its fix is one flag
        console.print("image_outside_root: an absolute image name, a `..` out of the image root, or a symlink leading "
                      "out of it; pass --follow-symlinks to read through symlinks you trust", highlight=False,
                      markup=False, soft_wrap=True)
    extra = f", {report['shards_resumed']} shard(s) resumed" if report["shards_resumed"] else ""
    console.print(f"{report['elapsed_s']:.1f}s ({report['samples_per_s']} samples/s){extra}")


def plot_bow(out: Out, words_before: Counter, words_after: Counter, len_before: Counter,
             len_after: Counter) -> list[str]:
    """One PNG: rank-frequency (log-log) and caption-length histograms, before vs after."""
    import matplotlib.ticker
    from matplotlib.figure import Figure

    # A bare Figure (no pyplot state to set up and tear down), one figure, no tight_layout: drawing it is this
    # stage's largest fixed cost on small datasets.
    fig = Figure(figsize=(11, 4.5))
    ax, bx = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.12, top=0.92, wspace=0.25)
    for counter, label in ((words_before, "before"), (words_after, "after")):
        freqs = sorted(counter.values(), reverse=True)
        if freqs:
            # At most ~400 log-spaced ranks (the first and last included): on log-log axes the line looks the
            # same, and drawing every rank of a large vocabulary was a good part of the stage's fixed cost.
            ranks = np.unique(np.geomspace(1, len(freqs), num=min(len(freqs), 400)).round().astype(int))
            ax.loglog(ranks, np.asarray(freqs)[ranks - 1], label=f"{label} ({len(freqs):,} words)")
    # A title at a given height: the automatic placement measures every tick label above the axes at each draw.
    ax.set_title("rank-frequency", y=1.0)
    ax.set(xlabel="rank", ylabel="occurrences")
    # Log axes' minor ticks and their math-text labels ($10^{3}$) cost more to lay out than the rest of the
    # figure: major ticks only, labelled as plain numbers.
    ax.minorticks_off()
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.legend()
    top = max([0, *len_before, *len_after])
    bins = np.arange(0, min(top, 60) + 2) - 0.5
    for hist, label in ((len_before, "before"), (len_after, "after")):
        ks = list(hist)
        # One filled step outline per histogram, as hist() draws it with one rectangle per bin
        counts, _ = np.histogram([min(k, 60) for k in ks], bins=bins, weights=[hist[k] for k in ks])
        bx.stairs(counts, bins, fill=True, alpha=0.6, label=label)
    bx.set_title("caption length", y=1.0)
    bx.set(xlabel="words (60 = 60 or more)", ylabel="captions")
    bx.legend()
    # The ticks the locators would draw, fixed: an axis makes a tick (five artists) for every location its
    # locator returns, also the ones outside the view that it never draws.
    for axis in (ax.xaxis, ax.yaxis, bx.xaxis, bx.yaxis):
        lo, hi = sorted(axis.get_view_interval())
        locs = [v for v in axis.get_major_locator()() if lo <= v <= hi]
        axis.set_major_locator(matplotlib.ticker.FixedLocator(locs))
    path = out.root / "bow_report.png"
    fig.savefig(path, dpi=72)
    return [str(path)]


def print_bow_report(r: dict, console: Console) -> None:
    t = Table(title=f"vlprep bow --ops {r['ops']}", show_header=True)
    t.add_column("measure")
    t.add_column("before", overflow="fold")
    t.add_column("after", overflow="fold")
    t.add_row("samples", f"{r['samples_in']:,}", f"{r['written']:,} ({r['size_change_pct']:+.1f}%)")
    t.add_row("avg caption length (words)", f"{r['avg_words_before']:.2f}", f"{r['avg_words_after']:.2f}")
    t.add_row("vocabulary", f"{r['vocab_before']:,}", f"{r['vocab_after']:,}")
    t.add_row("deformed / base", "", f"{r['deformed_fraction']:.1%} deformed, {r['base_samples']:,} base samples")
    t.add_row("dropped (empty)", "", f"{r['dropped_empty']:,}")
    if r.get("captions_dropped_empty"):  # extra captions of multi-caption samples left out of json.captions
        t.add_row("extra captions dropped (empty)", "", f"{r['captions_dropped_empty']:,}")
    t.add_row("tokens removed", "", ", ".join(f"{k}: {v:,}" for k, v in r["tokens_removed"].items()))
    t.add_row("top words", ", ".join(w for w, _ in r["top_words_before"]),
              ", ".join(w for w, _ in r["top_words_after"]))
    if r.get("rmtop_ranked_after") is not None:  # the set rmtop removes, ranked after the ops before it
        after = f" (ranked after {r['rmtop_ranked_after']})" if r["rmtop_ranked_after"] else ""
        t.add_row(f"rmtop set{after}", f"top {len(r['rmtop_tokens']):,} of {r['rmtop_candidates']:,} words",
                  ", ".join(r["rmtop_tokens"][:20]) + (", ..." if len(r["rmtop_tokens"]) > 20 else ""))
    console.print(t)
    extra = f", {r['shards_resumed']} shard(s) resumed" if r["shards_resumed"] else ""
    console.print(f"{r['elapsed_s']:.1f}s{extra}; plots: {', '.join(r['plots'])}", highlight=False)


def plot_pmi(path: Path, table, mapping: dict[str, str], nodes: list[dict], top: int = 25) -> list[str]:
    """Heatmap of PMI for the most frequent mapped nouns x the kept classes; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = [n["class"] for n in nodes][:top]
    sub = table[table["noun"].isin(mapping.keys()) & table["label"].isin(classes)] if len(table) else table
    freq = sub.groupby("noun")["count"].max().sort_values(ascending=False) if len(sub) else []
    nouns = list(freq.index[:top]) if len(sub) else []
    grid = np.full((len(nouns), len(classes)), np.nan)
    pos_n = {n: i for i, n in enumerate(nouns)}
    pos_c = {c: j for j, c in enumerate(classes)}
    for n, c, p in zip(sub["noun"], sub["label"], sub["pmi"]) if len(sub) else []:
        if n in pos_n:
            grid[pos_n[n], pos_c[c]] = p
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * len(classes) + 2), max(3, 0.3 * len(nouns) + 1.5)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(classes)), classes, rotation=60, ha="right")
    ax.set_yticks(range(len(nouns)), nouns)
    ax.set_title("PMI(noun, class); blank = never co-occur")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [str(path)]


def print_ontology_report(r: dict, console: Console) -> None:
    t = Table(title=f"vlprep ontology: {r['classes']} classes, {r['triplets']:,} triplets ({r['triplet_rule']})",
              show_header=True)
    t.add_column("class")
    t.add_column("instances |X(o)|", justify="right")
    t.add_column("class detected", justify="right")
    t.add_column("nouns w(o)", overflow="fold")
    for node in r["nodes"]:
        t.add_row(node["class"], f"{node['instances']:,}", f"{node['instances_detected']:,}", ", ".join(node["nouns"]))
    console.print(t)
    c = r["triplet_counts"]
    console.print(f"triplets, rule all / detected: {c['found']['all']:,} / {c['found']['detected']:,} over every mapped "
                  f"class, {c['kept']['all']:,} / {c['kept']['detected']:,} over the {r['classes']} kept classes",
                  highlight=False)
    console.print(f"pairs {r['pairs']:,}, with objects {r['pairs_with_objects']:,}; coverage {r['coverage']:.1%} "
                  f"(pairs with >= 1 triplet); min instances {r['min_instances']}; "
                  f"{len(r['dropped_classes'])} class(es) dropped; {r['elapsed_s']:.1f}s", highlight=False)


def print_detect_report(r: dict, console: Console) -> None:
    t = Table(title=f"images per label (score >= {r['min_score']})", show_header=True)
    t.add_column("label")
    t.add_column("images", justify="right")
    for label, n in list(r["images_per_label"].items())[:15]:
        t.add_row(label, f"{n:,}")
    console.print(t)
    rate = f", {r['images_per_s']} images/s" if r["images_per_s"] else ""
    console.print(f"{r['backend']}: {r['samples']:,} images, {r['with_objects']:,} with objects, {r['objects']:,} objects, "
                  f"{r['undecodable']} undecodable; {r['elapsed_s']:.1f}s{rate}", highlight=False)


def pseudolabel_figures(out: Out, ds, report: dict, n: int = 24) -> list[str]:
    """OUT/pseudo_words.png (top pseudo words, words per caption) and OUT/pseudo_grid.png (images + pseudo-captions)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pyarrow.parquet as pq

    from vlprep.dataset import iter_tar, sidecar_name

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 6), gridspec_kw={"width_ratios": [2, 1]})
    fig.subplots_adjust(left=0.14, right=0.98, bottom=0.09, top=0.93, wspace=0.3)
    top = report["top_words"]
    if top:
        names = [f"{w} (S_a: {df:,})" for w, _, df in top]
        ax.barh(range(len(top))[::-1], [c for _, c, _ in top], color="tab:green")
        ax.set_yticks(range(len(top))[::-1], names, fontsize=8)
    ax.set(title=f"top pseudo words ({report['vocab']:,} distinct), {report['strategy']}", xlabel="pseudo-captions")
    hist = report["words_hist"]
    bx.bar([int(k) for k in hist], list(hist.values()), color="tab:blue")
    bx.set_xticks([int(k) for k in hist])
    bx.set(title="words per pseudo-caption", xlabel="words", ylabel="images")
    words_png = out.root / "pseudo_words.png"
    fig.savefig(words_png, dpi=72)
    plt.close(fig)

    # Figure 6 of the paper: evenly spaced images with their pseudo-caption (and the caption UNALIGNED had, if any).
    # Rows by their number over the output's sidecars, read for the shards that hold a pick only
    written = [(s, out.root / sidecar_name(s)) for s in ds.shards if (out.root / sidecar_name(s)).exists()]
    counts = [pq.read_metadata(side).num_rows for _, side in written]
    total = sum(counts)
    numbers = [i * total // n for i in range(min(n, total))]
    rows = {}
    start = 0
    for (shard, side), m in zip(written, counts):
        here = sorted({j for j in numbers if start <= j < start + m})
        if here:
            t = pq.read_table(side, columns=["key", "caption"]).take([j - start for j in here])
            rows.update(zip(here, zip([shard] * len(here), t.column(0).to_pylist(), t.column(1).to_pylist())))
        start += m
    picks = [rows[j] for j in numbers]
    wanted = {k for _, k, _ in picks}
    given = {}
    images = {}
    for shard in dict.fromkeys(s for s, _, _ in picks):
        side = pq.read_table(ds.sidecar(shard))
        if "caption" in side.column_names:
            given.update((k, c) for k, c in zip(side.column("key").to_pylist(), side.column("caption").to_pylist())
                         if k in wanted)
        pull(out, shard)  # a URL OUT keeps its uploaded tars only there (vlprep.output)
        thumbnails(iter_tar(out.root / shard), wanted, images)
    fig, axes = grid_axes(plt, len(picks), top=0.95)
    for ax, (_, key, caption) in zip(axes, picks):
        if key in images:
            ax.imshow(images[key])
        lines = textwrap.wrap(caption, 24) or [""]
        ax.text(0.5, -0.03, "\n".join(lines[:2]), transform=ax.transAxes, ha="center", va="top", fontsize=8,
                weight="bold")
        if given.get(key):
            g = given[key] if len(given[key]) <= 30 else given[key][:29] + "…"
            ax.text(0.5, -0.05 - 0.1 * min(len(lines), 2), g, transform=ax.transAxes, ha="center", va="top",
                    fontsize=6.5, color="0.45")
    fig.suptitle(f"pseudo-captions ({report['strategy']}, k={report['k']}, crops={report['crops']}); "
                 "grey: the caption UNALIGNED had (not used)", fontsize=9)
    grid_png = out.root / "pseudo_grid.png"
    fig.savefig(grid_png, dpi=72)
    plt.close(fig)
    return [str(words_png), str(grid_png)]


GRID_COLS = 6  # thumbnails a row in the stages' image grids


def thumbnails(samples, wanted: set, into: dict) -> None:
    """Add the images of the `wanted` keys among `samples` (raw shard samples) to `into`, as 160-pixel thumbnails."""
    from vlprep.dataset import decode_rgb, image_ext

    for raw in samples:
        if raw["__key__"] in wanted and image_ext(raw):
            im = decode_rgb(raw[image_ext(raw)])
            im.thumbnail((160, 160))
            into[raw["__key__"]] = im


def grid_axes(plt, n: int, top: float):
    """A figure for n thumbnails, GRID_COLS a row, every axis off: (the figure, its axes in reading order)."""
    rows = max(1, -(-n // GRID_COLS))
    fig, axes = plt.subplots(rows, GRID_COLS, figsize=(GRID_COLS * 2.3, rows * 2.9), squeeze=False)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.03, top=top, wspace=0.12, hspace=0.5)
    axes = axes.ravel()
    for ax in axes:
        ax.axis("off")
    return fig, axes


def print_pseudolabel_report(r: dict, console: Console) -> None:
    idx = r["index"]
    t = Table(title=f"vlprep pseudolabel --strategy {r['strategy']} (k={r['k']}, crops={r['crops']}, "
                    f"words={r['words']})", show_header=True)
    t.add_column("measure")
    t.add_column("value", overflow="fold")
    where = "GPU" if idx["gpu"] else "CPU"
    probe = f", nlist {idx['nlist']}, nprobe {idx['nprobe']}" if idx["kind"] == "ivf" else ""
    t.add_row("caption index", f"{idx['kind']} on {where}, {idx['vectors']:,} captions x {idx['dim']}{probe}"
              f" ({'reused' if idx['reused'] else 'built'} in {idx['seconds']:.1f}s)")
    t.add_row("images", f"{r['samples_in']:,} in, {r['written']:,} pseudo-captioned")
    t.add_row("dropped (no words)", f"{r['dropped_no_words']:,}")
    t.add_row("skipped", "; ".join(f"{k}: {v:,} (e.g. {', '.join(r['skipped_examples'].get(k, []))})"
                                   for k, v in r["skipped"].items()) or "0")
    t.add_row("words per caption", f"{r['avg_words']:.2f} on average; vocabulary {r['vocab']:,} "
              f"(ALIGNED: {r['aligned_vocab']:,})")
    t.add_row("top words", ", ".join(f"{w} ({n})" for w, n, _ in r["top_words"][:15]))
    console.print(t)
    rate = f", {r['images_per_s']} images/s" if r["images_per_s"] else ""
    extra = f", {r['shards_resumed']} shard(s) resumed" if r["shards_resumed"] else ""
    console.print(f"{r['elapsed_s']:.1f}s{rate}{extra}; plots: {', '.join(r['plots'])}", highlight=False)


def print_embed_report(r: dict, console: Console) -> None:
    skipped = ", ".join(f"{k}: {v:,}" for k, v in r["skipped"].items())
    got = r.get("image_input") or {}  # image embeddings: how many came from cached tokens, how many from pixels
    source = f"; images from tokens {got.get('tokens', 0):,}, pixels {got.get('pixels', 0):,}" if got else ""
    console.print(f"embed {r['modality']}: {r['written']:,} of {r['samples_in']:,} samples, dim {r['dim']}, "
                  f"on {r['device']}{source}{'; skipped ' + skipped if skipped else ''}; {r['elapsed_s']:.1f}s "
                  f"({r['per_s']}/s)", highlight=False)


def print_features_report(r: dict, console: Console) -> None:
    """The terminal table of `vlprep features`."""
    s = r["features"]
    t = Table(title=f"vlprep features --image-model {s['encoder']}", show_header=True)
    t.add_column("measure")
    t.add_column("value", overflow="fold")
    t.add_row("encoder", f"{s['encoder']} ({s['weights'] or 'packaged weights'}, sha256 {s['weights_sha256']})")
    t.add_row("tokens", f"{s['tokens']} x {s['dim']} {s['dtype']} per image at {s['size']} px "
              f"({r['npy_bytes']:,} bytes of npy data)")
    t.add_row("samples", f"{r['samples_in']:,} in, {r['written']:,} written")
    t.add_row("skipped", "; ".join(f"{k}: {v:,} (e.g. {', '.join(r['skipped_examples'].get(k, []))})"
                                   for k, v in r["skipped"].items()) or "0")
    console.print(t)
    rate = f", {r['images_per_s']} images/s on {r['device']}" if r["images_per_s"] else ""
    extra = f", {r['shards_resumed']} of {r['shards']} shard(s) resumed" if r["shards_resumed"] else ""
    console.print(f"{r['elapsed_s']:.1f}s{rate}{extra}", highlight=False)

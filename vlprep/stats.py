"""`vlprep stats`: sample count, caption lengths, vocabulary, top words and image sizes of a dataset, counted a shard
at a time (value -> count), so memory grows with the vocabulary and the distinct sizes, not with the samples. The
caption figures count every caption of a multi-caption sample (docs/FORMAT.md), not only its first (`txt`)."""

import bisect
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from itertools import accumulate
from pathlib import Path

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from vlprep import VlprepError, urls
from vlprep.dataset import BadJson, decode_json, iter_samples, open_dataset
from vlprep.output import write_json_atomic
from vlprep.text import words

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
SIDECAR_COLUMNS = ("caption", "width", "height", "image_ext", "captions")


def distribution(counts: Mapping) -> dict:
    """Summary of integers given as value -> count: count, mean and the QUANTILES (p0 ... p100), as numpy's."""
    # the figures numpy's mean and linear quantile give over the values written out, without writing them out
    values = sorted((v for v, c in counts.items() if c), key=float)
    n = sum(counts[v] for v in values)
    if n == 0:
        return {"count": 0}
    # ends[i]: one past the rank of value i's last copy in the sorted sample
    ends = list(accumulate(counts[v] for v in values))
    # An integer sum is exact (numpy's float64 sum of integers is too, below 2**53), so both divisions round alike
    out = {"count": n, "mean": round(float(sum(v * counts[v] for v in values) / n), 3)}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = round(quantile(values, ends, q), 3)
    return out


def quantile(values: list, ends: list[int], q: float) -> float:
    """np.quantile's linear method, in its float64 arithmetic, over the sorted sample that values and ends describe."""
    n = ends[-1]
    h = (n - 1) * q
    if h >= n - 1:
        return float(values[-1])
    lo = math.floor(h)
    a = float(values[bisect.bisect_right(ends, lo)])
    b = float(values[bisect.bisect_right(ends, lo + 1)])
    t = h - lo
    # numpy's _lerp: from the nearer end, so that a weight near 1 still lands on b exactly
    return a + (b - a) * t if t < 0.5 else b - (b - a) * (1 - t)


def sidecar_columns(ds) -> set[str]:
    """The union of a dataset's sidecar columns, from their footers."""
    names = set()
    for shard in ds.shards:
        side = ds.sidecar(shard)
        if not side.exists():
            raise VlprepError(f"{ds.root}: missing sidecar {side.name} (written by every vlprep stage)")
        names.update(pq.read_schema(side).names)
    return names


def every_caption(first, captions) -> list:
    """A multi-caption sample's list of captions (whose first is `first`), else [first]."""
    if isinstance(captions, list) and captions and all(isinstance(c, str) for c in captions):
        return captions
    return [first]


def sample_fields(ds, cols: set[str]) -> Iterator[tuple]:
    """(captions, width, height, image_ext) per sample, in shard order, one shard's sidecar in memory at a time;
    captions: every caption of a multi-caption sample (the sidecar's `captions` column, json.captions), else [txt]."""
    if {"caption", "width", "height"} <= cols:
        for shard in ds.shards:
            side = ds.sidecar(shard)
            names = pq.read_schema(side).names
            t = pq.read_table(side, columns=[c for c in SIDECAR_COLUMNS if c in names])
            # a column that only other shards have reads as nulls, as when the sidecars are concatenated
            for caption, w, h, ext, captions in zip(*(t.column(c).to_pylist() if c in t.column_names
                                                      else [None] * t.num_rows for c in SIDECAR_COLUMNS)):
                yield every_caption(caption, captions), w, h, ext
    else:  # sidecars from another tool: read the tars instead
        for s in iter_samples(ds, decode=False):
            try:
                meta = decode_json(s["json"]) if "json" in s else {}
            except BadJson:  # malformed, NaN, 100,000 deep: the sample's size is unknown, its caption still counts
                meta = {}
            size = [v if isinstance(v, int) and not isinstance(v, bool) else None
                    for v in (meta.get("width"), meta.get("height"))]
            yield every_caption(s.get("txt", b"").decode("utf-8", "replace"), meta.get("captions")), *size, None


def dataset_stats(path, out: Path | None = None, top: int = 20) -> dict:
    """Counts, caption-length and image-size distributions, vocabulary; writes report.json + stats.png. The caption
    figures (caption_words, whose count is the number of captions, vocabulary, tokens, top words) count every
    caption of a multi-caption sample."""
    # the samples stream into counters (vocabulary- and size-sized), never a list with an entry per sample
    ds = open_dataset(path)
    if out is not None and urls.overlap(out, ds.url or ds.root) == "same":  # DATASET/stats (the default) is fine
        raise VlprepError(f"--out {urls.redact(str(out))} is the dataset: its report.json would be replaced; choose "
                          "another folder (the default is DATASET/stats)")
    cols = sidecar_columns(ds)
    # image formats come from the sidecars' image_ext column only (a tar read leaves them out)
    formats_known = {"caption", "width", "height", "image_ext"} <= cols
    lengths = Counter()
    vocab = Counter()
    widths = Counter()
    heights = Counter()
    shorter = Counter()
    exts = Counter()
    for captions, w, h, ext in sample_fields(ds, cols):
        for caption in captions:
            ws = words(caption or "")
            lengths[len(ws)] += 1
            vocab.update(ws)
        if w is not None and h is not None:
            widths[w] += 1
            heights[h] += 1
            shorter[min(w, h)] += 1
        if formats_known:
            exts[ext] += 1
    report = {
        "dataset": urls.redact(ds.url) if ds.url else str(ds.root),
        "samples": ds.num_samples,
        "shards": len(ds.shards),
        "caption_words": distribution(lengths),
        "vocabulary_size": len(vocab),
        "tokens": int(sum(vocab.values())),
        "top_words": [[w, n] for w, n in vocab.most_common(top)],
        "image_width": distribution(widths),
        "image_height": distribution(heights),
        "image_shorter_side": distribution(shorter),
        "image_formats": dict(sorted(exts.items())),
    }
    out = Path(out) if out is not None else ds.root / "stats"
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "report.json", report)
    plot_histograms(out / "stats.png", lengths, shorter, vocab.most_common(top))
    report["outputs"] = [str(out / "report.json"), str(out / "stats.png")]
    return report


def plot_histograms(path: Path, lengths: Counter, shorter: Counter, top_words) -> None:
    """stats.png: histograms of caption length and image shorter side (value -> count) and the top words."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    # Each distinct value once, weighted by its count: numpy bins it as it would the values written out
    values = sorted(lengths)
    axes[0].hist(values, bins=min(50, max(1, len(values))), weights=[lengths[v] for v in values], color="tab:blue")
    axes[0].set(title="caption length", xlabel="words", ylabel="samples")
    if shorter:
        values = sorted(shorter)
        axes[1].hist(values, bins=40, weights=[shorter[v] for v in values], color="tab:orange")
    axes[1].set(title="image shorter side", xlabel="pixels", ylabel="samples")
    if top_words:
        names, counts = zip(*top_words)
        axes[2].barh(range(len(names))[::-1], counts, color="tab:green")
        axes[2].set_yticks(range(len(names))[::-1], names)
    axes[2].set(title="top words", xlabel="occurrences")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_stats(report: dict, console: Console) -> None:
    t = Table(title=f"vlprep stats: {report['dataset']}", show_header=True)
    t.add_column("measure")
    t.add_column("value", overflow="fold")
    cw = report["caption_words"]
    if cw["count"] > report["samples"]:  # multi-caption samples: the caption rows count every caption
        t.add_row("samples / captions / shards", f"{report['samples']:,} / {cw['count']:,} / {report['shards']} "
                  "(every caption counted below)")
    else:
        t.add_row("samples / shards", f"{report['samples']:,} / {report['shards']}")
    if cw["count"]:
        t.add_row("caption words", f"mean {cw['mean']:.1f}, median {cw['p50']:g}, p5-p95 {cw['p5']:g}-{cw['p95']:g}, "
                  f"max {cw['p100']:g}")
    t.add_row("vocabulary / tokens", f"{report['vocabulary_size']:,} / {report['tokens']:,}")
    t.add_row("top words", ", ".join(f"{w} ({n})" for w, n in report["top_words"]))
    ss = report["image_shorter_side"]
    if ss["count"]:
        t.add_row("image shorter side", f"median {ss['p50']:g}px, p5-p95 {ss['p5']:g}-{ss['p95']:g}px, "
                  f"min {ss['p0']:g}, max {ss['p100']:g}")
        t.add_row("image width x height", f"median {report['image_width']['p50']:g} x "
                  f"{report['image_height']['p50']:g}")
    if report["image_formats"]:
        t.add_row("image formats", ", ".join(f"{k}: {v:,}" for k, v in report["image_formats"].items()))
    console.print(t)

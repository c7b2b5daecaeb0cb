"""`vlprep stats` streams its input: the same report.json and stats.png as the whole dataset in lists, and a peak
memory that does not grow with the number of samples."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import image_bytes
from tests.memrule import growth_per_sample
from vlprep.dataset import iter_samples, open_dataset, read_sidecars
from vlprep.output import Out, finish_dataset, write_json_atomic, write_shard
from vlprep.stats import QUANTILES, dataset_stats, distribution
from vlprep.text import words

VOCAB = [f"w{i}" for i in range(300)] + ["A", "the", "dog", "café", "naïve"]


def synthetic(root: Path, n: int, per_shard: int = 100, seed: int = 0, sidecar=True) -> Path:
    """n samples of Zipf captions over VOCAB and random sizes; the sidecar has caption/width/height/image_ext (or only
    key, and the tars' json has width/height, as another tool's sidecars)."""
    if root.exists():
        return root
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    png = image_bytes(16, 16, seed=seed)
    sizes = {}
    for s in range(-(-n // per_shard)):
        shard = f"syn-{s:06d}.tar"
        m = min(per_shard, n - s * per_shard)
        samples = []
        rows = []
        for i in range(m):
            key = f"syn_{s * per_shard + i:09d}"
            ids = np.minimum(rng.zipf(1.3, int(rng.integers(0, 12))) - 1, len(VOCAB) - 1)
            caption = " ".join(VOCAB[j] for j in ids) + (", punctuation!" if i % 7 == 0 else "")
            w = int(rng.integers(8, 70))
            h = int(rng.integers(8, 70))
            samples.append({"__key__": key, "png": png, "txt": caption, "json": {"width": w, "height": h}})
            rows.append({"key": key, "caption": caption, "width": w, "height": h, "image_ext": "png"} if sidecar
                        else {"key": key})
        write_shard(Out(root), shard, samples, rows)
        sizes[shard] = m
    finish_dataset(Out(root), sizes, {"stage": "test"})
    return root


def old_distribution(values) -> dict:
    """The summary as numpy computes it over the values in one array (the stage's former code)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"count": 0}
    out = {"count": int(v.size), "mean": round(float(v.mean()), 3)}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = round(float(np.quantile(v, q)), 3)
    return out


def old_stats(path, out: Path, top: int) -> None:
    """The former `vlprep stats`: every sidecar concatenated into lists, then numpy and matplotlib over the lists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = open_dataset(path)
    table = read_sidecars(ds)
    cols = set(table.column_names)
    if {"caption", "width", "height"} <= cols:
        captions = table.column("caption").to_pylist()
        widths = table.column("width").to_pylist()
        heights = table.column("height").to_pylist()
        exts = table.column("image_ext").to_pylist() if "image_ext" in cols else []
    else:
        samples = list(iter_samples(ds))
        captions = [s.get("txt", "") for s in samples]
        widths = [(s.get("json") or {}).get("width") for s in samples]
        heights = [(s.get("json") or {}).get("height") for s in samples]
        exts = []
    lengths = [len(words(c or "")) for c in captions]
    vocab = Counter(w for c in captions for w in words(c or ""))
    sized = [(w, h) for w, h in zip(widths, heights) if w is not None and h is not None]
    out.mkdir(parents=True)
    write_json_atomic(out / "report.json", {
        "dataset": str(ds.root), "samples": ds.num_samples, "shards": len(ds.shards),
        "caption_words": old_distribution(lengths), "vocabulary_size": len(vocab), "tokens": int(sum(vocab.values())),
        "top_words": [[w, n] for w, n in vocab.most_common(top)],
        "image_width": old_distribution([w for w, _ in sized]), "image_height": old_distribution([h for _, h in sized]),
        "image_shorter_side": old_distribution([min(w, h) for w, h in sized]),
        "image_formats": dict(sorted(Counter(exts).items()))})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist(lengths, bins=min(50, max(1, len(set(lengths)))), color="tab:blue")
    axes[0].set(title="caption length", xlabel="words", ylabel="samples")
    if sized:
        w, h = np.array(sized).T
        axes[1].hist(np.minimum(w, h), bins=40, color="tab:orange")
    axes[1].set(title="image shorter side", xlabel="pixels", ylabel="samples")
    top_words = vocab.most_common(top)
    if top_words:
        names, counts = zip(*top_words)
        axes[2].barh(range(len(names))[::-1], counts, color="tab:green")
        axes[2].set_yticks(range(len(names))[::-1], names)
    axes[2].set(title="top words", xlabel="occurrences")
    fig.tight_layout()
    fig.savefig(out / "stats.png", dpi=80)
    plt.close(fig)


def test_distribution_of_counts_is_numpys_over_the_values_written_out():
    """Exactly (==, no tolerance): the mean of integers and the linear quantiles are computed in the same float64
    operations as numpy's, so every digit agrees; checked on many random samples and on edge sizes."""
    rng = np.random.default_rng(0)
    cases = [[7], [3, 3], [1, 2], [0, 5, 5, 9], list(range(101)), [1, 2, 3, 4, 100]]
    for n in [2, 3, 5, 19, 20, 21, 99, 100, 101, 1000, 4321]:
        for hi in (3, 60, 10**6):
            cases.append(rng.integers(0, hi, n).tolist())
    cases.append(rng.zipf(1.5, 5000).tolist())
    for values in cases:
        assert distribution(Counter(values)) == old_distribution(values), values[:10]
    assert distribution(Counter()) == {"count": 0} and distribution({4: 0}) == {"count": 0}


@pytest.mark.parametrize("sidecar", [True, False])
def test_report_and_png_are_the_former_ones(tmp_path, sidecar):
    """report.json byte for byte and stats.png pixel for pixel, against the former list-based stage (in this file)."""
    ds = synthetic(tmp_path / "ds", 730, per_shard=100, sidecar=sidecar)
    dataset_stats(ds, out=tmp_path / "new", top=12)
    old_stats(ds, tmp_path / "old", top=12)
    assert (tmp_path / "new" / "report.json").read_bytes() == (tmp_path / "old" / "report.json").read_bytes()
    report = json.loads((tmp_path / "new" / "report.json").read_text())
    assert report["samples"] == 730 and report["caption_words"]["count"] == 730
    assert report["image_formats"] == ({"png": 730} if sidecar else {})
    new = np.asarray(Image.open(tmp_path / "new" / "stats.png"))
    old = np.asarray(Image.open(tmp_path / "old" / "stats.png"))
    assert new.shape == old.shape and (new == old).all()


def test_a_column_only_some_sidecars_have_reads_as_nulls(tmp_path):
    """As when the sidecars are concatenated: a shard without width/height has its samples counted without a size."""
    ds = synthetic(tmp_path / "ds", 250, per_shard=100)
    side = ds / "syn-000001.parquet"
    t = pq.read_table(side)
    pq.write_table(t.drop_columns(["width", "height"]), side)
    report = dataset_stats(ds, out=tmp_path / "new", top=5)
    old_stats(ds, tmp_path / "old", top=5)
    assert (tmp_path / "new" / "report.json").read_bytes() == (tmp_path / "old" / "report.json").read_bytes()
    assert report["image_width"]["count"] == 150 and report["caption_words"]["count"] == 250


def test_report_of_a_dataset_without_samples_is_the_former_one(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    write_shard(Out(root), "e-000000.tar", [], [{"key": "k", "caption": "", "width": 1, "height": 1}][:0],
                schema=None)
    finish_dataset(Out(root), {"e-000000.tar": 0}, {"stage": "test"})
    dataset_stats(root, out=tmp_path / "new")
    old_stats(root, tmp_path / "old", top=20)
    assert (tmp_path / "new" / "report.json").read_bytes() == (tmp_path / "old" / "report.json").read_bytes()
    assert (np.asarray(Image.open(tmp_path / "new" / "stats.png")) ==
            np.asarray(Image.open(tmp_path / "old" / "stats.png"))).all()


@pytest.mark.slow  # about 7 s: stats over a dataset large enough to show growth
def test_memory_does_not_grow_with_the_samples(tmp_path):
    """Measured: -9 B per extra sample (the peak is the plot's, a constant; the counters are vocabulary- and
    size-sized), against +244 B per sample for the former stage on the same data (every caption, width and
    height in lists); 20 B is far from both."""
    growth = growth_per_sample(lambda m: dataset_stats(synthetic(tmp_path / f"ds{m}", m), out=tmp_path / f"o{m}"),
                               2000)
    assert growth < 20

"""`vlprep stats` on multi-caption samples (docs/FORMAT.md): every caption is counted, not only the first (`txt`)."""

import json
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import image_bytes
from vlprep.output import Out, finish_dataset, write_shard
from vlprep.stats import dataset_stats, print_stats
from vlprep.text import words

# 2-3 captions per image, as a Karpathy split gives them; a single-caption sample among them
CAPTIONS = [["a red fox", "the fox jumps over a log", "fox"],
            ["two dogs", "Dogs play in snow"],
            ["one caption only"],
            ["a cat sleeps", "cat on a mat, asleep", "a sleeping cat on the mat today"]]


def multi(root: Path, sidecar: bool) -> Path:
    """One shard of CAPTIONS: txt is the first caption, json.captions (and the sidecar's `captions`) all of them;
    with sidecar=False the sidecar has only keys, as another tool's, so stats reads the tars."""
    root.mkdir(parents=True)
    png = image_bytes(16, 16, seed=0)
    samples, rows = [], []
    for i, caps in enumerate(CAPTIONS):
        key = f"m_{i:09d}"
        meta = {"width": 16, "height": 16, **({"captions": caps} if len(caps) > 1 else {})}
        samples.append({"__key__": key, "png": png, "txt": caps[0], "json": meta})
        row = {"key": key, "caption": caps[0], "width": 16, "height": 16, "image_ext": "png",
               "captions": caps if len(caps) > 1 else None}
        rows.append(row if sidecar else {"key": key})
    write_shard(Out(root), "m-000000.tar", samples, rows)
    finish_dataset(Out(root), {"m-000000.tar": len(CAPTIONS)}, {"stage": "test"})
    return root


@pytest.mark.parametrize("sidecar", [True, False])
def test_every_caption_is_counted(tmp_path, sidecar):
    """Captions, tokens, vocabulary and the length distribution against a count over the flat list written here."""
    report = dataset_stats(multi(tmp_path / "ds", sidecar), out=tmp_path / "stats", top=50)
    flat = [c for caps in CAPTIONS for c in caps]
    vocab = Counter(w for c in flat for w in words(c))
    lengths = sorted(len(words(c)) for c in flat)
    assert report["samples"] == 4 and report["caption_words"]["count"] == len(flat) == 9
    assert report["tokens"] == sum(vocab.values()) and report["vocabulary_size"] == len(vocab)
    assert dict(map(tuple, report["top_words"])) == dict(vocab)
    assert report["caption_words"]["p0"] == lengths[0] and report["caption_words"]["p100"] == lengths[-1]
    assert report["caption_words"]["mean"] == round(sum(lengths) / len(lengths), 3)
    assert json.loads((tmp_path / "stats" / "report.json").read_text())["caption_words"]["count"] == 9


def test_the_table_says_captions_are_counted(tmp_path):
    """The terminal table names the caption count beside the sample count when they differ."""
    report = dataset_stats(multi(tmp_path / "ds", True), out=tmp_path / "stats")
    console = Console(record=True, width=200)
    print_stats(report, console)
    text = console.export_text()
    assert "samples / captions / shards" in text and "4 / 9 / 1" in text

"""benchmarks/loader.py --quick, in-process: a row per (augment, worker count), each side's rate positive, the same
samples read by both, and the bytes each sample costs in the worker queue."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.slow  # the benchmark builds 3 pipelines and 12 loaders; about 8-20 s with its imports on 2 cores
def test_the_quick_loader_benchmark_fills_its_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", [str(BENCH)] + sys.path)  # the script's own imports (common); restored after
    loader = importlib.import_module("loader")
    out = tmp_path / "loader.json"
    rows = loader.main(["--quick", "--workers", "2", "--json", str(out)])
    assert [(r["augment"], r["workers"]) for r in rows] == [(a, w) for a in ("none", "albef", "softmask")
                                                            for w in (1, 2)]
    size = 64  # --quick's image size
    for r in rows:
        assert r["vltrain_per_s"] > 0 and r["baseline_per_s"] > 0 and r["runs"] == 1
        assert r["ratio"] == r["vltrain_per_s"] / r["baseline_per_s"]
        # 16 images in 4 shards of 4, batches of 4 with drop_last: every image once, on both sides
        assert r["samples"] == r["baseline_samples"] == 16, r
        assert r["baseline_bytes_per_sample"] == 3 * size * size * 4  # float32 C x S x S
        assert r["vltrain_bytes_per_sample"] in {3 * size * size * k for k in (1, 2, 4)}  # uint8, 16-bit or float32
    assert json.loads(out.read_text())["rows"] == rows
    text = capsys.readouterr().out
    assert "ratio" in text and "load average at end" in text

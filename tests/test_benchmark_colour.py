"""benchmarks/colour.py on a tiny input, in-process: a row per op, both sides timed, the ratio theirs over ours, and
the differences the ops are allowed (none for the hue shift and the jitter, at most 1 grey level for the blur)."""

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_the_colour_benchmark_fills_its_table(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", [str(BENCH)] + sys.path)  # the script's own imports (common, loader)
    torch = importlib.import_module("torch")
    threads = torch.get_num_threads()
    try:
        rows = importlib.import_module("colour").main(["--size", "48", "--images", "3", "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)  # the benchmark takes one thread, as a loader worker
    assert [r["op"] for r in rows] == ["hue", "jitter", "blur", "recipe"]
    for r in rows:
        assert r["torchvision_ms"] > 0 and r["vltrain_ms"] > 0
        assert r["ratio"] == r["torchvision_ms"] / r["vltrain_ms"]
        assert r["max_diff"] <= (0 if r["op"] in ("hue", "jitter") else 1)
        assert 0 <= r["frac_diff"] <= 1
    assert "load average at end" in capsys.readouterr().out

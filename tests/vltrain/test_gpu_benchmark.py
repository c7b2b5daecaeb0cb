"""benchmarks/gpu.py's CPU dry run: the rows it appends to --json and its table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ROW_KEYS = {"kind", "size", "preset", "precision", "batch", "ckpt", "compile", "status", "samples_per_s", "step_ms",
            "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "sync_step_ms", "peak_mem_gib", "params_m",
            "gflop_per_sample", "tflops", "mfu", "mfu_measured"}


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                                                     "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_the_cpu_dry_run_appends_a_header_and_one_row_per_setting(tmp_path):
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"kind": "earlier"}) + "\n")  # appended to, not replaced
    r = bench("--size", "tiny", "--presets", "clip,albef", "--batches", "4", "--steps", "1", "--timed-steps", "2",
              "--runs", "1", "--json", str(out),
              "--table", "--max-batch", "--max-batch-limit", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"kind": "earlier"}
    header = lines[1]
    assert header["kind"] == "header" and header["device"] == "CPU" and header["precision"] == "fp32"
    assert header["peak_dtype"] == "fp32" and header["peak_tflops_measured"] > 0
    assert header["peak_tflops_spec"] is None and header["mfu_against"] == "measured"  # no vendor figure for a CPU
    rows = [x for x in lines[2:] if x["kind"] == "row"]
    assert [(x["preset"], x["size"], x["batch"]) for x in rows] == [("clip", "tiny", 4), ("albef", "tiny", 4)]
    for row in rows:
        assert set(row) == ROW_KEYS and row["status"] == "ok", row
        parts = sum(row[p] for p in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms"))
        assert row["sync_step_ms"] == pytest.approx(parts, abs=0.05)  # one step: its parts' sum (each to 0.01)
        # both rounded to 0.01 (step_ms's rounding moves 4 / step a relative 0.005 / step_ms at most)
        assert row["samples_per_s"] == pytest.approx(4 / (row["step_ms"] / 1e3), rel=1e-3, abs=0.005)
        assert row["peak_mem_gib"] is None and row["tflops"] > 0 and 0 < row["mfu"] < 1
        # three values rounded to 4 significant digits: each off by at most 5e-4 relative
        assert row["mfu"] == pytest.approx(row["tflops"] / header["peak_tflops_measured"], rel=2e-3)
        assert row["mfu_measured"] == row["mfu"]  # a CPU: the measured peak is the only one
        assert row["tflops"] == pytest.approx(row["gflop_per_sample"] * 4 / row["step_ms"], rel=2e-3)
    assert rows[1]["params_m"] > rows[0]["params_m"]  # albef's fusion layers and heads
    found = [x for x in lines[2:] if x["kind"] == "max_batch"]
    assert [(x["preset"], x["ckpt"]) for x in found] == [("clip", "off"), ("albef", "off")]
    assert all(x["max_batch"] == 64 and x["stopped"] == "limit" for x in found), found
    assert "| tiny | clip | 4 | off | off |" in r.stdout and "| tiny | albef | max 64 (limit) |" in r.stdout
    assert "MFU (vendor peak) | MFU (measured peak) |" in r.stdout


def test_a_step_counts_each_forward_as_often_as_it_runs():
    """count_flops over a step: a forward that carries gradients, its backward as it runs, and a no-grad forward
    once, checked against the matmul arithmetic (2 n a b per (n, a) x (a, b) product).

    x (n, a) -> W1 (a, b) -> W2 (b, c) carries gradients: forward 2nab + 2nbc; backward W2's weight and input
    gradients 2 x 2nbc, W1's weight gradient 2nab (x needs none); a no-grad forward x -> W3 (a, d): 2nad. Counting
    '3 x forward' would give 3 (2nab + 2nbc + 2nad), which overstates the step by the no-grad pass twice and W1's
    input gradient."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu import count_flops
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    n, a, b, c, d = 8, 16, 32, 4, 64
    torch = pytest.importorskip("torch")
    w1, w2 = torch.randn(a, b, requires_grad=True), torch.randn(b, c, requires_grad=True)
    w3 = torch.randn(a, d)
    x = torch.randn(n, a)

    def step():
        with torch.no_grad():
            x @ w3  # a momentum model's forward
        ((x @ w1) @ w2).sum().backward()

    assert count_flops(step) == 2 * n * a * b + 2 * n * b * c + 2 * 2 * n * b * c + 2 * n * a * b + 2 * n * a * d


@pytest.mark.slow  # a Python that imports torch: ~5 s here
def test_a_bad_list_is_one_line():
    r = bench("--size", "huge")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == ["error: 'huge': use a comma-separated list of "
                                                                   "tiny, small, base"], r.stderr

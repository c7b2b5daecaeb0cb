"""benchmarks/gpu.py's CPU dry run: the rows it appends to --json and its table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
ROW_KEYS = {"kind", "size", "preset", "precision", "batch", "ckpt", "compile", "status", "samples_per_s", "step_ms",
            "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "peak_mem_gib", "params_m", "tflops", "mfu"}


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                                                     "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_the_cpu_dry_run_appends_a_header_and_one_row_per_setting(tmp_path):
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"kind": "earlier"}) + "\n")  # appended to, not replaced
    r = bench("--size", "tiny", "--presets", "clip,albef", "--batches", "4", "--steps", "1", "--json", str(out),
              "--table", "--max-batch", "--max-batch-limit", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"kind": "earlier"}
    header = lines[1]
    assert header["kind"] == "header" and header["device"] == "CPU" and header["precision"] == "fp32"
    assert header["peak_dtype"] == "fp32" and header["peak_tflops_measured"] > 0
    rows = [x for x in lines[2:] if x["kind"] == "row"]
    assert [(x["preset"], x["size"], x["batch"]) for x in rows] == [("clip", "tiny", 4), ("albef", "tiny", 4)]
    for row in rows:
        assert set(row) == ROW_KEYS and row["status"] == "ok", row
        parts = sum(row[p] for p in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms"))
        assert row["step_ms"] == pytest.approx(parts, abs=0.05)  # one step: its parts' sum (each rounded to 0.01)
        assert row["samples_per_s"] == pytest.approx(4 / (row["step_ms"] / 1e3), rel=1e-3)
        assert row["peak_mem_gib"] is None and row["tflops"] > 0 and 0 < row["mfu"] < 1
        # three values rounded to 4 significant digits: each off by at most 5e-4 relative
        assert row["mfu"] == pytest.approx(row["tflops"] / header["peak_tflops_measured"], rel=2e-3)
    assert rows[1]["params_m"] > rows[0]["params_m"]  # albef's fusion layers and heads
    found = [x for x in lines[2:] if x["kind"] == "max_batch"]
    assert [(x["preset"], x["ckpt"]) for x in found] == [("clip", "off"), ("albef", "off")]
    assert all(x["max_batch"] == 64 and x["stopped"] == "limit" for x in found), found
    assert "| tiny | clip | 4 | off | off |" in r.stdout and "| tiny | albef | max 64 (limit) |" in r.stdout


@pytest.mark.slow  # a Python that imports torch: ~5 s here
def test_a_bad_list_is_one_line():
    r = bench("--size", "huge")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == ["error: 'huge': use a comma-separated list of "
                                                                   "tiny, small, base"], r.stderr

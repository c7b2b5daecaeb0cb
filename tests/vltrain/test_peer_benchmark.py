"""benchmarks/peer.py's CPU dry run: vltrain and open_clip on the same towers, one row per side and a ratio."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # three Pythons that import torch (the parent and one per side)
def test_the_dry_run_times_both_sides_on_the_same_network(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "--device", "cpu", "--size", "tiny",
                        "--batches", "4", "--compile", "off", "--timed-steps", "2", "--runs", "1", "--warmup", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    header = lines[0]
    assert header["kind"] == "header" and header["mfu_against"] == "measured" and header["peak_tflops_measured"] > 0
    rows = {x["side"]: x for x in lines if x["kind"] == "row"}
    assert set(rows) == {"open_clip", "vltrain"} and all(x["status"] == "ok" for x in rows.values()), rows
    oc, vl = rows["open_clip"], rows["vltrain"]
    # the same network: vltrain started from open_clip's towers, captions padded to open_clip's 77 tokens
    assert oc["params_m"] == vl["params_m"]
    assert oc["gflop_per_sample"] == vl["gflop_per_sample"]
    for x in (oc, vl):  # one function for both: MFU = TFLOP/s over the peak (values rounded to 4 digits)
        assert x["samples_per_s"] == pytest.approx(4 / (x["step_ms"] / 1e3), rel=1e-3)
        assert x["mfu"] == pytest.approx(x["tflops"] / header["peak_tflops_measured"], rel=2e-3)
    (pair,) = [x for x in lines if x["kind"] == "pair"]
    assert pair["ratio"] == pytest.approx(vl["samples_per_s"] / oc["samples_per_s"], abs=1e-3)
    assert "| 4 | off |" in r.stdout and "vltrain / open_clip" in r.stdout

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


def test_pairs_are_written_as_they_end_and_a_kill_keeps_them(tmp_path, monkeypatch):
    """A GPU check's time limit can stop peer.py mid-way: every (batch, compile) pair finished before it is already in
    --json, and the towers' temporary folder is removed (SIGTERM unwinds as SystemExit)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    made = []
    monkeypatch.setattr(peer, "make_towers", lambda folder, size: made.append(folder) or folder)
    monkeypatch.setattr(peer, "tiny_shards", lambda tmp, n: tmp)
    monkeypatch.setattr(peer, "matmul_peak", lambda device: 1.0)
    calls = []

    def run_worker(args, side, batch, comp, shards, folder):
        calls.append((side, batch))
        if len(calls) == 3:  # the second batch's first side: the limit's SIGTERM arrives
            peer.terminated(15, None)
        return {"kind": "row", "side": side, "size": "tiny", "batch": batch, "compile": comp, "precision": "fp32",
                "status": "ok", "samples_per_s": 10.0 * batch if side == "vltrain" else 5.0 * batch}

    monkeypatch.setattr(peer, "run_worker", run_worker)
    out = tmp_path / "rows.jsonl"
    with pytest.raises(SystemExit) as e:
        peer.main(["--device", "cpu", "--size", "tiny", "--batches", "4,8", "--compile", "off", "--json", str(out)])
    assert e.value.code == 128 + 15
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["header", "row", "row", "pair"]
    assert lines[3]["batch"] == 4 and lines[3]["ratio"] == pytest.approx(2.0)
    assert made and not made[0].parent.exists()  # bench-peer-* removed

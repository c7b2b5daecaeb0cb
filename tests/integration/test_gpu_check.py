"""scripts/gpu-check.sh --dry-run: the GPU check's every step on this machine's CPU at tiny sizes, so the script
cannot rot between the rare runs on a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_runs_every_step_and_writes_its_report(tmp_path):
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(tmp_path / "c")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    report = json.loads((tmp_path / "c" / "gpu-check.json").read_text())
    assert [s["step"] for s in report["steps"]] == ["env", "cuda-tests", "bench-eager", "ddp", "e2e-data", "e2e-clip",
                                                    "e2e-albef"]
    assert all(s["rc"] == 0 for s in report["steps"])
    rows = report["bench"]
    assert {(row["preset"], row["size"]) for row in rows} == {("clip", "tiny"), ("albef", "tiny")}
    assert all(row["samples_per_s"] > 0 and row["gflop_per_sample"] > 0 and row["sync_step_ms"] > 0 for row in rows)
    assert report["cuda_tests"]["tests"] > 0  # collected (and skipped: no CUDA here)
    # end to end: each preset trained 6 steps of 4 from the JPEG shards with data.workers auto (this machine's CPUs
    # less one, fewer where the 40 samples' shards cannot feed them), the 4 after the warm-up timed, against the
    # synthetic row of the same preset and batch
    synthetic = {row["preset"]: row["samples_per_s"] for row in rows}
    cpus = len(os.sched_getaffinity(0))
    e2e = report["e2e"]
    assert [(row["preset"], row["size"], row["batch"], row["status"]) for row in e2e] == [
        ("clip", "tiny", 4, "ok"), ("albef", "tiny", 4, "ok")]
    for row in e2e:
        assert row["samples_per_s"] > 0 and row["synthetic_samples_per_s"] == synthetic[row["preset"]]
        assert row["ratio"] == round(row["samples_per_s"] / row["synthetic_samples_per_s"], 3)
        assert 0 <= row["data_wait_share"] < 1 and row["steps_timed"] == 4
        assert 1 <= row["workers"] <= max(1, min(16, cpus - 1))
    table = (tmp_path / "c" / "gpu-check.md").read_text()
    assert "| ddp | ok |" in table and table in r.stdout
    assert "| mfu (no vendor peak: measured) |" in table and "(peer: not run in this check)" in table
    for row in e2e:
        assert (f"| tiny | {row['preset']} | 4 | {row['workers']} | ") in table
    assert not list((tmp_path / "c").glob("e2e-*/*.pt"))  # the runs' checkpoints are not kept


def test_gpu_check_refuses_an_unknown_argument_in_one_line():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--fast"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == ("error: unknown argument --fast (usage: scripts/gpu-check.sh "
                                                      "[--dry-run] [--out CHECK_DIR])")

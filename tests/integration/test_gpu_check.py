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
    assert [s["step"] for s in report["steps"]] == ["env", "cuda-tests", "bench-eager", "ddp"]
    assert all(s["rc"] == 0 for s in report["steps"])
    rows = report["bench"]
    assert {(row["preset"], row["size"]) for row in rows} == {("clip", "tiny"), ("albef", "tiny")}
    assert all(row["samples_per_s"] > 0 for row in rows)
    assert report["cuda_tests"]["tests"] > 0  # collected (and skipped: no CUDA here)
    table = (tmp_path / "c" / "gpu-check.md").read_text()
    assert "| ddp | ok |" in table and table in r.stdout


def test_gpu_check_refuses_an_unknown_argument_in_one_line():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--fast"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == ("error: unknown argument --fast (usage: scripts/gpu-check.sh "
                                                      "[--dry-run] [--out CHECK_DIR])")

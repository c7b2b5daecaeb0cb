"""scripts/gpu-check.sh --dry-run: the GPU check's every step on this machine's CPU at tiny sizes, so the script
cannot rot between the rare runs on a GPU; and its budget: a step whose limit does not fit in what is left is not
started, and the report says so."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_runs_every_step_and_writes_its_report(tmp_path):
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(tmp_path / "c"),
                        "--work", str(tmp_path / "w")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    # what a device call brings back: three files, one folder deep
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["gpu-check.json", "gpu-check.md", "logs.tar.gz"]
    report = json.loads((tmp_path / "c" / "gpu-check.json").read_text())
    assert [s["step"] for s in report["steps"]] == ["env", "cuda-tests", "bench-eager", "e2e-data", "e2e-clip",
                                                    "e2e-albef", "bench-batch", "ddp"]
    assert all(s["rc"] == 0 for s in report["steps"]) and report["running"] is None
    assert report["budget"]["budget_s"] == 540 and report["budget"]["elapsed_s"] < 540
    with tarfile.open(tmp_path / "c" / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{s['step']}.log" for s in report["steps"]} | {"steps.jsonl", "bench.jsonl", "e2e.jsonl"} <= names
    rows = report["bench"]
    assert {(row["preset"], row["size"]) for row in rows} == {("clip", "tiny"), ("albef", "tiny")}
    # bench-eager's batch 4 and bench-batch's 8 and 16, each preset: the batch table's rows
    assert sorted((row["preset"], row["batch"]) for row in rows) == [(p, b) for p in ("albef", "clip")
                                                                     for b in (4, 8, 16)]
    assert all(row["samples_per_s"] > 0 and row["gflop_per_sample"] > 0 and row["sync_step_ms"] > 0 for row in rows)
    assert report["cuda_tests"]["tests"] > 0  # collected (and skipped: no CUDA here)
    # end to end: each preset trained 6 steps of 4 from the JPEG shards with data.workers auto (this machine's CPUs
    # less one, fewer where the 40 samples' shards cannot feed them), the 4 after the warm-up timed, against the
    # synthetic row of the same preset and batch
    synthetic = {row["preset"]: row["samples_per_s"] for row in rows if row["batch"] == 4}
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
    for preset in ("clip", "albef"):
        speed = next(row["samples_per_s"] for row in rows if row["preset"] == preset and row["batch"] == 16)
        assert f"| tiny | {preset} | 16 | " in table and f"| {speed / synthetic[preset]:.2f}x |" in table
    assert not list((tmp_path / "w").glob("e2e-*/*.pt"))  # the runs' checkpoints are not kept


def test_gpu_check_budget_leaves_out_the_steps_that_do_not_fit_and_says_so(tmp_path):
    # 60 s less the 15 s kept for the report: env (30 s + 5 s to stop it) fits at the start; after it (at least
    # a second of imports) no other step does: the next smallest, e2e-data, asks for 40 + 5
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--budget", "60", "--out",
                        str(tmp_path / "c"), "--work", str(tmp_path / "w")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]  # a step left out for the budget is no failure
    steps = json.loads((tmp_path / "c" / "gpu-check.json").read_text())["steps"]
    assert [(s["step"], s["rc"], s.get("skipped")) for s in steps] == [
        ("env", 0, None), ("cuda-tests", None, "budget"), ("bench-eager", None, "budget"),
        ("e2e-data", None, "budget"), ("e2e-clip", None, "budget"), ("e2e-albef", None, "budget"),
        ("bench-batch", None, "budget"), ("ddp", None, "budget")]
    lines = (tmp_path / "c" / "gpu-check.md").read_text().splitlines()
    for s in steps[1:]:
        if s["step"].startswith("e2e-") and s["step"] != "e2e-data":
            assert f"| {s['step']} | not run: budget (e2e-data did not run) | 0 |" in lines
        else:  # not started: its limit and the 5 s to stop it exceed what was left, 45 s less env's time at most
            assert s["left"] <= 45 - steps[0]["seconds"] < s["limit"] + 5
            assert (f"| {s['step']} | not run: budget (limit {s['limit']} s + 5 s to stop it, {s['left']} s left) | 0 |"
                    in lines)
    assert "(batch: not run: budget)" in lines and "(benchmark: not run: budget)" in lines


def test_gpu_check_refuses_an_unknown_argument_in_one_line():
    usage = ("usage: scripts/gpu-check.sh [--dry-run] [--budget SECONDS] [--only STEP,...] [--out OUT_DIR] "
             "[--work WORK_DIR]")
    for args, error in [(["--fast"], f"unknown argument --fast ({usage})"),
                        (["--budget", "9m"], f"--budget needs whole seconds, not '9m' ({usage})"),
                        (["--only", "env,gpu"], "unknown step gpu (steps: env cuda-tests bench-eager e2e-data e2e-clip "
                                                "e2e-albef peer bench-compile bench-batch bench-patchdrop faiss ddp "
                                                "memory-accum bench-small bench-max-batch)")]:
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), *args], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.strip() == "error: " + error

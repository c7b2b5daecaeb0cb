"""scripts/gpu_check.py's report and end-to-end row on hand-written JSON lines: the bench table's new columns, the
peer table from peer.py's pair rows, the end-to-end table, the batch table, steps left out for the budget or killed
while running, the logs archive, and a line instead of a traceback for a missing file."""

import importlib.util
import io
import json
import random
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, rows: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


BENCH = [{"kind": "header", "device": "NVIDIA H200", "mfu_against": "vendor"},
         {"kind": "row", "size": "base", "preset": "clip", "batch": 128, "precision": "bf16", "compile": "off",
          "ckpt": "off", "status": "ok", "samples_per_s": 1000.0, "step_ms": 128.0, "sync_step_ms": 140.5,
          "gflop_per_sample": 105.2, "tflops": 105.2, "mfu": 0.1064, "mfu_measured": 0.1377},
         # a compiled row of the same preset and batch: not the end-to-end row's synthetic figure
         {"kind": "row", "size": "base", "preset": "clip", "batch": 128, "precision": "bf16", "compile": "on",
          "ckpt": "off", "status": "ok", "samples_per_s": 1500.0}]


def run_folder(path: Path, batch: int, rates: list[tuple[int, float]], waits: list[float], workers: int = 15) -> None:
    """A run's metrics.jsonl (rows at the given steps with samples_per_s) and data_wait.jsonl: step k's wait waits[k-1],
    each step 0.1 s of compute after its wait."""
    write(path / "metrics.jsonl", [{"step": s, "total": 1.0, "samples_per_s": r} for s, r in rates])
    end, rows = 0.0, []
    for k, w in enumerate(waits, 1):
        end += (0.1 if k > 1 else 0.0) + w
        rows.append({"step": k, "wait_s": w, "end_s": end})
    write(path / "data_wait.jsonl", [{"workers": workers, "prefetch": -1}] + rows)


def test_e2e_row_times_the_steps_after_the_warmup_against_the_eager_synthetic_row(gc, tmp_path):
    # rows every 5 steps: the warm-up's rows (steps 1-10) are slow and left out
    run_folder(tmp_path / "e2e-clip", 128, [(5, 100.0), (10, 400.0), (15, 800.0), (20, 1000.0), (25, 640.0)],
               [2.0] + [0.01] * 9 + [0.0, 0.02, 0.0, 0.05, 0.0] + [0.0] * 10)
    row = gc.e2e_row(tmp_path / "e2e-clip", BENCH, "base", "clip", 128, 10)
    # samples / summed time over rows 15, 20, 25 (640 samples each)
    seconds = 640 / 800 + 640 / 1000 + 640 / 640
    assert row["samples_per_s"] == pytest.approx(3 * 640 / seconds, abs=0.005)
    assert row["synthetic_samples_per_s"] == 1000.0
    assert row["ratio"] == pytest.approx(row["samples_per_s"] / 1000.0, abs=5e-4)
    # steps 11-25: 15 steps of 0.1 s compute, their waits 0.07 s in all
    assert row["data_wait_share"] == pytest.approx(0.07 / (15 * 0.1 + 0.07), abs=5e-5)
    assert (row["steps_timed"], row["workers"], row["status"]) == (15, 15, "ok")


def test_e2e_row_says_what_is_missing(gc, tmp_path):
    row = gc.e2e_row(tmp_path / "e2e-albef", BENCH, "base", "albef", 128, 10)  # the run left nothing
    assert row["status"].startswith("no training rows in e2e-albef/metrics.jsonl")
    run_folder(tmp_path / "short", 128, [(5, 100.0), (10, 400.0)], [0.0] * 10)
    assert gc.e2e_row(tmp_path / "short", BENCH, "base", "clip", 128, 10)["status"].startswith("no logged step after")
    run_folder(tmp_path / "albef", 128, [(10, 100.0), (20, 400.0)], [0.0] * 20)
    row = gc.e2e_row(tmp_path / "albef", BENCH, "base", "albef", 128, 10)  # no synthetic albef row in BENCH
    assert row["synthetic_samples_per_s"] is None and row["ratio"] is None
    assert row["status"] == "no synthetic row (base albef batch 128) in bench.jsonl"


def test_report_tables_peer_pairs_e2e_rows_and_missing_files(gc, tmp_path, capsys):
    check = tmp_path / "check"
    write(check / "steps.jsonl", [{"step": "bench-eager", "rc": 0, "seconds": 100},
                                  {"step": "peer", "rc": 124, "seconds": 300},
                                  {"step": "e2e-data", "rc": 0, "seconds": 12},
                                  {"step": "e2e-clip", "rc": 0, "seconds": 50},
                                  {"step": "e2e-albef", "rc": 124, "seconds": 100}])
    write(check / "bench.jsonl", BENCH)
    e2e = {"kind": "e2e", "size": "base", "preset": "clip", "batch": 128, "workers": 15, "samples_per_s": 950.0,
           "synthetic_samples_per_s": 1000.0, "ratio": 0.95, "data_wait_share": 0.012, "steps_timed": 30,
           "status": "ok"}
    write(check / "e2e.jsonl", [e2e], tail='{"kind": "e2e", "pres')  # a line cut off by a killed step
    assert gc.report(check) == 1  # a step failed
    md = (check / "gpu-check.md").read_text()
    assert md in capsys.readouterr().out
    lines = md.splitlines()
    head = next(ln for ln in lines if ln.startswith("| size | preset | params_m") or ln.startswith("| size | preset |"
                                                                                                    " batch | prec"))
    for col in ("gflop_per_sample", "mfu (vendor peak)", "mfu (measured peak)", "sync_step_ms (parts)"):
        assert f"| {col} |" in head
    assert "| base | clip | 128 | bf16 | off | off | 1000 | 128 | 140 |" in md  # cell(): 3 significant digits
    # peer.jsonl missing after a failed peer step: one line naming the step
    assert "(no peer rows: peer.jsonl missing or empty; step peer rc 124, see its log)" in lines
    assert "| base | clip | 128 | 15 | 950 | 1000 | 0.95x | 1.2% | 30 | ok |" in lines
    assert "| | albef | | | | | | | | no row: step e2e-albef rc 124, see e2e-albef.log |" in lines
    out = json.loads((check / "gpu-check.json").read_text())
    assert out["e2e"] == [e2e] and out["peer"] == []

    pairs = [{"kind": "row", "side": "vltrain", "batch": 256, "compile": "off", "status": "ok"},
             {"kind": "pair", "batch": 256, "compile": "off", "ratio": 1.234, "open_clip_samples_per_s": 1000.0,
              "open_clip_mfu": 0.2, "open_clip_status": "ok", "vltrain_samples_per_s": 1234.0, "vltrain_mfu": 0.2468,
              "vltrain_status": "ok"},
             {"kind": "pair", "batch": 256, "compile": "on", "ratio": None, "open_clip_samples_per_s": None,
              "open_clip_mfu": None, "open_clip_status": "timed out after 130 s", "vltrain_samples_per_s": 2000.0,
              "vltrain_mfu": 0.4, "vltrain_status": "ok"}]
    write(check / "peer.jsonl", pairs)
    gc.report(check)
    lines = (check / "gpu-check.md").read_text().splitlines()
    assert "| 256 | off | 1000 | 1234 | 1.23x | 20.0% | 24.7% |" in lines
    assert "| 256 | on | timed out after 130 s | 2000 | n/a | n/a | 40.0% |" in lines


def test_report_of_an_empty_check_folder_says_what_did_not_run(gc, tmp_path, capsys):
    assert gc.report(tmp_path) == 1  # no steps recorded: not a pass
    lines = (tmp_path / "gpu-check.md").read_text().splitlines()
    for name in ("benchmark", "peer", "end-to-end"):
        assert f"({name}: not run in this check)" in lines


def test_e2e_command_appends_its_row_and_fails_without_a_run(gc, tmp_path, capsys):
    write(tmp_path / "bench.jsonl", BENCH)
    run_folder(tmp_path / "e2e-clip", 128, [(5, 100.0), (10, 500.0)], [0.0] * 10)
    assert gc.main(["e2e", str(tmp_path / "e2e-clip"), str(tmp_path), "base", "clip", "128", "5"]) == 0
    assert gc.main(["e2e", str(tmp_path / "e2e-albef"), str(tmp_path), "base", "albef", "128", "5"]) == 1
    rows = gc.read_jsonl(tmp_path / "e2e.jsonl")
    assert [(r["preset"], r["status"] == "ok") for r in rows] == [("clip", True), ("albef", False)]
    assert rows[0]["samples_per_s"] == 500.0 and rows[0]["ratio"] == 0.5


def test_report_says_not_run_budget_and_which_step_was_running(gc, tmp_path, capsys):
    # what the script leaves when a call is killed during e2e-clip, after bench-eager was left out for the budget
    check, out = tmp_path / "work", tmp_path / "out"
    write(check / "steps.jsonl", [
        {"step": "env", "rc": 0, "seconds": 16, "limit": 30},
        {"step": "bench-eager", "rc": None, "seconds": 0, "skipped": "budget", "limit": 160, "grace": 5, "left": 120},
        {"step": "e2e-data", "rc": 0, "seconds": 14, "limit": 40},
        {"step": "e2e-albef", "rc": None, "seconds": 0, "skipped": "no input", "needs": "e2e-data"}])
    write(check / "running.json", [{"step": "e2e-clip", "started_s": 61, "limit": 75}])
    write(check / "budget.json", [{"budget_s": 540, "reserve_s": 15, "grace_s": 5, "start_epoch": 0}])
    assert gc.report(check, out, quiet=True) == 0  # no step failed: one left out for the budget is no failure
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.md", "logs.tar.gz"]
    lines = (out / "gpu-check.md").read_text().splitlines()
    assert "| bench-eager | not run: budget (limit 160 s + 5 s to stop it, 120 s left) | 0 |" in lines
    assert "| e2e-albef | not run: no input (e2e-data did not run) | 0 |" in lines
    assert ("| e2e-clip | running when this report was written (started at 61 s, limit 75 s): a call killed then "
            "ends here | |") in lines
    assert "(benchmark: not run: budget)" in lines and "(batch: not run in this check)" in lines
    result = json.loads((out / "gpu-check.json").read_text())
    assert result["running"]["step"] == "e2e-clip" and result["budget"]["budget_s"] == 540
    write(check / "steps.jsonl", [{"step": "env", "rc": 1, "seconds": 3}])
    assert gc.report(check, out, quiet=True) == 1


def test_batch_table_speed_over_the_smallest_batch_and_memory_per_added_sample(gc, tmp_path):
    def row(preset, batch, sps=None, mem=None, status="ok", **kw):
        return {"kind": "row", "size": "base", "preset": preset, "batch": batch, "compile": "off", "ckpt": "off",
                "status": status, "samples_per_s": sps, "peak_mem_gib": mem, **kw}

    rows = [row("clip", 128, 1000.0, 12.0), row("clip", 256, 1500.0, 20.5), row("clip", 512, 1800.0, 38.0),
            row("clip", 1024, status="out of memory"),
            row("clip", 128, 1400.0, 12.0, compile="on"),  # compiled, checkpointed, dropped: not batch rows
            row("albef", 128, 500.0, 19.0, ckpt="on"), row("clip", 256, 9.0, 1.0, patch_dropout=0.5),
            row("grit", 128, 600.0, 18.0), row("grit", 256, 700.0, 30.0),  # not a batch preset
            row("albef", 256, 800.0, 30.0), row("albef", 512, 1000.0, 60.0)]
    lines = gc.batch_table(rows, [])
    # speed: samples/s over the 128 row's; memory: (peak - peak before) / (batch - batch before)
    assert f"| base | clip | 256 | 1500 | {1500 / 1000:.2f}x | 20.5 | {(20.5 - 12.0) / 128:.4f} | ok |" in lines
    assert f"| base | clip | 512 | 1800 | {1800 / 1000:.2f}x | 38 | {(38.0 - 20.5) / 256:.4f} | ok |" in lines
    assert "| base | clip | 128 | 1000 |  | 12 |  | ok |" in lines
    assert "| base | clip | 1024 |  |  |  |  | out of memory |" in lines
    # albef's eager rows start at 256 (its 128 row here is checkpointed)
    assert f"| base | albef | 512 | 1000 | {1000 / 800:.2f}x | 60 | {(60.0 - 30.0) / 256:.4f} | ok |" in lines
    assert not [ln for ln in lines if "grit" in ln or "| 9 |" in ln]
    assert len(lines) == 2 + 4 + 2
    assert gc.batch_table([row("clip", 128, 1000.0, 12.0)], [{"step": "bench-batch", "rc": 124, "seconds": 120}]) == [
        "(no batch rows: bench.jsonl missing or empty; step bench-batch rc 124, see its log)"]


def test_logs_archive_takes_the_records_and_the_tail_of_each_log(gc, tmp_path):
    big = b"".join(b"line %07d\n" % i for i in range(gc.LOG_TAIL // 10 + 500))
    (tmp_path / "bench-eager.log").write_bytes(big)
    write(tmp_path / "steps.jsonl", [{"step": "env", "rc": 0, "seconds": 1}])
    write(tmp_path / "e2e-clip" / "metrics.jsonl", [{"step": 5}])
    (tmp_path / "bench-data").mkdir()
    (tmp_path / "bench-data" / "shard-000000.tar").write_bytes(b"x" * 1000)  # data: left out
    (tmp_path / "e2e-clip" / "last.pt").write_bytes(b"x" * 1000)
    with tarfile.open(fileobj=io.BytesIO(gc.pack_logs(tmp_path)), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["bench-eager.log", "e2e-clip/metrics.jsonl", "steps.jsonl"]
        assert tar.extractfile("bench-eager.log").read() == big[len(big) - gc.LOG_TAIL:]
    # over the archive's limit: each file cut to an eighth of the tail, and again, until it fits
    noise = random.Random(0).randbytes(50_000)  # does not compress: 40,000 bytes of it are over 20,000 gzipped,
    (tmp_path / "noisy").mkdir()                  # 5,000 (and a tar header) are under
    (tmp_path / "noisy" / "noise.log").write_bytes(noise)
    with tarfile.open(fileobj=io.BytesIO(gc.pack_logs(tmp_path / "noisy", tail=40_000, limit=20_000)),
                      mode="r:gz") as tar:
        assert tar.extractfile("noise.log").read() == noise[-5_000:]

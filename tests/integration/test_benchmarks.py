"""Every benchmark script still imports and parses its options: a benchmark that rots silently (a renamed
helper) is only found when someone needs its figure. The benchmarks themselves run outside the suite; their
shared helper (benchmarks/common.py) is tested here."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "common.py")  # common.py is their helper, no script


# One fresh interpreter runs every script's `--help` as `python SCRIPT --help` would (the script as __main__, its
# folder first on sys.path, nothing of the suite's imported), each output kept apart: one torch import for all of
# them instead of one per script.
HELP_DRIVER = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    results = {}
    for script in sys.argv[1:]:
        out, err, code = io.StringIO(), io.StringIO(), None
        sys.argv, sys.path[0] = [script, "--help"], str(BENCH)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code
            except BaseException as e:
                code, err = 1, io.StringIO(f"{type(e).__name__}: {e}")
        results[script] = {"code": code or 0, "out": out.getvalue(), "err": err.getvalue()}
    print(json.dumps(results))
""").replace("BENCH", repr(str(BENCH)))


@pytest.fixture(scope="module")
def helps() -> dict:
    r = subprocess.run([sys.executable, "-c", HELP_DRIVER, *map(str, SCRIPTS)], capture_output=True, text=True,
                       timeout=600, cwd=BENCH)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_script_imports_and_shows_help(script, helps):
    r = helps[str(script)]
    assert r["code"] == 0, r["err"][-2000:]
    assert "usage:" in r["out"]


def _common():
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    return common


def test_time_sides_figures_alternates_the_order_and_keeps_each_sides_figures(tmp_path, capsys):
    common = _common()
    calls = []

    def side(name):
        def fn(out: Path) -> dict:
            assert out.is_dir() and not any(out.iterdir())  # a fresh empty folder per call
            calls.append(name)
            return {"step_s": len(calls) / 1000}
        return fn

    t = common.time_sides_figures({"a": side("a"), "b": side("b")}, 3, tmp_path, warmup=1, show="step_s",
                                  scale=1e3, unit="ms")
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then forward, reversed, forward
    assert t["a"]["step_s"] == [0.003, 0.006, 0.007] and t["b"]["step_s"] == [0.004, 0.005, 0.008]
    assert set(t["a"]) == {"wall", "cpu", "step_s"} and len(t["b"]["wall"]) == 3
    assert "round 2/3: a 6.000 ms, b 5.000 ms" in capsys.readouterr().out


def test_isolated_sides_report_their_figures_from_fresh_processes(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent(f"""
        import argparse, os, sys
        from pathlib import Path
        sys.path.insert(0, {str(BENCH)!r})
        import common

        ap = argparse.ArgumentParser()
        common.add_options(ap)
        args = ap.parse_args()
        sides = {{"a": lambda out: {{"pid": os.getpid()}}, "b": lambda out: {{"pid": os.getpid()}}}}
        common.run_child_figures(args, sides)
        t = common.time_sides_figures(sides, 2, Path({str(tmp_path)!r}), isolate=args.isolate, show="pid")
        pids = t["a"]["pid"] + t["b"]["pid"]
        print("PIDS", len(set(pids)), os.getpid() in pids)
    """))
    r = subprocess.run([sys.executable, str(script), "--isolate"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PIDS 4 False" in r.stdout  # four calls, four children, none in the parent


def test_print_table_ms_shows_milliseconds(capsys):
    common = _common()
    row = common.ratio_row("step", {"wall": [0.1], "cpu": [0.1]}, {"wall": [0.105], "cpu": [0.1]}, 1.1)
    common.print_table_ms([row])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.split()[:5] == ["step", "100.00", "105.00", "1.05x", "1.00x"] and line.split()[-1] == "PASS"


def test_the_samplers_benchmark_times_a_real_grit_step():
    """benchmarks/samplers.py's step (the budget it compares against) runs the trainer's own train_step on its
    hand-made batch: a batch missing a key the step reads (its captions) broke the script while --help still
    parsed."""
    sys.path.insert(0, str(BENCH))
    try:
        import samplers
        seconds = samplers.step_time("tiny", 4, 1)
    finally:
        sys.path.remove(str(BENCH))
    assert 0 < seconds < 60


@pytest.mark.slow
def test_scale_runs_its_stages_measures_each_process_and_prints_verdicts(tmp_path):
    """benchmarks/scale.py at two tiny sizes: its data, `vlprep shards` with two workers (a driver and two
    workers measured) and `vlprep stats`, the per-size table, the extrapolation and the PASS/FAIL rows."""
    import json

    r = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--sizes", "1000,2000", "--stages", "shards,stats",
                        "--work", str(tmp_path / "w"), "--json", str(tmp_path / "scale.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads((tmp_path / "scale.json").read_text())
    shards = got["results"]["shards"]
    assert set(shards) == {"1000", "2000"} and all(m["rc"] == 0 for m in shards.values())
    assert all(m["driver_peak"] > 0 and m["worker_peak"] > 0 and m["cpu"] > 0 for m in shards.values())
    assert shards["2000"]["written"] > shards["1000"]["written"] > 1000 * 1000  # about 1 KB images
    assert got["results"]["stats"]["1000"]["worker_peak"] == 0  # stats runs in one process
    names = {row["name"]: row for row in got["rows"]}
    assert {"shards CPU/1K 2k / 1k", "shards driver RSS 2k / 1k", "shards worker RSS 2k / 1k", "shards swap",
            "stats CPU/1K 2k / 1k"} <= set(names)
    assert all(row["result"] in ("PASS", "FAIL") for row in names.values())
    assert "extrapolated from the largest N measured" in r.stdout and "3.3M" in r.stdout
    again = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--report", str(tmp_path / "scale.json")],
                           capture_output=True, text=True, timeout=300)  # the tables again, nothing run
    assert again.returncode == 0 and "shards driver RSS 2k / 1k" in again.stdout, again.stderr[-2000:]
    assert "load average" not in again.stdout  # nothing was run


@pytest.mark.slow
def test_view_benchmark_times_both_sides_on_the_same_draw(tmp_path):
    """benchmarks/view.py at a tiny size: its dataset (`vlprep shards`), `vlprep view` and the two plain baselines
    (a header walk, tarfile) in fresh processes; all drew the same keys and wrote the same thumbnails, and the ratios
    are finite numbers."""
    import json
    import math

    r = subprocess.run([sys.executable, str(BENCH / "view.py"), "--sizes", "300", "--shard-size", "50",
                        "--samples", "20", "--repeats", "1", "--data-dir", str(tmp_path / "d"),
                        "--json", str(tmp_path / "view.json")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads((tmp_path / "view.json").read_text())
    res = got["results"]["300"]
    assert res["shards"] == 6 and res["drawn"] == 20
    assert res["same_keys"] and res["same_thumbs"]
    assert all(len(res[side]["wall"]) == 1 for side in ("view", "headers", "tarfile"))
    assert all(res[side]["rss"][0] > got["own_peak"] for side in ("view", "headers", "tarfile"))
    verdict, info = got["rows"]  # no 1M row at this size
    assert verdict["name"] == "view / headers 300" and verdict["result"] in ("PASS", "FAIL")
    assert info["name"] == "view / tarfile 300" and info["result"] == "info"
    assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in (verdict, info))
    assert "load average at end" in r.stdout


@pytest.mark.slow
def test_the_filter_benchmark_runs_both_rules_and_both_sides_agree(tmp_path):
    """benchmarks/filter.py at a tiny size: its data (planted triples, eval copies), each side in a fresh process,
    both sides dropping exactly the planted samples with the same matches, finite ratios in its record."""
    import json
    import math

    r = subprocess.run([sys.executable, str(BENCH / "filter.py"), "--n", "2000", "--eval", "300", "--topics", "50",
                        "--per-shard", "700", "--repeats", "1", "--work", str(tmp_path),
                        "--json", str(tmp_path / "filter.json")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(BENCH.parent)})  # this checkout's vlprep, children too
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads((tmp_path / "filter.json").read_text())
    assert got["near"]["planted"] == 40 and got["near"]["dropped"] == [40] and got["near"]["agree"]
    assert got["exclude"]["planted"] == 30 and got["exclude"]["dropped"] == [30] and got["exclude"]["agree"]
    for part in ("near", "exclude"):
        sides = got[part]["sides"]
        assert set(sides) == {f"{part}-bare", f"{part}-stage"}
        assert all(s["peak_mb"][0] > 0 and len(s["wall"]) == 1 for s in sides.values())
    rows = got["rows"]
    assert len(rows) == 4 and all(row["result"] in ("PASS", "FAIL") for row in rows)
    assert all(math.isfinite(row["ratio"] if "ratio" in row else row["value"]) for row in rows)
    assert "load average at end" in r.stdout and not list(tmp_path.glob("bench-filter-*"))  # its data removed

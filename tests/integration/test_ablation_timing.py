"""pipelines/ablation.py's additions for the `siglip` and `flip` recipes: an arm's `init_from` start, the step time
read from a run's metrics.jsonl (its median, its log-ratio findings shown as ratios), the paired run order of a
timed recipe, and pipelines/tiny_siglip.py's deterministic start. Each checked against a re-derivation here."""

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "pipelines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ablation = load("ablation")


def test_step_ms_is_the_median_step_time_after_the_first_row(tmp_path):
    """With log_every=1 each training row's samples_per_s is one step's rate: batch / rate is its time. The first row
    (the loader's start) is left out; evaluation rows and a line cut short by a kill are skipped."""
    rates = [1.0, 8.0, 4.0, 2.0, 16.0]  # samples/s of steps 1..5 at batch 4
    lines = [json.dumps({"step": i + 1, "itc_loss": 1.0, "samples_per_s": r}) for i, r in enumerate(rates)]
    lines.insert(3, json.dumps({"step": 3, "val": {"i2t_r1": 1.0}}))
    lines.append('{"step": 6, "itc_lo')
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # by hand: steps 2..5 take 4/8, 4/4, 4/2, 4/16 s = 500, 1000, 2000, 250 ms; the median of four is (500 + 1000) / 2
    assert ablation.step_ms(tmp_path, 4) == 750.0
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n")
    assert ablation.step_ms(tmp_path, 4) is None  # one row: nothing but the start


def timed_rows() -> list[dict]:
    """Two arms x 3 seeds with retrieval scores and step times."""
    base = {"n_eval": 10, "n_captions": 20, "chance_r1": 10.0, "i2t_r1": 30.0, "t2i_r1": 40.0}
    ms = {"p0": [200.0, 230.0, 190.0], "p05": [100.0, 110.0, 120.0]}
    return [{"arm": arm, "seed": s, **base, "i2t_r1": 30.0 + s + (arm == "p0"), "step_ms": ms[arm][s]}
            for arm in ms for s in range(3)]


def test_a_step_time_finding_is_the_log_ratio_of_the_paired_runs_shown_as_a_ratio():
    rows = timed_rows()
    finding = {"paper": "half the patches step faster", "better": "p0", "than": "p05", "metric": "log_step"}
    res = ablation.rescore({"recipe": "flip", "meta": {"command": "c", "date": "d", "steps": "3 steps"}, "rows": rows,
                            "findings": [finding]})
    ms = {(r["arm"], r["seed"]): r["step_ms"] for r in rows}
    d = [100 * (math.log(ms["p0", s]) - math.log(ms["p05", s])) for s in range(3)]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(d) / math.sqrt(3)
    (f,) = res["findings"]
    assert f["diff"] == round(statistics.fmean(d), 2)
    assert f["ci_low"] == round(statistics.fmean(d) - half, 2) and f["ci_high"] == round(statistics.fmean(d) + half, 2)
    # the geometric mean of the per-seed ratios, and its interval, as ratios of step times
    ratio = math.prod(ms["p0", s] / ms["p05", s] for s in range(3)) ** (1 / 3)
    cells = ablation.finding_cells(f)
    assert cells[1].startswith(f"{ratio:.2f}x [{math.exp(f['ci_low'] / 100):.2f}x, ")
    assert not f["near_chance"] and f["far_below"] == []  # a step time has no chance level
    assert res["arms"]["p0"]["step_ms"] == round(statistics.fmean([200.0, 230.0, 190.0]), 2)
    table = ablation.table_md(res)
    assert "| ms/step |" in table and "step time |" not in table.split("Findings")[0]  # log_step is judged, not shown
    assert "p0 − p05 (step time)" in table


def test_a_bad_step_time_in_a_results_file_is_one_line(tmp_path, capsys):
    for bad, said in ((0, "a positive number of milliseconds, not an integer 0"), ("fast", "not a string")):
        rows = timed_rows()
        rows[1]["step_ms"] = bad
        path = tmp_path / "r.json"
        path.write_text(json.dumps({"recipe": "flip", "rows": rows, "findings": []}))
        assert ablation.main(["--rescore", str(path)]) == 2
        err = capsys.readouterr().err
        assert "rows[1].step_ms: expected a positive number of milliseconds" in err and said in err
        assert len(err.strip().splitlines()) == 1


def test_a_timed_recipe_runs_the_arms_of_a_seed_one_after_the_other():
    assert ablation.run_order(["a", "b"], [0, 1], False) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert ablation.run_order(["a", "b"], [0, 1], True) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_an_arms_init_from_names_an_input_built_first_or_a_path(tmp_path):
    make = "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.mkdir(); (p / 'config.json').write_text('{{}}')"
    inputs = {"start": {"path": "{demo}/start", "build": ["{py}", "-c", make, "{path}"]}}
    recipe = {"common": {"init_from": "clip:start"},
              "arms": {"a": {"data": ["d"]}, "b": {"data": ["d"], "init_from": "{demo}/ckpt.pt"}, "c": None}}
    logs = tmp_path / "logs"
    assert ablation.arm_init(recipe, "a", inputs, tmp_path, logs) == f"clip:{tmp_path / 'start'}"
    assert (tmp_path / "start" / "config.json").is_file()  # built, and a model folder counts as present from now on
    assert ablation._present(tmp_path / "start")
    with pytest.raises(ablation.RecipeError, match=r"arm b: init_from \{demo\}/ckpt.pt: .*ckpt.pt does not exist"):
        ablation.arm_init(recipe, "b", inputs, tmp_path, logs)
    (tmp_path / "ckpt.pt").write_bytes(b"")
    assert ablation.arm_init(recipe, "b", inputs, tmp_path, logs) == str(tmp_path / "ckpt.pt")
    assert ablation.arm_init({"arms": {"a": {}}}, "a", inputs, tmp_path, logs) is None  # from scratch
    with pytest.raises(ablation.RecipeError, match="init_from must be clip:NAME or a checkpoint path, not an integer"):
        ablation.arm_init({"arms": {"a": {"init_from": 3}}}, "a", inputs, tmp_path, logs)


@pytest.mark.slow  # two SentencePiece trainings and SigLIP builds: ~15 s on a busy 2-core machine
def test_tiny_siglip_is_the_same_start_every_build_and_reads_as_a_clip_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from vltrain import hfclip

    tiny = load("tiny_siglip")
    shards = tmp_path / "shards"
    shards.mkdir()
    words = "red dog cat tree house boat sky car bird flower sun star moon fish".split()
    caps = [" ".join(words[(i * 3 + j) % len(words)] for j in range(2 + i % 4)) for i in range(200)]
    pq.write_table(pa.table({"caption": caps}), shards / "shard-000000.parquet")
    a = tmp_path / "a" / "m"
    b = tmp_path / "b" / "m"
    for out in (a, b):
        assert tiny.main([str(out), "--captions", str(shards), "--size", "32", "--seed", "3"]) == 0
        assert not out.with_name("m.tmp").exists()
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
    assert (a / "spiece.vocab").read_text() == (b / "spiece.vocab").read_text()
    assert float(wa["logit_scale"]) == pytest.approx(math.log(10), abs=1e-6)  # SigLIP's t' = log 10, b = -10
    assert float(wa["logit_bias"]) == -10.0
    source = hfclip.init_source(f"clip:{a}")
    assert source["config"]["model"]["embed_dim"] == tiny.WIDTH
    assert tiny.main([str(tmp_path / "c"), "--captions", str(shards), "--size", "30"]) == 2  # not whole patches

"""pipelines/ablation.py: every recipe is well-formed, the verdict rule, and a whole recipe run on tiny models."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.vltrain.test_samplers import N_VAL, TINY, onto  # noqa: F401  (the module-scoped TOnICS dataset fixture)

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ablation", ROOT / "pipelines" / "ablation.py")
ablation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablation)


def test_every_recipe_names_real_arms_inputs_and_config_keys():
    inputs = ablation.load_inputs()
    for name, item in inputs.items():
        assert set(item.get("needs", [])) <= set(inputs), name
    paths = ablation.recipe_paths()
    assert {p.stem for p in paths} == {"fistful", "fistful-pseudo", "tonics", "grit", "softmask", "combined",
                                       "clipscore", "siglip", "flip"}
    for path in paths:
        recipe = ablation.load_recipe(path)
        assert recipe["about"] and recipe["findings"], path
        for arm, spec_ in recipe["arms"].items():
            assert spec_["data"] and set(spec_["data"]) <= set(inputs), (path, arm)
            cfg = ablation.arm_config(recipe, arm, 0, ["x"], Path("/tmp/out"), None, Path("/demo"))
            assert cfg.steps == recipe["common"]["steps"] and cfg.seed == 0  # every key of every arm is valid
        for key in ("retrieval", "zeroshot"):
            ref = recipe["eval"].get(key, "heldout")
            assert ref == "heldout" or ref in inputs, (path, key)


def test_a_recipe_naming_an_unknown_arm_or_metric_is_refused(tmp_path):
    base = {"about": "x", "eval": {"retrieval": "heldout"}, "arms": {"a": {"data": ["d"]}, "b": {"data": ["d"]}}}
    for bad, msg in (({"findings": [{"paper": "p", "better": "a", "than": "c", "metric": "i2t_r1"}]}, "names arm 'c'"),
                     ({"findings": [{"paper": "p", "better": "a", "than": "b", "metric": "r1"}]}, "metric must be"),
                     ({"quick": {"arms": ["z"]}}, "quick arm 'z'")):
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({**base, **bad}))
        with pytest.raises(ablation.RecipeError, match=msg):
            ablation.load_recipe(path)


verdicts = ablation.verdicts  # pipelines/verdicts.py, as ablation.py imports it

T_975 = {2: 4.302652729749464, 4: 2.7764451051977987}  # Student t quantiles (0.975; df), from printed tables


def _rows(diffs_by_arm: dict) -> list[dict]:
    return [{"arm": arm, "seed": s, "m": v} for arm, vals in diffs_by_arm.items() for s, v in enumerate(vals)]


def test_paired_t_interval_and_p_value_match_the_textbook_formulas():
    d = [1.5, 2.0, 4.1]
    mean = sum(d) / 3
    sd = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5
    got = verdicts.t_interval(d)
    want = (mean, mean - T_975[2] * sd / 3 ** 0.5, mean + T_975[2] * sd / 3 ** 0.5)
    assert got == pytest.approx(want, rel=1e-9)  # float64 arithmetic on five numbers
    # p = 0.05 exactly where the 95% interval touches the null
    assert verdicts.t_pvalue(d, want[1]) == pytest.approx(0.05, rel=1e-7)
    assert verdicts.t_interval([3.0])[1:] == (float("-inf"), float("inf")) and verdicts.t_pvalue([3.0]) == 1.0
    diffs, seeds, missing = verdicts.paired_differences(
        [{"arm": "b", "seed": 0, "m": 5}, {"arm": "b", "seed": 1, "m": 6}, {"arm": "b", "seed": 2, "m": 1},
         {"arm": "c", "seed": 1, "m": 2}, {"arm": "c", "seed": 2, "m": 3}, {"arm": "c", "seed": 3, "m": 9}], "b", "c", "m")
    assert (diffs, seeds, missing) == ([4, -2], [1, 2], [0, 3])  # pairs by seed; unpaired seeds are named


def test_holm_adjustment_on_a_worked_example():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> monotone: 0.02, 0.03, 0.06, 0.06
    assert verdicts.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert verdicts.holm([0.5, 0.9]) == [1.0, 1.0]


def test_each_verdict_from_constructed_differences():
    f = lambda paper_effect: [{"paper": "p", "better": "b", "than": "c", "metric": "m",  # noqa: E731
                               "paper_effect": paper_effect}]
    c = [0.0] * 5
    # the differences are b's values: a tight cluster far from 0 on the paper's side, on the other side, near 0
    (v,) = verdicts.judge(f(2.0), _rows({"b": [2.0, 2.1, 1.9, 2.05, 1.95], "c": c}))
    assert v["verdict"] == "agrees" and v["ci_low"] > 0 and v["diff"] == 2.0 and v["n_seeds"] == 5
    (v,) = verdicts.judge(f(2.0), _rows({"b": [-2.0, -2.1, -1.9, -2.05, -1.95], "c": c}))
    assert v["verdict"] == "disagrees"
    (v,) = verdicts.judge(f(-0.3), _rows({"b": [-2.0, -2.1, -1.9, -2.05, -1.95], "c": c}))
    assert v["verdict"] == verdicts.LARGER  # a negative paper effect: its side is below zero, and -2 is beyond it
    (v,) = verdicts.judge(f(-2.0), _rows({"b": [-2.0, -2.1, -1.9, -2.05, -1.95], "c": c}))
    assert v["verdict"] == "agrees"
    (v,) = verdicts.judge(f(5.0), _rows({"b": [0.1, -0.1, 0.2, -0.2, 0.0], "c": c}))
    assert v["verdict"] == "rules out the paper's effect" and v["ci_high"] < 5.0
    (v,) = verdicts.judge(f(5.0), _rows({"b": [3.0, -2.0, 8.0, -1.0, 2.0], "c": c}))
    assert v["verdict"] == "inconclusive" and v["seeds_needed"] > 5
    (v,) = verdicts.judge(f(None), _rows({"b": [2.0, 2.1, 1.9, 2.05, 1.95], "c": c}))
    assert v["verdict"] == "agrees" and "p_paper" not in v and v["seeds_needed"] is None  # ours: predicts b > c
    (v,) = verdicts.judge(f(2.0), _rows({"b": [9.0], "c": [0.0]}))
    assert v["verdict"] == "inconclusive" and v["ci_low"] is None  # one seed decides nothing


def test_holm_makes_a_lone_significant_finding_inconclusive_among_many_tests():
    rows = _rows({"b": [1.0, 0.2, 1.5, 0.4, 0.9], "c": [0.0] * 5})
    lone = verdicts.judge([{"paper": "p", "better": "b", "than": "c", "metric": "m", "paper_effect": None}], rows)
    assert lone[0]["verdict"] == "agrees" and 0.005 < verdicts.t_pvalue([1.0, 0.2, 1.5, 0.4, 0.9]) < 0.05
    many = verdicts.judge([{"paper": "p", "better": "b", "than": "c", "metric": "m", "paper_effect": None}] * 10, rows)
    assert {f["verdict"] for f in many} == {"inconclusive"}  # 10 tests: each needs p < 0.005 at the first step


def _simulate(true_effect: float, paper_effect, n: int, reps: int, k: int = 1, seed: int = 0,
              margin: float | None = None) -> list[list[str]]:
    """Verdicts of `reps` simulated recipes: k findings (tie claims within ±margin when one is given), each with n
    seeds of differences ~ N(true_effect, 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(reps):
        diffs = rng.normal(true_effect, 1.0, size=(k, n))
        rows = [{"arm": f"b{j}", "seed": s, "m": float(diffs[j, s])} for j in range(k) for s in range(n)]
        rows += [{"arm": f"c{j}", "seed": s, "m": 0.0} for j in range(k) for s in range(n)]
        found = [{"paper": "p", "better": f"b{j}", "than": f"c{j}", "metric": "m", "paper_effect": paper_effect,
                  **({} if margin is None else {"tie_margin": margin})} for j in range(k)]
        out.append([f["verdict"] for f in verdicts.judge(found, rows)])
    return out


def test_simulated_error_rates_stay_at_the_stated_level_and_power_rises_with_seeds(monkeypatch):
    monkeypatch.setattr(verdicts, "seeds_needed", lambda *a, **k: None)  # not what is simulated here; slow
    reps = 1500
    margin = 3 * (0.05 * 0.95 / reps) ** 0.5  # three binomial sds of a 5% rate over `reps` draws
    # no true effect: a verdict on either side of 0 is false, at most 5% of recipes (exact t test, Holm)
    side = ("agrees", verdicts.SMALLER, verdicts.LARGER, "disagrees")
    for n in (3, 10):
        null = _simulate(0.0, 2.0, n, reps, seed=n)
        assert sum(v[0] in side for v in null) / reps <= 0.05 + margin
    # a tie claim whose true difference sits on its margin: "equivalent" is false, at most 5%
    at_margin = _simulate(1.0, 0.0, 5, reps, seed=4, margin=1.0)
    assert sum(v[0].startswith("equivalent") for v in at_margin) / reps <= 0.05 + margin
    # the true effect equals the paper's: "rules out" or "disagrees" is false, at most 5%
    same = _simulate(1.0, 1.0, 5, reps, seed=1)
    wrong = ("rules out the paper's effect", "disagrees", verdicts.SMALLER, verdicts.LARGER)  # the true size rejected
    assert sum(v[0] in wrong for v in same) / reps <= 0.05 + margin
    # family-wise: five null findings in one recipe, any false side verdict in at most 5% of recipes
    family = _simulate(0.0, None, 3, reps, k=5, seed=2)
    assert sum(any(x != "inconclusive" for x in v) for v in family) / reps <= 0.05 + margin
    # a true effect of one sd (the paper's size): "agrees" grows with the seeds, unlike the old sd-overlap rule
    power = [sum(v[0] == "agrees" for v in _simulate(1.0, 1.0, n, 400, seed=10 + n)) / 400 for n in (3, 6, 12, 24)]
    assert power == sorted(power) and power[0] < 0.2 and power[-1] > 0.9


def test_seeds_needed_gives_the_power_it_promises():
    n = verdicts.seeds_needed(1.0, 1.0, 0.05)
    # the normal approximation ((z_0.975 + z_0.8) sd / effect)^2 = 7.85 is a lower bound for the t test
    assert 8 <= n <= 12
    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(2000):
        d = rng.normal(1.0, 1.0, n)
        hits += verdicts.t_pvalue(list(d)) < 0.05
    assert hits / 2000 >= 0.8 - 3 * (0.8 * 0.2 / 2000) ** 0.5
    assert verdicts.seeds_needed(2.0, 0.01, 0.05) == verdicts.MAX_SEEDS + 1
    assert verdicts.seeds_needed(0.0, 1.0, 0.05) == 2 and verdicts.seeds_needed(1.0, 0.0, 0.05) is None


def test_rescore_recomputes_findings_table_and_chart_from_rows_alone(tmp_path, capsys):
    rows = [{"arm": a, "seed": s, "i2t_r1": v, "t2i_r1": v + 1, "mean_recall": v, "n_eval": 500, "n_captions": 900,
             "chance_r1": 0.2, "step": 10}
            for a, vals in (("a", [10.0, 12.0, 11.0]), ("b", [14.0, 15.5, 14.2]), ("c", [9.0, 11.0])) for s, v in
            enumerate(vals)]
    path = tmp_path / "grit.json"
    path.write_text(json.dumps({"recipe": "grit", "meta": {"command": "make ablation RECIPE=grit", "date": "d",
                                                           "steps": "10 steps", "paper": "GRIT"}, "rows": rows,
                                "findings": [{"paper": "b beats a", "better": "b", "than": "a", "metric": "r1_mean",
                                              "paper_effect": 3.3, "verdict": "stale"},
                                             {"paper": "c beats a", "better": "c", "than": "a",
                                              "metric": "i2t_r1", "paper_effect": None}]}))
    assert ablation.main(["--rescore", str(path)]) == 0
    res = json.loads(path.read_text())
    b_a = [14.0 - 10.0, 15.5 - 12.0, 14.2 - 11.0]  # r1_mean = (TR@1 + IR@1) / 2 = v + 0.5 for both arms
    mean, lo, hi = verdicts.t_interval(b_a)
    (f1, f2) = res["findings"]
    assert (f1["diff"], f1["ci_low"], f1["ci_high"]) == (round(mean, 2), round(lo, 2), round(hi, 2))
    assert f1["verdict"] in verdicts.VERDICTS and f1["verdict"] != "stale" and f1["paper_effect"] == 3.3
    assert f2["n_seeds"] == 2 and f2["missing_seeds"] == [2]
    assert res["rows"][0]["r1_mean"] == 10.5 and res["eval"]["retrieval_captions"] == 900
    table = (tmp_path / "grit.md").read_text()
    assert "| b beats a | b − a (mean R@1) | +3.30 |" in table and "seed(s) 2 missing in one arm" in table
    assert (tmp_path / "grit.png").stat().st_size > 5000
    first = path.read_text()
    assert ablation.main(["--rescore", str(path)]) == 0 and path.read_text() == first  # a fixed point
    path.write_text("{}")
    assert ablation.main(["--rescore", str(path)]) == 2
    assert "cannot rescore" in capsys.readouterr().err


def test_a_finding_whose_arms_both_sit_near_chance_is_flagged_but_keeps_its_verdict():
    """The SoftMask++ recipe at 80 steps: R@1 of 0.1-0.3 against a chance of 0.08 gives tight intervals that exclude
    the paper's +2 points. The verdict stays the test's; the table says both arms are on the floor."""
    chance = 0.08
    floor = {"a": [0.17, 0.08, 0.25], "b": [0.25, 0.17, 0.17]}  # 2.1x and 2.5x chance
    high = {"a": [0.17, 0.08, 0.25], "c": [0.25, 0.30, 0.26]}  # c is at 3.5x chance: not both on the floor
    rows = [{"arm": a, "seed": s, "i2t_r1": v, "t2i_r1": v, "mean_recall": 16 / 3 * v, "chance_r1": chance,
             "zeroshot": 30.0 + s + (a == "b"), "zeroshot_chance": 8.33, "n_eval": 1198, "n_captions": 2499}
            for arms in (floor, {"c": high["c"]}) for a, vals in arms.items() for s, v in enumerate(vals)]
    defs = [{"paper": "b helps", "better": "b", "than": "a", "metric": m, "paper_effect": 2.0}
            for m in ("i2t_r1", "r1_mean", "mean_recall", "zeroshot")]
    defs.append({"paper": "c helps", "better": "c", "than": "a", "metric": "i2t_r1", "paper_effect": 2.0})
    res = ablation.rescore({"recipe": "x", "meta": {"command": "c", "date": "d", "steps": "80 steps"}, "rows": rows,
                            "findings": defs})
    # the mean over seeds against NEAR_CHANCE x chance, re-derived: a 0.167 and b 0.197 against 0.24 on R@1; mean R's
    # chance is the mean of R@1, 5, 10 (16/3 R@1's); zero-shot is at 31-32% against 8.33%, far off the floor
    assert [f["near_chance"] for f in res["findings"]] == [True, True, True, False, False]
    assert res["findings"][0]["verdict"] == "rules out the paper's effect"  # +0.03 [-0.21, +0.27] excludes +2
    table = ablation.table_md(res)
    assert table.count("(both arms under 3x chance)") == 3


def test_seeds_option_is_a_count_or_a_list():
    assert ablation.parse_seeds("3", 1) == [0, 1, 2]
    assert ablation.parse_seeds("4,7", 1) == [4, 7]
    assert ablation.parse_seeds(None, 2) == [0, 1] and ablation.parse_seeds(None, [5]) == [5]
    assert ablation.parse_seeds("0,", 3) == [0]  # seed 0 alone
    for bad in ("x", "0", ","):  # "0" is a count of no seeds, not seed 0: refused, never an empty table
        with pytest.raises(ablation.RecipeError, match="a count"):
            ablation.parse_seeds(bad, 1)


def test_a_recipe_runs_every_arm_over_seeds_and_writes_its_table(onto, tmp_path, monkeypatch):
    """Two arms x two seeds of tiny models on the TOnICS fixture, scored on their own held-out split: per-seed rows,
    mean and sd re-derived here, a verdict, table.md, chart.png; a second run reuses every finished run."""
    recipe = {
        "about": "test", "eval": {"retrieval": "heldout"}, "seeds": 2,
        "common": {"preset": "albef-base", "steps": 2, "batch_size": 4,
                   "set": {**{k: yaml.safe_load(v) for k, v in (s.split("=") for s in TINY)},
                           "model.fusion_layers": 1, "sampler.ontology": "", "loss.mlm": 0.0}},
        "arms": {"random": {"data": [str(onto)]},
                 "tonics": {"data": [str(onto)], "sampler": "tonics", "set": {"sampler.refresh_every": 1}}},
        "findings": [{"paper": "curriculum helps", "better": "tonics", "than": "random", "metric": "mean_recall",
                      "paper_effect": 1.0}],
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = tmp_path / "abl"
    assert ablation.main([str(path), "--out", str(out), "--demo", str(tmp_path)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in res["rows"]] == [("random", 0), ("random", 1), ("tonics", 0), ("tonics", 1)]
    # the recipe's seeds were recorded before the first arm ran, and the table says they are the declared ones
    assert json.loads((out / "plan.json").read_text())["seeds"] == [0, 1]
    assert res["meta"]["seed_plan"]["status"] == "as declared"
    assert "seeds 0, 1, declared before the run" in (out / "table.md").read_text()
    # the random arm scores the whole held-out split; with pairs, TOnICS leaves out the images its check reads
    assert [r["n_eval"] for r in res["rows"]] == [N_VAL, N_VAL, N_VAL - N_VAL // 2, N_VAL - N_VAL // 2]
    vals = [json.loads((out / "tonics" / f"s{s}" / "result.json").read_text())["eval"]["t2i_r5"] for s in (0, 1)]
    assert res["arms"]["tonics"]["t2i_r5"] == round(statistics.fmean(vals), 2)
    assert res["arms"]["tonics"]["t2i_r5_sd"] == round(statistics.stdev(vals), 2)
    (finding,) = res["findings"]
    diffs = [next(r["mean_recall"] for r in res["rows"] if (r["arm"], r["seed"]) == ("tonics", s))
             - next(r["mean_recall"] for r in res["rows"] if (r["arm"], r["seed"]) == ("random", s)) for s in (0, 1)]
    assert finding["diff"] == round(statistics.fmean(diffs), 2) and finding["verdict"] in verdicts.VERDICTS
    table = (out / "table.md").read_text()
    assert "| tonics |" in table and "curriculum helps" in table and finding["verdict"] in table
    assert (out / "chart.png").stat().st_size > 5000
    assert (out / "tonics" / "s1" / "curriculum.json").exists()
    import torch

    assert not (out / "random" / "s0" / "best.pt").exists()  # a finished run keeps a slim last.pt only
    assert "optimizer" not in torch.load(out / "random" / "s0" / "last.pt", weights_only=True)
    stamp = (out / "random" / "s0" / "last.pt").stat().st_mtime_ns
    assert ablation.main([str(path), "--out", str(out), "--demo", str(tmp_path)]) == 0
    assert (out / "random" / "s0" / "last.pt").stat().st_mtime_ns == stamp  # reused, not retrained
    # a third seed added after that look: the same OUT says so
    assert ablation.main([str(path), "--out", str(out), "--demo", str(tmp_path), "--seeds", "3"]) == 0
    assert json.loads((out / "results.json").read_text())["meta"]["seed_plan"]["status"] == "extended after a look"
    assert "seeds 0, 1, 2: extended after a look (declared 0, 1 on" in (out / "table.md").read_text()
    # Rebuilt inputs (other keys or captions: another data signature) train the finished runs again.
    monkeypatch.setattr(ablation, "data_signature", lambda folders: "rebuilt")
    assert ablation.main([str(path), "--out", str(out), "--demo", str(tmp_path), "--arms", "random"]) == 0
    assert (out / "random" / "s0" / "last.pt").stat().st_mtime_ns != stamp


def test_missing_data_and_unknown_arms_are_one_line_errors(tmp_path, capsys):
    recipe = {"about": "t", "eval": {"retrieval": "heldout"}, "arms": {"a": {"data": [str(tmp_path / "nope")]}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert ablation.main([str(path), "--out", str(tmp_path / "o")]) == 2
    assert "not a shard dataset" in capsys.readouterr().err
    assert ablation.main([str(path), "--arms", "zz"]) == 2
    assert "unknown arm(s) zz" in capsys.readouterr().err
    assert ablation.main(["--list"]) == 0
    assert "fistful-pseudo" in capsys.readouterr().out


def test_scores_are_redone_when_an_eval_set_is_rebuilt(tmp_path):
    """scores.json is keyed by the eval sets' contents: a rebuilt eval set (other sidecar bytes) is scored again."""
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "sizes.json").write_text('{"a.tar": 2}')
    (ev / "a.tar").write_bytes(b"")
    (ev / "a.parquet").write_bytes(b"one")
    before = ablation.data_signature([ev])
    assert ablation.data_signature([ev]) == before
    (ev / "a.parquet").write_bytes(b"two")
    assert ablation.data_signature([ev]) != before


def test_an_input_is_built_again_when_the_files_its_build_reads_change(tmp_path):
    """inputs.yaml `reads`: a built input is reused while the files it was built from keep their contents, and
    built again when they change (a later `make demo` rebuilt the held-out tables, say)."""
    src, dst, logs = tmp_path / "in.txt", tmp_path / "out.txt", tmp_path / "logs"
    src.write_text("one")
    copy = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
    inputs = {"made": {"path": "{demo}/out.txt", "reads": ["{demo}/in.txt"],
                       "build": ["{py}", "-c", copy, "{demo}/in.txt", "{path}"]}}
    assert ablation.ensure("made", inputs, tmp_path, logs) == dst and dst.read_text() == "one"
    built = dst.stat().st_mtime_ns
    ablation.ensure("made", inputs, tmp_path, logs)
    assert dst.stat().st_mtime_ns == built  # same contents read: reused
    src.write_text("two")
    ablation.ensure("made", inputs, tmp_path, logs)
    assert dst.read_text() == "two"


def test_bad_seeds_and_steps_are_refused_in_one_line_before_anything_is_built(tmp_path, capsys):
    """Before: --seeds -1 ran a seed -1, and --steps 0 silently meant the recipe's steps; --steps -5 went on too."""
    recipe = {"about": "t", "eval": {"retrieval": "heldout"}, "arms": {"a": {"data": [str(tmp_path / "nope")]}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    for args, says in ((["--seeds", "-1"], "--seeds '-1': seeds are at least 0"),
                       (["--seeds", "2,-3"], "--seeds '2,-3': seeds are at least 0"),
                       (["--steps", "0"], "--steps 0: give at least 1 (or leave it out for the recipe's steps)"),
                       (["--steps", "-5"], "--steps -5: give at least 1 (or leave it out for the recipe's steps)")):
        assert ablation.main([str(path), "--demo", str(tmp_path / "demo"), *args]) == 2
        assert capsys.readouterr().err.strip() == f"error: {says}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # no demo folder, no results
    with pytest.raises(ablation.RecipeError, match="seeds are at least 0"):
        ablation.parse_seeds("-1", 1)


def rescore_rows() -> dict:
    """A small valid results file: arms a and b, seeds 0-2, one finding."""
    rows = [{"arm": a, "seed": s, "i2t_r1": 10.0 + s + 2 * (a == "b"), "t2i_r1": 11.0, "mean_recall": 20.0,
             "n_eval": 100, "chance_r1": 1.0, "step": 5} for a in "ab" for s in range(3)]
    return {"recipe": "x", "meta": {"command": "c", "date": "d", "steps": "5 steps"}, "rows": rows,
            "findings": [{"paper": "b beats a", "better": "b", "than": "a", "metric": "i2t_r1", "paper_effect": 1.0}]}


def rescore_cli(path) -> subprocess.CompletedProcess:
    """--rescore in a child process: a read that blocks fails the test on the timeout instead of hanging it."""
    return subprocess.run([sys.executable, str(ROOT / "pipelines" / "ablation.py"), "--rescore", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"})


def test_rescore_of_a_fifo_or_a_device_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    cases = ((tmp_path / "fifo.json", "a FIFO"), (Path("/dev/zero"), "a character device"), (tmp_path, "a folder"))
    # the three child processes run side by side (each pays the script's imports); each still has its own timeout
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(rescore_cli, [path for path, _ in cases]))
    for (path, kind), r in zip(cases, results):
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"error: {path}: cannot rescore (the results file: {kind}, not a regular file)"], r.stderr


@pytest.mark.parametrize("mutate, said", [
    (lambda d: d["rows"][1].update(seed="1"), "rows[1].seed: expected an integer in [0, 4294967295], not a string '1'"),
    (lambda d: d["rows"][1].update(seed=True), "rows[1].seed: expected an integer in [0, 4294967295], not true"),
    (lambda d: d["rows"][0].update(arm=["a"]), "rows[0].arm: expected a string, not an array ['a']"),
    (lambda d: d["rows"][2].update(i2t_r1="12.5"), "rows[2].i2t_r1: expected a percentage in [0, 100], not a string "
                                                   "'12.5'"),
    (lambda d: d["rows"][2].update(t2i_r1=1e308), "rows[2].t2i_r1: expected a percentage in [0, 100], not a number "
                                                  "1e+308"),
    (lambda d: d["rows"][2].update(n_eval="100"), "rows[2].n_eval: expected a count (an integer >= 0), not a string "
                                                  "'100'"),
    (lambda d: d["rows"].append(5), "rows[6]: expected an object, not an integer 5"),
    (lambda d: d.update(rows={"a": 1}), "rows: expected an array, not an object {'a': 1}"),
    (lambda d: d.update(findings="b beats a"), "findings: expected an array, not a string 'b beats a'"),
    (lambda d: d["findings"][0].update(better=["b"]), "findings[0].better: expected a string, not an array ['b']"),
    (lambda d: d["findings"][0].update(paper_effect="1.0"),
     "findings[0].paper_effect: expected a finite number or null, not a string '1.0'"),
    (lambda d: d.update(meta=["c"]), "meta: expected an object, not an array ['c']"),
    # every row seed 0: n_seeds 1 for the finding while each arm's summary averaged three rows
    (lambda d: [r.update(seed=0) for r in d["rows"]], "rows[1]: arm 'a' seed 0 has a row already; one row per arm "
                                                      "and seed"),
])
def test_rescore_refuses_rows_and_findings_of_the_wrong_types_in_one_line(tmp_path, capsys, mutate, said):
    data = rescore_rows()
    mutate(data)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert ablation.main(["--rescore", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {path}: cannot rescore ({said})"]
    assert json.loads(path.read_text()) == data and not (tmp_path / "r.md").exists()


@pytest.mark.parametrize("content, said", [
    (json.dumps(rescore_rows()).encode().replace(b'"c"', b'"caf\xe9"'), "not UTF-8 text (byte 0xe9 at offset "),
    (b"[" * 200_000 + b"]" * 200_000, "malformed JSON: nested too deeply"),
    (b'{"rows": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "malformed JSON: nested too deeply"),
    (b'{"rows": [{"arm": "a", "seed": ' + b"9" * 5000 + b"}]}", "malformed JSON: Exceeds the limit (4300 digits) "
     "for integer string conversion: value has 5000 digits)"),
])
def test_rescore_of_non_utf8_or_deeply_nested_json_is_one_line(tmp_path, capsys, content, said):
    path = tmp_path / "r.json"
    path.write_bytes(content)
    assert ablation.main(["--rescore", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: cannot rescore ({said}")


def test_rescore_of_a_valid_file_still_works_and_duplicate_seeds_or_arms_are_refused_up_front(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rescore_rows()))
    assert ablation.main(["--rescore", str(path)]) == 0
    assert json.loads(path.read_text())["findings"][0]["n_seeds"] == 3
    with pytest.raises(ablation.RecipeError, match=r"^--seeds '1,1': seed 1 is given twice$"):
        ablation.parse_seeds("1,1", 3)
    assert ablation.main(["grit", "--arms", "grit,grit", "--demo", str(tmp_path / "nodemo")]) == 2
    assert "an arm is named twice" in capsys.readouterr().err


def test_rescore_with_update_findings_judges_the_rows_against_the_recipes_current_findings(tmp_path, capsys):
    """A results file keeps the findings it was judged by; --update-findings takes the recipe's current ones (a tie
    margin, the paper's baselines) and judges the same rows against them."""
    old = json.loads((ablation.ROOT / "pipelines" / "results" / "fistful.json").read_text())
    old["findings"] = [{k: f[k] for k in ("paper", "better", "than", "metric", "paper_effect")}
                       for f in old["findings"]]
    path = tmp_path / "fistful.json"
    path.write_text(json.dumps(old))
    assert ablation.main(["--rescore", str(path)]) == 0
    kept = json.loads(path.read_text())["findings"]
    assert all("tie_margin" not in f and f["shares"]["paper"] is None for f in kept)
    assert ablation.main(["--rescore", str(path), "--update-findings"]) == 0
    new = json.loads(path.read_text())
    recipe = ablation.load_recipe(ablation.HERE / "fistful.yaml")
    assert [ablation.definition(f) for f in new["findings"]] == [ablation.definition(f) for f in recipe["findings"]]
    assert new["rows"] == [ablation.derive(dict(r)) for r in old["rows"]]
    tie = new["findings"][0]
    assert tie["tie_margin"] == 1.0 and "p_equiv" in tie and "p_zero" not in tie
    assert "tie within ±1" in (tmp_path / "fistful.md").read_text()
    capsys.readouterr()
    assert ablation.main(["--update-findings"]) == 2
    assert "goes with --rescore" in capsys.readouterr().err
    path.write_text(json.dumps({**old, "recipe": "nope"}))
    assert ablation.main(["--rescore", str(path), "--update-findings"]) == 2
    assert "is not one of pipelines/*.yaml" in capsys.readouterr().err

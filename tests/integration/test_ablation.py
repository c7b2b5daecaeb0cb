"""pipelines/ablation.py: every recipe is well-formed, the verdict rule, and a whole recipe run on tiny models."""

import importlib.util
import json
import statistics
from pathlib import Path

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
    assert {p.stem for p in paths} == {"fistful", "fistful-pseudo", "tonics", "grit", "softmask", "combined"}
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


def test_verdict_compares_mean_plus_minus_sd_intervals():
    def arm(mean, sd, seeds=3):
        return {"seeds": seeds, "zeroshot": mean, "zeroshot_sd": sd}

    assert ablation.verdict(arm(30, 1), arm(27, 1), "zeroshot") == "reproduced"       # 29..31 above 26..28
    assert ablation.verdict(arm(27, 1), arm(30, 1), "zeroshot") == "not reproduced"   # wholly below
    assert ablation.verdict(arm(30, 1), arm(28.5, 1), "zeroshot") == "inconclusive"   # 29..31 meets 27.5..29.5
    assert ablation.verdict(arm(30, 0, 1), arm(20, 0, 1), "zeroshot") == "inconclusive"  # one seed: no spread
    assert ablation.verdict(arm(30, 1), {"seeds": 3}, "zeroshot") == "inconclusive"   # metric not measured


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
        "findings": [{"paper": "curriculum helps", "better": "tonics", "than": "random", "metric": "mean_recall"}],
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = tmp_path / "abl"
    assert ablation.main([str(path), "--out", str(out), "--demo", str(tmp_path)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in res["rows"]] == [("random", 0), ("random", 1), ("tonics", 0), ("tonics", 1)]
    assert all(r["n_eval"] == N_VAL for r in res["rows"])  # one held-out split for every arm
    vals = [json.loads((out / "tonics" / f"s{s}" / "result.json").read_text())["eval"]["t2i_r5"] for s in (0, 1)]
    assert res["arms"]["tonics"]["t2i_r5"] == round(statistics.fmean(vals), 2)
    assert res["arms"]["tonics"]["t2i_r5_sd"] == round(statistics.stdev(vals), 2)
    (finding,) = res["findings"]
    assert finding["verdict"] == ablation.verdict(res["arms"]["tonics"], res["arms"]["random"], "mean_recall")
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

"""The demo pipeline on real data: Debian's openclipart, a 150-image subset (`make test` installs it as root)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlprep.dataset import iter_samples, open_dataset

ROOT = Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("ablation", ROOT / "pipelines" / "ablation.py")
ablation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablation)
# The recipes' held-out sets at smoke size (pipelines/inputs.yaml builds 1,200 retrieval images and up to 200 a class
# for zero-shot, about 3 minutes of `vlprep shards` + `features`): the same build commands, fewer images.
SMALL_SETS = {"--size 1200": "--size 40", '--per-class, "200"': '--per-class, "3"'}
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/usr/share/openclipart/svg").is_dir(),
                       reason="openclipart-svg/png not installed (scripts/apt-deps.sh installs them as root)"),
]


def test_run_sh_on_a_subset(tmp_path, capfd):
    """run.sh at smoke size, then a resume run and the quick ablation on its folder.

    Sizes: one training step per run (the checks are about what each stage writes, not what training learns) and
    BATCH=1, which runs pseudolabel with the `features` calls after it, and the comparison's 3 trainings and 8 evals,
    in one Python process each instead of 12 (inprocess.py: the same commands, outputs bit for bit the same; the
    torch start-up of each call was most of the test's time). The ablation trains 1 step (`--steps 1`) instead of
    the quick recipe's 6: its checks are the arms, the held-out sets scored and the table."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PY": sys.executable, "VLPREP": str(bindir / "vlprep"), "OUT": str(tmp_path), "LIMIT": "150",
           "VLTRAIN": str(bindir / "vltrain"), "TRAIN_STEPS": "1", "UNALIGNED": "12", "EVAL": "10", "CROPS": "2",
           "SEEDS": "0 1", "ZEROSHOT_PER_CLASS": "2", "BATCH": "1"}
    r = subprocess.run(["bash", str(ROOT / "examples/openclipart/run.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ds = open_dataset(tmp_path / "shards")
    report = json.loads((tmp_path / "shards" / "report.json").read_text())
    assert report["samples_in"] == 150 and ds.num_samples == report["written"] >= 145
    s = next(iter(iter_samples(ds)))
    assert s["txt"] and "png" in s and min(s["json"]["width"], s["json"]["height"]) <= 256
    stats = json.loads((tmp_path / "shards" / "stats" / "report.json").read_text())
    assert stats["samples"] == ds.num_samples and stats["vocabulary_size"] > 100
    bow = json.loads((tmp_path / "bow" / "report.json").read_text())
    assert 0 < bow["written"] <= ds.num_samples and bow["avg_words_after"] < bow["avg_words_before"]
    onto = json.loads((tmp_path / "onto" / "ontology.json").read_text())
    assert onto["root"]["instances"] == ds.num_samples and (tmp_path / "onto" / "triplets.parquet").exists()
    assert json.loads((tmp_path / "det" / "report.json").read_text())["samples"] == ds.num_samples
    feat = json.loads((tmp_path / "bow-feat" / "meta.json").read_text())["features"]
    assert feat["encoder"] == "efficientnet-lite0" and (feat["tokens"], feat["dim"]) == (49, 1280)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert "i2t_r1" in json.dumps(result) and (tmp_path / "learning_curve.png").stat().st_size > 1000
    ck = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["config"]
    assert ck["data"]["input"] == "features" and ck["model"]["feature_encoder"] == feat
    pseudo = json.loads((tmp_path / "pseudo" / "report.json").read_text())
    n_un = open_dataset(tmp_path / "unaligned").num_samples
    assert 10 <= n_un <= 12 and pseudo["samples_in"] == n_un == pseudo["written"] + pseudo["dropped_no_words"]
    assert pseudo["index"]["vectors"] == bow["written"] and (tmp_path / "pseudo" / "pseudo_grid.png").exists()
    assert next(iter(iter_samples(tmp_path / "pseudo")))["json"]["pseudo"] is True
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "bow + pseudo" in r.stdout and set(summary["arms"]) == {"bow only", "bow + pseudo"}
    for arm in ("bow", "pseudo"):
        evals = [json.loads((tmp_path / "cmp" / f"{arm}-s{s}" / "eval-heldout.json").read_text()) for s in (0, 1)]
        assert all(e["input"] == "features" and e["n_samples"] == summary["n_pairs"] for e in evals)
        name = "bow only" if arm == "bow" else "bow + pseudo"
        vals = [e["retrieval"]["i2t_r1"] for e in evals]
        assert summary["arms"][name]["i2t_r1"]["values"] == vals
        assert summary["arms"][name]["i2t_r1"]["mean"] == round(sum(vals) / 2, 2)
    # a second run resumes every stage checked below; it stops there (the later stages' resume is tested apart)
    env["UNTIL"] = "ontology"
    r = subprocess.run(["bash", str(ROOT / "examples/openclipart/run.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 0
    assert json.loads((tmp_path / "shards" / "report.json").read_text())["shards_resumed"] == 1
    for stage in ("bow", "det", "onto"):
        assert json.loads((tmp_path / stage / "report.json").read_text())["shards_resumed"] == 1

    # `make ablation RECIPE=fistful QUICK=1 STEPS=1` on this demo folder: builds the inputs it lacks (the intact
    # tokens, two BoW variants, the zero-shot set) with the demo's stages and tabulates both arms with the paper beside
    # them. In-process; its held-out sets are built by pipelines/inputs.yaml's own commands at smoke size (--inputs).
    text = (ROOT / "pipelines" / "inputs.yaml").read_text()
    for big, small in SMALL_SETS.items():
        assert text.count(big) == 1, big
        text = text.replace(big, small)
    (tmp_path / "inputs-small.yaml").write_text(text)
    capfd.readouterr()
    rc = ablation.main(["fistful", "--quick", "--steps", "1", "--demo", str(tmp_path),
                        "--inputs", str(tmp_path / "inputs-small.yaml")])
    assert rc == 0, capfd.readouterr().err[-3000:]
    res = json.loads((tmp_path / "ablation" / "fistful-quick" / "results.json").read_text())
    assert [row["arm"] for row in res["rows"]] == ["intact", "bow"]
    # the recipe scores on its own held-out sets (pipelines/inputs.yaml), not the demo's 10-pair check
    n_ret = open_dataset(tmp_path / "recipes" / "heldout-retrieval-feat").num_samples
    n_zs = open_dataset(tmp_path / "recipes" / "heldout-zeroshot-feat").num_samples
    assert n_ret > summary["n_pairs"] and n_zs > 0
    assert all(row["n_eval"] == n_ret and row["zeroshot_n"] == n_zs for row in res["rows"]), res["rows"]
    assert json.loads((tmp_path / "recipes" / "bow-default" / "meta.json").read_text())["features"] == feat
    table = (tmp_path / "ablation" / "fistful-quick" / "table.md").read_text()
    assert "Table 3" in table and "Table 8" in table and "inconclusive" in table  # one seed is never a verdict


def test_ablation_inputs_file_is_checked(tmp_path, capfd):
    """--inputs: a missing file or one that is no inputs mapping is one line and exit 2, before anything is built."""
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    for f in (tmp_path / "none.yaml", tmp_path / "list.yaml"):
        capfd.readouterr()
        assert ablation.main(["fistful", "--quick", "--demo", str(tmp_path / "demo"), "--inputs", str(f)]) == 2
        err = capfd.readouterr().err
        assert err.startswith(f"error: --inputs {f}") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "demo").exists()

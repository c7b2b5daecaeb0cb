"""A run's OUT is checked against every input it reads before anything is written; `train.report_to` refuses none
beside a tracker; `vltrain benchmark` leaves no folder behind that a failed download created."""

import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

from tests.conftest import colour_pairs, tiny_checkpoint
from tests.vltrain.test_trainer_usability import error_line
from vltrain.cli import app
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.export import export

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "model.fusion_layers=0",
        "data.image_size=32", "data.workers=0", "data.max_len=12"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("pairs"), 8)


def run(*args):
    sets = [x for s in TINY for x in ("--set", s)]
    return CliRunner().invoke(app, ["run", *map(str, args), "--preset", "clip", "--steps", "1", "--batch-size", "4",
                                    "--device", "cpu", *sets])


def listing(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


@pytest.mark.parametrize("where", ["same", "inside"])
def test_a_run_out_in_its_dataset_is_refused_and_the_data_untouched(pairs, where):
    before = listing(pairs)
    out = pairs if where == "same" else pairs / "run"
    line = error_line(run(pairs, "--out", out))
    assert "OUT" in line and str(pairs) in line, line
    assert listing(pairs) == before


def test_a_run_out_equal_to_its_init_from_export_is_refused(pairs, tmp_path):
    source = tmp_path / "export"
    export(tiny_checkpoint(tmp_path / "c.pt"), source)
    before = listing(source)
    line = error_line(run(pairs, "--out", source, "--init-from", source, "--overwrite"))
    assert "OUT" in line and "--init-from" in line, line
    assert listing(source) == before


def test_report_to_none_with_a_tracker_is_one_line():
    with pytest.raises(ConfigError, match=r"train.report_to: none .*wandb"):
        load_config(None, None, ["train.report_to=none,wandb"])
    assert load_config(None, None, ["train.report_to=none"]).train.report_to == []


def test_a_failed_benchmark_download_leaves_no_folder(tmp_path, monkeypatch):
    pytest.importorskip("clip_benchmark")

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network in the tests")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    ckpt = tiny_checkpoint(tmp_path / "c.pt")
    root = tmp_path / "missing" / "cifar"
    r = CliRunner().invoke(app, ["benchmark", str(ckpt), "--dataset", "cifar10", "--dataset-root", str(root),
                                 "--num-workers", "0"])
    assert "no network" in error_line(r)
    assert not (tmp_path / "missing").exists()
    # a root that was there stays, with what the user had in it
    root.mkdir(parents=True)
    (root / "keep.txt").write_text("mine")
    error_line(CliRunner().invoke(app, ["benchmark", str(ckpt), "--dataset", "cifar10", "--dataset-root",
                                        str(root), "--num-workers", "0"]))
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]


def test_eval_out_may_not_be_the_checkpoint_or_lie_in_a_dataset(pairs, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "c.pt")
    before = ckpt.read_bytes()
    shards = listing(pairs)
    for out in (ckpt, pairs / "eval.json", pairs / "sizes.json"):
        line = error_line(CliRunner().invoke(app, ["eval", str(ckpt), str(pairs), "--device", "cpu", "--out",
                                                   str(out)]))
        assert "--out" in line, line
    assert ckpt.read_bytes() == before and listing(pairs) == shards
    exported = tmp_path / "export"
    export(ckpt, exported)
    weights = (exported / "model.safetensors").read_bytes()
    line = error_line(CliRunner().invoke(app, ["eval", str(exported), str(pairs), "--device", "cpu", "--out",
                                               str(exported / "model.safetensors")]))
    assert "--out" in line and (exported / "model.safetensors").read_bytes() == weights

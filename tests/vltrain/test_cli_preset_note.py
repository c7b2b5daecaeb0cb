"""`vltrain run DATA` without --preset says what it trains before the first step, and on a CPU with pixels points to
the cached-token path (`vlprep features`, then --preset clip)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from vltrain.cli import app, preset_note
from vltrain.config import Config


@pytest.fixture
def folders(tmp_path):
    """A pixel dataset and a folder whose meta.json has a `vlprep features` record (all feature_input reads)."""
    pixels = colour_pairs(tmp_path / "px", 8)
    feat = tmp_path / "feat"
    feat.mkdir()
    (feat / "meta.json").write_text(json.dumps({"features": {"encoder": "efficientnet-lite0", "dim": 1280}}))
    return pixels, feat


def test_the_note_names_the_default_and_the_cpu_path(folders):
    pixels, feat = folders
    cpu = preset_note(Config(shards=[str(pixels)]), cuda=False)
    assert cpu.startswith("no --preset: training albef (the default) on pixels, on a CPU")
    assert "`vlprep features DATA DATA-feat`" in cpu and "--preset clip" in cpu and "\n" not in cpu
    assert preset_note(Config(shards=[str(pixels)]), cuda=True) == "no --preset: training albef (the default) on pixels"
    assert preset_note(Config(shards=[str(feat)]), cuda=False) == (
        "no --preset: training albef (the default) on cached image tokens (vlprep features)")
    assert preset_note(Config(shards=[str(pixels), str(feat)]), cuda=False) is None  # mixed: the run's own error


def test_run_hands_it_to_train_which_says_it_once_the_run_is_set_up(folders, tmp_path, monkeypatch):
    """`vltrain run` without --preset gives train() the note, which train() prints after setup, before the first
    step (so an error of the set-up, e.g. OUT holding another run, stays the only line); with --preset, no note."""
    calls = []

    def fake_train(cfg, **kw):
        calls.append((cfg.preset, kw.get("note")))
        return {"rank": 1}  # a rank other than 0 reports nothing

    monkeypatch.setattr("vltrain.train.train", fake_train)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pixels, _ = folders
    r = CliRunner().invoke(app, ["run", str(pixels), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0 and "no --preset" not in r.output, r.output  # not printed by the CLI itself
    assert calls[0][0] == "albef" and calls[0][1].startswith("no --preset: training albef (the default) on pixels, "
                                                             "on a CPU")
    r = CliRunner().invoke(app, ["run", str(pixels), "--preset", "albef", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0 and calls[1] == ("albef", None)


def test_a_refused_out_stays_the_only_line(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pixels, _ = folders
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    r = CliRunner().invoke(app, ["run", str(pixels), "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and r.output.strip().startswith("error:") and "\n" not in r.output.strip(), r.output


@pytest.mark.slow  # a one-step run
def test_train_says_the_note_after_its_header_and_before_its_first_step(folders, tmp_path, capsys):
    from tests.vltrain.test_train import TINY
    from vltrain.config_load import load_config
    from vltrain.train import train

    pixels, _ = folders
    cfg = load_config("clip", None, TINY + ["data.val_frac=0"], shards=[str(pixels)], out=str(tmp_path / "run"),
                      steps=1, batch_size=4, device="cpu")
    train(cfg, note="no --preset: a note")
    err = capsys.readouterr().err
    assert err.index("vltrain run: preset clip") < err.index("no --preset: a note") < err.index("step 1/1"), err

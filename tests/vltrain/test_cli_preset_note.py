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


def test_run_prints_it_before_training(folders, tmp_path, monkeypatch):
    """Printed before train() is called; not printed when --preset is given, nor when train() is about to refuse
    OUT in one line (it holds another run), which then stays the only line."""
    calls = []

    def fake_train(cfg, **kw):
        calls.append(cfg.preset)
        return {"rank": 1}  # a rank other than 0 reports nothing

    monkeypatch.setattr("vltrain.train.train", fake_train)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pixels, _ = folders
    r = CliRunner().invoke(app, ["run", str(pixels), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "no --preset: training albef (the default) on pixels, on a CPU" in r.output and calls == ["albef"]
    r = CliRunner().invoke(app, ["run", str(pixels), "--preset", "albef", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0 and "no --preset" not in r.output and calls == ["albef", "albef"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"")
    r = CliRunner().invoke(app, ["run", str(pixels), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0 and "no --preset" not in r.output and len(calls) == 3
    r = CliRunner().invoke(app, ["run", str(pixels), "--out", str(tmp_path / "run"), "--overwrite"])
    assert r.exit_code == 0 and "no --preset: training albef" in r.output and len(calls) == 4

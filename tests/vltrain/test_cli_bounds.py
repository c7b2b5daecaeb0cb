"""`vltrain` refuses what it cannot do in one line, before it creates anything: URLs where no URL can go, configs outside their
bounds, gradcam words the caption does not hold, and an OUT it cannot write."""

import os
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from tests.vltrain.test_config import alias_bomb
from tests.vltrain.test_trainer_usability import error_line, run, shards, tiny_args  # noqa: F401  (fixture)
from vltrain.cli import app

LOCAL_ONLY = "only dataset folders may be URLs (s3://, gs://, http(s)://); give a local path"


def invoke(*args) -> "CliRunner.Result":
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def fusion_ckpt(shards, tmp_path_factory) -> Path:
    """A one-step albef-base run of the tiny model (it has the fusion encoder gradcam reads)."""
    out = tmp_path_factory.mktemp("fusion") / "run"
    result = run(shards, out, "--preset", "albef-base", "--steps", "1", "--set", "model.fusion_layers=1")
    assert result.exit_code == 0, result.output
    return out / "last.pt"


@pytest.fixture
def picture(tmp_path) -> Path:
    Image.new("RGB", (40, 40), (200, 30, 30)).save(tmp_path / "p.png")
    return tmp_path / "p.png"


def test_urls_are_refused_where_no_url_can_go_before_anything_is_created(shards, fusion_ckpt, picture, tmp_path,
                                                                         monkeypatch):
    """Before: `vltrain run DS --out s3://mybucket/run` trained and exited 0, writing ./s3:/mybucket/run/ (a run's OUT
    may now be s3:// or gs://, a run in object storage). SHARDS may be URLs (tests/integration/test_objstore.py), of a
    scheme we read; nothing here is ever contacted."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cases = [
        # (--out s3:// and gs:// are runs in object storage now: tests/integration/test_remote_run.py)
        (["run", shards, "--out", "https://h/run", "--steps", "1", *tiny_args()],
         "--out https://h/run: https:// is read-only here; write to s3://, gs:// or a local folder"),
        (["run", "ftp://b/ds", "--steps", "1", *tiny_args()], "SHARDS ftp://b/ds: unsupported URL scheme ftp://; use "
                                                               "s3://, gs://, http(s):// or file://"),
        (["run", "s3://b/ds", "--preset", "grit", "--steps", "1", *tiny_args()],
         "sampler.kind=grit reads samples by index (random access), which needs local shards, and s3://b/ds is a URL: "
         "copy the dataset to a local folder (e.g. aws s3 sync, gcloud storage rsync), or train with "
         "sampler.kind=random, which streams"),
        (["run", shards, "--config", "gs://b/c.yaml"], "--config gs://b/c.yaml: "),
        (["run", shards, "--init-from", "https://h/last.pt"], "--init-from https://h/last.pt: "),
        (["run", shards, "--set", "model.image_weights=s3://b/w.pt"], "model.image_weights s3://b/w.pt: "),
        (["config", "--config", "s3://b/c.yaml"], "--config s3://b/c.yaml: "),
        # (eval's CHECKPOINT may be the URL of a checkpoint file now: tests/vltrain/test_eval_url.py)
        (["eval", fusion_ckpt, shards, "--out", "gs://b/eval.json"], "--out gs://b/eval.json: "),
        (["gradcam", fusion_ckpt, picture, "a cat", "--out", "s3://b/g.png"], "--out s3://b/g.png: "),
        (["export", fusion_ckpt, "s3://b/export"], "OUT s3://b/export: "),
    ]
    for args, says in cases:
        assert error_line(invoke(*args)) == f"error: {says}" + ("" if "://;" in says or "sampler" in says or
                                                                  "read-only" in says else LOCAL_ONLY), args
    assert list(cwd.iterdir()) == []  # no ./s3:/ folder, no run files
    # a Windows-like drive letter is a local path, not a URL
    assert "URL" not in invoke("config", "--config", "C:/x/c.yaml").output


def test_config_errors_are_one_bounded_line(shards, tmp_path):
    """Before: an alias bomb under model.text_model was printed by `vltrain config` (5.8 MB, exit 0); --config DIR
    was an IsADirectoryError traceback; model.embed_dim=0 trained with a constant loss of ln 8 and exited 0."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(6, "model.text_model"))
    line = error_line(invoke("config", "--config", bomb))
    assert line == f"error: {bomb}: refused: its aliases expand to more than 10,000 values (an alias bomb?); write " \
                   "the values out"
    assert error_line(invoke("config", "--config", tmp_path)) == \
        f"error: --config {tmp_path} is a folder; give a YAML file"
    line = error_line(invoke("config", "--set", "model.text_model=[" + ", ".join(["x" * 40] * 5000) + "]"))
    assert line.startswith("error: model.text_model: expected a string, got ['xxx") and len(line) < 140
    out = tmp_path / "run"
    line = error_line(run(shards, out, "--steps", "1", "--set", "model.embed_dim=0"))
    assert line == "error: model.embed_dim=0 is outside its range [1, inf) (ITC projection size)"
    assert not out.exists()


def test_gradcam_matches_whole_words(fusion_ckpt, picture, tmp_path):
    """Before: --words snowboarder,catamaran on "a cat in the snow" drew the maps of "snow" and "cat" under those
    labels (only the first word piece was compared)."""
    png = tmp_path / "g.png"
    line = error_line(invoke("gradcam", fusion_ckpt, picture, "a cat in the snow", "--words", "snowboarder,catamaran",
                             "--out", png))
    assert line == ("error: word 'snowboarder' is not in the caption's tokens (a cat in the snow): give whole words "
                    "of it")
    assert error_line(invoke("gradcam", fusion_ckpt, picture, "a snowboarder jumps", "--words", "snow",
                             "--out", png)) == \
        "error: word 'snow' is not in the caption's tokens (a snowboarder jumps): give whole words of it"
    assert error_line(invoke("gradcam", fusion_ckpt, picture, " ", "--out", png)) == \
        "error: the caption is empty: give the words the image shows"
    assert not png.exists()
    ok = invoke("gradcam", fusion_ckpt, picture, "a snowboarder in the snow", "--words", "snowboarder,snow",
                "--out", png)
    assert ok.exit_code == 0 and "{'snowboarder': 2, 'snow': 7}" in " ".join(ok.output.split()), ok.output
    assert png.stat().st_size > 0


def test_an_out_that_cannot_be_written_is_one_line(shards, fusion_ckpt, picture, tmp_path):
    """OUT lies under a regular file, so creating it fails with NotADirectoryError even for root (tests run as root,
    where a chmod'ed read-only folder would still be writable). Before: an OSError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert error_line(run(shards, blocker / "run", "--steps", "1")) == \
        f"error: cannot write {blocker / 'run'}: not a directory"
    assert error_line(invoke("eval", fusion_ckpt, shards, "--device", "cpu", "--out", blocker / "e.json")) == \
        f"error: cannot write {blocker / 'e.json'}: {blocker} is not a folder"
    assert error_line(invoke("gradcam", fusion_ckpt, picture, "a cat", "--out", blocker / "g.png")) == \
        f"error: cannot write {blocker / 'g.png'}: {blocker} is not a folder"
    assert blocker.read_text() == "x" and sorted(os.listdir(tmp_path)) == ["file", "p.png"]

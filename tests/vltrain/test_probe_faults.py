"""Faults a probe of careless and hostile inputs found, each now one line (or no fault at all): a URL or huge --seeds
given to pipelines/ablation.py, a FIFO as --config, --steps beyond any clock, overlong or unknown model names, an
overlong --preset, an export OUT below a file, and a gradcam word matched to another word's [UNK]."""

import importlib.util
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from vltrain.cli import app

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01"]


def load_ablation():
    spec = importlib.util.spec_from_file_location("ablation_probe", ROOT / "pipelines" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """8 pixel pairs in 2 shards."""
    return colour_pairs(tmp_path_factory.mktemp("probe"), 8)


def tiny_args(*extra: str, leave: str = "") -> list[str]:
    return [x for s in TINY if not (leave and s.startswith(leave + "=")) for x in ("--set", s)] + list(extra)


def run(shards, out, *args, leave: str = ""):
    return CliRunner().invoke(app, ["run", str(shards), "--out", str(out), "--batch-size", "4", "--device", "cpu",
                                    "--steps", "2", "--preset", "clip", *tiny_args(*args, leave=leave)])


def error_line(result) -> str:
    """The one line a failed command printed (its output must be exactly one non-empty line, no traceback)."""
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# --- 1. pipelines/ablation.py: URLs and huge --seeds ----------------------------------------------------------------


def test_ablation_refuses_urls_for_out_demo_recipe_and_rescore_before_anything_is_built(tmp_path, monkeypatch,
                                                                                        capsys):
    """Before: `--out s3://b/abl` was the local folder ./s3:/b/abl (argparse's type=Path collapses `//`)."""
    ablation = load_ablation()
    recipe = {"about": "t", "eval": {"retrieval": "heldout"}, "arms": {"a": {"data": [str(tmp_path / "nope")]}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    for args, flag in (([str(path), "--out", "s3://b/abl", "--demo", str(tmp_path / "demo")], "--out s3://b/abl"),
                       ([str(path), "--demo", "gs://b/demo"], "--demo gs://b/demo"),
                       (["s3://b/r.yaml", "--demo", str(tmp_path / "demo")], "RECIPE s3://b/r.yaml"),
                       (["--rescore", "https://h/results.json"], "--rescore https://h/results.json")):
        assert ablation.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {flag}: only dataset folders may be URLs") and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # no s3:, gs: or demo folder


def test_ablation_bounds_the_seed_count_and_each_seed(tmp_path, capsys):
    """Before: --seeds 99999999999999999999 was an OverflowError traceback from list(range(...))."""
    ablation = load_ablation()
    recipe = {"about": "t", "eval": {"retrieval": "heldout"}, "arms": {"a": {"data": [str(tmp_path / "nope")]}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    huge = "9" * 5000
    for seeds, says in (("99999999999999999999", "--seeds '99999999999999999999': at most 1000 seeds"),
                        ("1001", "--seeds '1001': at most 1000 seeds"),
                        (",".join(map(str, range(1001))), "at most 1000 seeds"),
                        ("3,4294967296", "--seeds '3,4294967296': seeds are at most 4294967295"),
                        (huge, "at most 1000 seeds")):
        assert ablation.main([str(path), "--demo", str(tmp_path / "demo"), "--seeds", seeds]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --seeds ") and says in err and "\n" not in err and len(err) < 200, err
    assert ablation.parse_seeds("1000", 1) == list(range(1000))
    assert ablation.parse_seeds("0,4294967295", 1) == [0, 4294967295]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


# --- 2. --config a FIFO ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["config", "run"])
def test_config_that_is_a_fifo_is_refused_not_read(command, shards, tmp_path):
    """Before: reading the FIFO waited forever for a writer. Here a helper thread writes a valid config into it after
    2 s if anyone opened it for reading, so the old code ends (exit 0 or a training run) instead of hanging."""
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    done = threading.Event()

    def feed():  # O_NONBLOCK: opening for writing fails (ENXIO) while no one reads, so this never blocks
        deadline = time.monotonic() + 2
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
                continue
            while time.monotonic() < deadline and not done.is_set():
                time.sleep(0.05)
            os.write(fd, b"steps: 1\n")
            os.close(fd)
            return

    helper = threading.Thread(target=feed, daemon=True)
    helper.start()
    try:
        if command == "config":
            result = CliRunner().invoke(app, ["config", "--config", str(fifo)])
        else:
            result = run(shards, tmp_path / "r", "--config", str(fifo))
    finally:
        done.set()
        helper.join(5)
    assert "is not a regular file" in error_line(result)
    assert not (tmp_path / "r").exists()


# --- 3. --steps beyond any date -------------------------------------------------------------------------------------


def test_eta_note_of_a_run_ending_beyond_any_date_does_not_crash(capsys):
    """Before: datetime.now() + timedelta(seconds=1e22) was `OverflowError: Python int too large to convert to C int`
    after the first 10 steps of `vltrain run --steps 99999999999999999999999`."""
    from vltrain import runlog as report

    for steps in (99999999999999999999999, 10 ** 400):  # past year 9999; past a float
        fake = SimpleNamespace(cfg=SimpleNamespace(steps=steps, batch_size=4), device=SimpleNamespace(type="cpu"),
                               use_features=True, console=report.make_console())
        report.RunLog._eta_note(fake, 10, 1.0, 10)
    assert report.end_time(60).startswith("until about ")
    assert report.fmt_duration(float("inf")) == "forever" and report.fmt_duration(3.8e22) == "1.2e+15 years"
    assert report.fmt_duration(6000) == "1.7 h"


# --- 4. an overlong text_model --------------------------------------------------------------------------------------


def test_an_overlong_text_model_is_the_one_line_of_an_unknown_one_cut_to_80_characters(shards, tmp_path):
    """Before: Path(name).is_dir() raised `OSError: [Errno 36] File name too long` (a traceback); a 200-character
    name was quoted whole."""
    line = error_line(run(shards, tmp_path / "r", "--set", "model.text_model=" + "t" * 300))
    assert "or a local Hugging Face model folder, got 'ttt" in line
    assert line.endswith("…") and len(line) < 200, line
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"text_model": "x" * 200_000}}))
    line = error_line(run(shards, tmp_path / "r", "--config", str(config), leave="model.text_model"))
    assert "local Hugging Face model folder, got 'xxx" in line and len(line) < 200, line[:300]
    from vltrain.model import _text_path

    with pytest.raises(ValueError, match="local Hugging Face model folder") as e:
        _text_path("y" * 200)
    assert len(str(e.value)) < 200 and str(e.value).endswith("…")


# --- 5. an unknown image_model on pixels ----------------------------------------------------------------------------


def test_an_unknown_image_model_on_pixels_names_the_valid_choices(shards, tmp_path):
    """Before: image_stats gave mean None and torchvision's Normalize raised `TypeError: 'NoneType' object is not
    iterable`."""
    line = error_line(run(shards, tmp_path / "r", "--set", "model.image_model=foo"))
    assert line == ("error: image_model must be one of ['efficientnet-lite0', 'features', 'tiny'], torchvision:ARCH, "
                    "timm:NAME or clip:PATH, got 'foo'")
    line = error_line(run(shards, tmp_path / "r", "--set", "model.image_model=" + "f" * 5000))
    assert len(line) < 250 and line.endswith("…"), line
    from vltrain.config import ModelConfig
    from vltrain.model import image_stats

    assert image_stats(ModelConfig(image_model="tiny"))[2] == 32
    assert image_stats(ModelConfig(image_model="features")) == (None, None, None)


# --- 6. an overlong --preset ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["config", "run"])
def test_an_overlong_preset_is_quoted_cut_to_80_characters(command, shards, tmp_path):
    """Before: `unknown preset 'ppp...'` quoted all 5,000 characters."""
    args = ["config", "--preset", "p" * 5000] if command == "config" else \
        ["run", str(shards), "--out", str(tmp_path / "r"), "--preset", "p" * 5000]
    line = error_line(CliRunner().invoke(app, args))
    assert line.startswith("error: unknown preset 'ppp") and "p" * 78 + "…" in line and "p" * 79 not in line
    assert line.endswith("; presets: clip, albef, albef-base, tonics, tonics-ir, fistful, softmask, grit"), line
    assert error_line(CliRunner().invoke(app, ["config", "--preset", "nope"])) == \
        "error: unknown preset 'nope'; presets: clip, albef, albef-base, tonics, tonics-ir, fistful, softmask, grit"
    assert not (tmp_path / "r").exists()


# --- 7. export into an OUT that cannot be made ----------------------------------------------------------------------


def fusion_checkpoint(path: Path) -> Path:
    """A random tiny model with one fusion layer (what gradcam reads), in vltrain's checkpoint format."""
    import torch

    from vltrain.config import Config, DataConfig, to_dict
    from vltrain.config import ModelConfig
    from vltrain.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=1)
    torch.save({"model": build_model(mc).state_dict(),
                "config": to_dict(Config(model=mc, data=DataConfig(image_size=32, max_len=12)))}, path)
    return path


def test_export_into_an_out_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    """OUT below a regular file (root may write anywhere, so chmod proves nothing), and os.mkdir denied. Before:
    NotADirectoryError / PermissionError tracebacks from vltrain.export.prepare_out."""
    ckpt = fusion_checkpoint(tmp_path / "m.pt")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    line = error_line(CliRunner().invoke(app, ["export", str(ckpt), str(blocker / "exp")]))
    assert line == f"error: cannot write {blocker / 'exp'}: not a directory"
    denied = tmp_path / "ro" / "exp"

    def no_mkdir(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "mkdir", no_mkdir)
    line = error_line(CliRunner().invoke(app, ["export", str(ckpt), str(denied)]))
    assert line == f"error: cannot write {denied}: permission denied"
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m.pt"]


# --- 9. gradcam words the vocabulary lacks --------------------------------------------------------------------------


def test_gradcam_never_matches_a_word_to_another_words_unk(tmp_path):
    """Both 200-letter words are [UNK] to the tokenizer. Before: --words vvv... drew the map of www...'s [UNK] under
    the label vvv... and exited 0."""
    ckpt = fusion_checkpoint(tmp_path / "m.pt")
    image = tmp_path / "i.png"
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(image)
    caption = "a cat " + "w" * 200
    r = CliRunner().invoke(app, ["gradcam", str(ckpt), str(image), caption, "--words", "v" * 200, "--out",
                                 str(tmp_path / "gc.png"), "--device", "cpu"])
    assert f"error: word '{'v' * 80}' is not in the caption's tokens (a cat): give whole words of it" == error_line(r)
    assert not (tmp_path / "gc.png").exists()
    r = CliRunner().invoke(app, ["gradcam", str(ckpt), str(image), caption, "--words", "cat," + "W" * 200, "--out",
                                 str(tmp_path / "gc.png"), "--device", "cpu"])
    assert r.exit_code == 0 and (tmp_path / "gc.png").is_file(), r.output  # the word itself: its [UNK] is its own
    assert "'cat': 2" in r.output and f"'{'W' * 200}': 3" in r.output.replace("\n", ""), r.output

    from vltrain.figures import word_positions
    from vltrain.model import tokenizer_for

    tok = tokenizer_for("tiny")
    ids = tok([caption], return_tensors="pt")["input_ids"]
    assert word_positions(tok, ids, ["cat", "w" * 200], caption) == {"cat": 2, "w" * 200: 3}
    for word in ("v" * 200, "[UNK]"):
        with pytest.raises(ValueError, match="is not in the caption's tokens"):
            word_positions(tok, ids, [word], caption)
    with pytest.raises(ValueError, match="is not in the caption's tokens"):  # no caption text: an [UNK] never matches
        word_positions(tok, ids, ["w" * 200])

"""A crafted export or checkpoint is refused in one line naming the key, before any model is built: the config's
types and ranges are a run's (vltrain.config), and its sizes must fit the weights it holds."""

import json
import re

import pytest
import torch
from typer.testing import CliRunner

import vltrain
from tests.conftest import tiny_checkpoint
from vltrain.errors import CheckpointError
from vltrain.cli import app
from vltrain.export import export
from tests.vltrain.test_zeroshot import benchmark


@pytest.fixture(scope="module")
def clean_export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    out = tmp / "export"
    export(tiny_checkpoint(tmp / "ckpt.pt"), out)
    benchmark(tmp / "bench", per_class=1)
    return out


def crafted(src, tmp_path, change) -> "Path":  # noqa: F821
    out = tmp_path / "crafted"
    out.mkdir()
    for name in ("model.safetensors",):
        (out / name).write_bytes((src / name).read_bytes())
    meta = json.loads((src / "config.json").read_text())
    change(meta)
    (out / "config.json").write_text(json.dumps(meta))
    return out


def setter(section, key, value):
    def change(meta):
        meta["config"][section][key] = value
    return change


CASES = [
    (setter("model", "embed_dim", 1e9), r"model\.embed_dim: expected an integer"),
    (setter("model", "embed_dim", 10 ** 9), r"implies at least .* parameters \(model\.embed_dim 1000000000"),
    (setter("model", "embed_dim", -5), r"model\.embed_dim=-5 is outside its range"),
    (setter("model", "embed_dim", "256"), r"model\.embed_dim: expected an integer, got '256'"),
    (setter("model", "embed_dim", 256.0), r"model\.embed_dim: expected an integer, got 256\.0"),
    (setter("model", "fusion_layers", "two"), r"model\.fusion_layers: expected an integer"),
    (setter("model", "text_model", None), r"model\.text_model: expected a string, got None"),
    (setter("model", "feature_encoder", [1, 2]), r"model\.feature_encoder: expected a mapping"),
    (setter("model", "queue_size", 10 ** 9), None),  # an export is rebuilt without queues: harmless, loads
    (lambda m: m["config"].update(data=[1, 2]), r"data is a section"),
    (setter("data", "image_size", 1e6), r"data\.image_size: expected an integer"),
    (setter("data", "image_size", 10 ** 6), r"data\.image_size=1000000 is outside its range"),
    (setter("data", "image_size", -32), r"data\.image_size=-32 is outside its range"),
    (setter("data", "max_len", -1), r"data\.max_len=-1 is outside its range"),
    (lambda m: m.update(version="1"), r"export version '1' is not a version this vltrain reads"),
    (lambda m: m.update(tied=["x"]), r"\"tied\" is a list, not a mapping"),
    (lambda m: m.update(source=[1]), r"\"source\" is a list, not a mapping"),
    (lambda m: m["config"]["model"].update(image_model="features", feature_dim=10 ** 9),
     r"implies at least .* parameters .*model\.feature_dim 1000000000"),
    (lambda m: m["config"]["model"].update(image_model="features", feature_dim=16, feature_encoder={
        "encoder": "efficientnet-lite0", "size": 10 ** 6, "mean": [0.5] * 3, "std": [0.5] * 3}),
     r"model\.feature_encoder\.size=1000000 is outside its range"),
    (lambda m: m["config"]["model"].update(image_model="features", feature_dim=16, feature_encoder={
        "encoder": "efficientnet-lite0", "size": 224, "mean": "abc", "std": [0.5] * 3}),
     r"model\.feature_encoder\.mean: expected three numbers"),
]


@pytest.mark.parametrize("change, message", CASES)
def test_a_crafted_export_config_is_one_line_naming_the_key(clean_export, tmp_path, change, message):
    out = crafted(clean_export, tmp_path, change)
    if message is None:
        assert vltrain.load(out, device="cpu").net.cfg.queue_size == 0
        return
    with pytest.raises(ValueError, match=message) as e:
        vltrain.load(out, device="cpu")
    assert "\n" not in str(e.value) and "newer" not in str(e.value)
    r = CliRunner().invoke(app, ["eval", str(out), "--zeroshot-folder", str(clean_export.parent / "bench"),
                                 "--device", "cpu", "--out", str(tmp_path / "e.json")])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output + repr(r.exception)
    assert re.search(message, lines[0]), lines[0]


def test_a_deeply_nested_or_huge_config_json_is_one_line(clean_export, tmp_path):
    out = crafted(clean_export, tmp_path, lambda m: None)
    (out / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=r"config.json: not readable JSON \(truncated or corrupt: RecursionError"):
        vltrain.load(out, device="cpu")
    with open(out / "config.json", "wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of NULs
    with pytest.raises(CheckpointError, match=r"config.json: 17,825,792 bytes; an export's config.json is a few KB"):
        vltrain.load(out, device="cpu")


def test_a_crafted_checkpoint_config_is_refused_before_building(tmp_path):
    ckpt = torch.load(tiny_checkpoint(tmp_path / "c.pt"), weights_only=True)
    ckpt["config"]["model"]["queue_size"] = 10 ** 9  # a checkpoint holds its queues: 2 x 16 x 1e9 floats
    torch.save(ckpt, tmp_path / "q.pt")
    with pytest.raises(CheckpointError, match=r"implies at least .*model\.queue_size 1000000000"):
        vltrain.load(tmp_path / "q.pt", device="cpu")
    ckpt["config"]["model"]["queue_size"] = 0
    ckpt["format"] = "1"
    torch.save(ckpt, tmp_path / "f.pt")
    with pytest.raises(CheckpointError, match=r"checkpoint format '1' is not a version this vltrain reads"):
        vltrain.load(tmp_path / "f.pt", device="cpu")


def test_gradcam_on_a_decompression_bomb_or_a_fifo_is_one_line(tmp_path):
    import os

    from PIL import Image

    from tests.vltrain.test_api import fusion_checkpoint

    ckpt = fusion_checkpoint(tmp_path / "f.pt")
    Image.new("1", (20000, 20000)).save(tmp_path / "bomb.png")  # 400M pixels in a few KB
    os.mkfifo(tmp_path / "fifo.png")  # reading it would wait forever
    for image, message in (("bomb.png", r"bomb\.png: refused as a decompression bomb"),
                           ("fifo.png", r"fifo\.png is not a regular file")):
        r = CliRunner().invoke(app, ["gradcam", str(ckpt), str(tmp_path / image), "a cat", "--device", "cpu",
                                     "--out", str(tmp_path / "g.png")])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output + repr(r.exception)
        assert re.search(message, lines[0]), lines[0]


def test_an_export_that_vltrain_eval_scored_is_still_an_export(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    out = tmp_path / "export"
    export(ckpt, out)
    benchmark(tmp_path / "bench", per_class=1)
    r = CliRunner().invoke(app, ["eval", str(out), "--zeroshot-folder", str(tmp_path / "bench"), "--device", "cpu"])
    assert r.exit_code == 0 and (out / "eval.json").is_file(), r.output + repr(r.exception)
    r = CliRunner().invoke(app, ["export", str(ckpt), str(out)])  # exported again: no --overwrite needed
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert not (out / "eval.json").exists()  # it scored the weights just replaced
    assert vltrain.load(out, device="cpu").step is None
    # an eval.json alone is the user's: no export to replace there
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "eval.json").write_text("{}")
    r = CliRunner().invoke(app, ["export", str(ckpt), str(lone)])
    assert r.exit_code == 2 and "not a vltrain export" in r.output and (lone / "eval.json").exists()


def test_onnx_of_a_model_whose_itc_towers_never_trained_says_so(tmp_path):
    pytest.importorskip("onnxruntime")
    ckpt = torch.load(tiny_checkpoint(tmp_path / "c.pt"), weights_only=True)
    for name, itc in (("tonics", 0.0), ("clip", 1.0)):
        ckpt["config"]["loss"]["itc"] = itc  # the tonics presets train the aligner with loss.itc 0
        torch.save(ckpt, tmp_path / f"{name}.pt")
        r = CliRunner().invoke(app, ["export", str(tmp_path / f"{name}.pt"), str(tmp_path / name), "--onnx"])
        assert r.exit_code == 0, r.output + repr(r.exception)
        warned = [ln for ln in r.output.splitlines() if ln.startswith("warning: ")]
        readme = (tmp_path / name / "README.md").read_text()
        meta = json.loads((tmp_path / name / "config.json").read_text())
        if name == "tonics":
            assert len(warned) == 1 and "loss.itc=0" in warned[0] and "untrained" in warned[0]
            assert "loss.itc=0" in readme and meta["onnx"]["itc_trained"] is False
        else:
            assert not warned and "untrained" not in readme and "itc_trained" not in meta["onnx"]


def test_a_crafted_worker_count_is_capped_at_the_cpus(clean_export, tmp_path, monkeypatch):
    import os

    import vltrain.zeroshot as zeroshot

    out = crafted(clean_export, tmp_path, setter("data", "workers", 100_000))
    seen = []
    real = zeroshot.DataLoader
    monkeypatch.setattr(zeroshot, "DataLoader", lambda *a, **k: seen.append(k["num_workers"]) or real(
        *a, **{**k, "num_workers": 0}))
    r = CliRunner().invoke(app, ["eval", str(out), "--zeroshot-folder", str(clean_export.parent / "bench"),
                                 "--device", "cpu", "--out", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert seen == [min(100_000, os.cpu_count() or 1)]

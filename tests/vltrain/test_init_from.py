"""`vltrain run --init-from`: a new run from another run's weights (or an export's) with a fresh optimiser and
schedule; what was loaded, what is new and what was dropped, said in one line and kept in result.json and in the
run's checkpoints; the EMA copy starts as the loaded online model, the queues fresh."""

import json
import re
import shutil

import pytest
import torch

from tests.vltrain.test_train import run, shards  # noqa: F401  (the tiny shards fixture and the CLI helper)
from vltrain.checkpoint import load, model_config, model_from
from vltrain.errors import CheckpointError
from vltrain.init_from import init_weights
from vltrain.config import ModelConfig
from vltrain.model import build_model

ALBEF = ["--preset", "albef", "--set", "model.fusion_layers=1", "--set", "model.queue_size=16",
         "--set", "model.momentum_m=0.9"]  # the tiny BERT has 2 layers: split 1 + 1
FROZEN = ["--set", "optim.lr=0"]  # one step that changes no weight: last.pt holds the weights the run started from


def ok(r):
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def one_line_error(r, *parts):
    assert r.exit_code == 2, r.output + repr(r.exception)
    line = r.output.strip()
    assert line.startswith("error:") and "\n" not in line and "Traceback" not in line, line
    for part in parts:
        assert part in line, line
    return line


def init_line(output: str) -> str:
    return next(ln for ln in output.splitlines() if ln.startswith("init-from "))


@pytest.fixture(scope="module")
def source(shards, tmp_path_factory):  # noqa: F811
    """A clip run of 4 steps (trained weights, not the built ones): the checkpoint the tests start from."""
    out = tmp_path_factory.mktemp("init") / "clip"
    ok(run(shards, out, "--preset", "clip", "--steps", "4"))
    return out / "last.pt"


def test_clip_to_clip_loads_every_tensor_and_embeds_as_the_source(shards, source, tmp_path):  # noqa: F811
    src = load(source)
    model = build_model(model_config(src["config"]["model"], source))
    info = init_weights(model, src, source)
    assert (info["loaded"], info["new"], info["dropped"], info["momentum_copied"]) == (len(src["model"]), 0, 0, 0)
    ref, ids, mask = model_from(src, source).eval(), torch.randint(1000, 2000, (3, 6)), torch.ones(3, 6)
    model.eval()
    images = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.encode_text(ids, mask)[1], ref.encode_text(ids, mask)[1])
        assert torch.equal(model.encode_image(images)[1], ref.encode_image(images)[1])

    out = tmp_path / "ft"
    r = ok(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(source), *FROZEN))
    line = init_line(r.output)
    assert re.search(rf"loaded {len(src['model'])} tensors \(text_encoder \d+, .*\); new 0; dropped 0$", line), line
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["step"] == 1 and ckpt["init_from"]["path"] == str(source)
    assert all(torch.equal(ckpt["model"][k], v) for k, v in src["model"].items())
    result = json.loads((out / "result.json").read_text())["init_from"]
    assert {k: result[k] for k in ("path", "step", "preset", "loaded", "new", "dropped")} == {
        "path": str(source), "step": 4, "preset": "clip", "loaded": len(src["model"]), "new": 0, "dropped": 0}
    assert sum(result["modules"]["loaded"].values()) == len(src["model"])


def test_clip_to_albef_adds_fusion_and_heads_and_copies_momentum_from_the_loaded_weights(shards, source,  # noqa: F811
                                                                                         tmp_path):
    src = load(source)
    cfg = ModelConfig(**{**src["config"]["model"], "fusion_layers": 1, "fusion_from": "split", "momentum": True,
                         "queue_size": 16})
    model = build_model(cfg)
    info = init_weights(model, src, source)
    state = model.state_dict()
    for k, v in state.items():  # the EMA copy is the online model as loaded: every tensor of it
        if k.startswith("momentum."):
            assert torch.equal(v, state[k[len("momentum."):]]), k
    assert torch.equal(state["text_proj.weight"], src["model"]["text_proj.weight"])
    # split: the text encoder keeps layer 0, and the fusion layer's self-attention comes from the checkpoint's layer 1
    assert torch.equal(state["fusion.0.self_attn.q.weight"],
                       src["model"]["text_encoder.encoder.layer.1.attention.self.query.weight"])
    assert set(info["modules"]["new"]) >= {"fusion", "itm_head", "mlm_transform", "image_to_text"}
    assert list(info["modules"]["dropped"]) == ["text_encoder"] and info["momentum_copied"] > 0
    assert info["queues_fresh"] and any("fusion: self-attention and FFN" in n for n in info["notes"])

    out = tmp_path / "albef"
    r = ok(run(shards, out, *ALBEF, "--steps", "1", "--init-from", str(source), *FROZEN))
    line = init_line(r.output)
    assert re.search(r"new \d+ \(.*fusion \d+.*\); dropped \d+ \(text_encoder \d+\); momentum copy: \d+ from the "
                     r"online weights; queues start fresh$", line), line
    result = json.loads((out / "result.json").read_text())["init_from"]
    assert (result["new"], result["dropped"], result["momentum_copied"]) == (info["new"], info["dropped"],
                                                                            info["momentum_copied"])


def test_a_shape_mismatch_is_one_line_naming_the_parameter_and_both_shapes(shards, source, tmp_path):  # noqa: F811
    r = run(shards, tmp_path / "wide", "--preset", "clip", "--steps", "1", "--init-from", str(source),
            "--set", "model.embed_dim=32")
    line = one_line_error(r, "model.embed_dim 16 vs 32")
    assert re.search(r"(image|text)_proj\.(weight|bias): checkpoint \(16(, 32)?\), model \(32(, 32)?\)", line), line
    assert not (tmp_path / "wide" / "last.pt").exists()


def test_refusals_are_one_line(shards, source, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    # --preset given: without it the run says first which preset it trains (a note line before the error)
    one_line_error(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(junk)),
                   "not a vltrain checkpoint")
    one_line_error(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(tmp_path / "nope.pt")),
                   "--init-from not found")
    # into an OUT that holds a run: --overwrite, as for any fresh run; never over the checkpoint it starts from
    ok(run(shards, out, "--preset", "clip", "--steps", "1"))
    one_line_error(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(source)),
                   "already holds a run")
    ok(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(source), "--overwrite"))
    one_line_error(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(out / "last.pt"),
                       "--overwrite"), "which --overwrite deletes")
    assert (out / "last.pt").exists()


def test_init_from_with_resume_starts_from_the_source_then_resumes_its_checkpoint(shards, source,  # noqa: F811
                                                                                 tmp_path):
    """--init-from X --resume is one command line for the first start and every restart: on an empty OUT the run
    starts from X; with OUT/last.pt it resumes that (X is not read again: it may be gone) once X is checked against
    the source the checkpoint records (the same path, or the same file under another name). Another source, or
    --init-from for a run that began without one, is one line."""
    out = tmp_path / "run"
    r = ok(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(source), "--resume", *FROZEN))
    assert f"--resume: no checkpoint in {out} yet, starting the run" in r.output and init_line(r.output)
    ckpt, src = torch.load(out / "last.pt", weights_only=True), load(source)
    assert ckpt["init_from"]["path"] == str(source)
    assert all(torch.equal(ckpt["model"][k], v) for k, v in src["model"].items())  # lr 0: the source's weights
    alias = source.parent / ".." / source.parent.name / "last.pt"
    for given, steps in ((source, 2), (alias, 3)):
        r = ok(run(shards, out, "--preset", "clip", "--steps", str(steps), "--init-from", str(given), "--resume",
                   *FROZEN))
        assert f"resumed from step {steps - 1} of {steps}" in r.output, r.output
        assert f"the run began from --init-from {source}" in r.output
        assert not any(ln.startswith("init-from ") for ln in r.output.splitlines())  # nothing loaded again
    one_line_error(run(shards, out, "--preset", "clip", "--steps", "4", "--init-from", str(tmp_path / "gone.pt"),
                       "--resume", *FROZEN), f"began from --init-from {source}, not {tmp_path / 'gone.pt'}")
    plain = tmp_path / "plain"
    ok(run(shards, plain, "--preset", "clip", "--steps", "1", *FROZEN))
    one_line_error(run(shards, plain, "--preset", "clip", "--steps", "2", "--init-from", str(source), "--resume",
                       *FROZEN), "did not begin from --init-from")
    assert torch.load(plain / "last.pt", weights_only=True)["step"] == 1


def test_a_link_into_out_is_refused_with_overwrite_by_resolved_path(shards, source, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    ok(run(shards, out, "--preset", "clip", "--steps", "1"))
    before = (out / "last.pt").read_bytes()
    (tmp_path / "link.pt").symlink_to(out / "last.pt")
    (tmp_path / "alias").symlink_to(out)  # a second name for OUT itself
    for given in (tmp_path / "link.pt", tmp_path / "alias" / "last.pt", out / ".." / "run" / "last.pt"):
        one_line_error(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(given),
                           "--overwrite"), "which --overwrite deletes")
        one_line_error(run(shards, tmp_path / "alias", "--preset", "clip", "--steps", "1", "--init-from",
                           str(given), "--overwrite"), "which --overwrite deletes")
    assert (out / "last.pt").read_bytes() == before


def test_a_resumed_run_reloads_nothing_and_keeps_where_it_began(shards, source, tmp_path):  # noqa: F811
    start = tmp_path / "start.pt"
    shutil.copy(source, start)
    out, common = tmp_path / "ft", ["--preset", "clip", "--set", "optim.warmup_steps=0", "--set",
                                    "optim.min_lr_ratio=1.0"]
    ok(run(shards, out, *common, "--steps", "2", "--init-from", str(start)))
    start.unlink()  # a resume needs only its own checkpoint
    r = ok(run(shards, out, *common, "--steps", "3", "--resume"))
    assert f"the run began from --init-from {start}" in r.output and "init-from " + str(start) + ":" not in r.output
    assert json.loads((out / "result.json").read_text())["init_from"]["path"] == str(start)
    assert torch.load(out / "last.pt", weights_only=True)["init_from"]["loaded"] > 0


def test_an_export_folder_initialises_as_its_checkpoint(shards, source, tmp_path):  # noqa: F811
    export = pytest.importorskip("vltrain.export").export
    export(source, tmp_path / "exp")
    out = tmp_path / "ft"
    r = ok(run(shards, out, "--preset", "clip", "--steps", "1", "--init-from", str(tmp_path / "exp"), *FROZEN))
    src = load(source)
    assert f"loaded {len(src['model'])} tensors" in init_line(r.output)
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert all(torch.equal(ckpt["model"][k], v) for k, v in src["model"].items())


def _source_of(cfg: ModelConfig) -> dict:
    model = build_model(cfg)
    return {"model": model.state_dict(), "config": {"model": vars(cfg), "preset": "clip"}, "step": 1}


def test_features_and_pixel_models_fit_when_the_tokens_are_the_pixel_encoders_else_one_line():
    base = {"text_model": "tiny", "embed_dim": 16, "fusion_layers": 0}
    pixels = ModelConfig(image_model="tiny", **base)
    spec = {"encoder": "tiny", "weights": "", "dim": 32, "mean": [0.5] * 3, "std": [0.5] * 3, "size": 32}
    features = ModelConfig(image_model="features", feature_dim=32, feature_encoder=spec, **base)
    # pixels -> features: the pixel encoder is dropped, the layers above it (32-d tokens either way) are loaded
    info = init_weights(build_model(features), _source_of(pixels), "pix.pt")
    assert info["new"] == 0 and list(info["modules"]["dropped"]) == ["image_encoder"]
    assert any("read pixels through its own tiny image encoder" in n for n in info["notes"])
    # features -> pixels: the encoder starts as built
    info = init_weights(build_model(pixels), _source_of(features), "feat.pt")
    assert list(info["modules"]["new"]) == ["image_encoder"] and info["dropped"] == 0
    assert any("this run reads pixels" in n for n in info["notes"])
    # tokens of another width: the first image-side tensor that does not fit, and the two inputs, in one line
    wide = ModelConfig(image_model="features", feature_dim=64, feature_encoder={**spec, "dim": 64}, **base)
    with pytest.raises(CheckpointError) as e:
        init_weights(build_model(pixels), _source_of(wide), "wide.pt")
    msg = str(e.value)
    assert "image_proj.weight: checkpoint (16, 64), model (16, 32)" in msg and "\n" not in msg
    assert "image input 64-d tokens cached by tiny vs tiny pixels" in msg


def test_a_crafted_source_config_is_one_line(shards, source, tmp_path):  # noqa: F811
    ckpt = torch.load(source, weights_only=True)
    ckpt["config"]["model"]["feature_encoder"] = [1, 2]
    torch.save(ckpt, tmp_path / "crafted.pt")
    one_line_error(run(shards, tmp_path / "run", "--preset", "clip", "--steps", "1", "--init-from",
                       str(tmp_path / "crafted.pt")), "model.feature_encoder: expected a mapping")

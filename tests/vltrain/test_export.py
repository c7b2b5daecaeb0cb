"""`vltrain export`: the export rebuilds the checkpoint's model bit for bit without pickle, holds no training state,
records preprocessing, provenance and eval numbers, and its ONNX graphs match torch on batches of any size."""

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import vltrain
from tests.conftest import colour_pairs, tiny_checkpoint
from vltrain.checkpoint import load, model_config, model_from
from vltrain.errors import CheckpointError
from vltrain.exportfmt import EXPORT_DROPS, EXPORT_MODEL
from vltrain.cli import app
from vltrain.model import build_model, tokenizer_for

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "data.val_frac=0"]
ALBEF = ["model.queue_size=16", "model.momentum_m=0.9", "model.fusion_layers=1"]  # the tiny BERT: split 1 + 1
CAPTIONS = ["a red dog on the grass", "two cats", "a blue car next to a small house by the sea", "sun", "a boat"]
EVAL = {"n_samples": 12, "retrieval": {"i2t_r1": 25.0, "i2t_r5": 75.0, "i2t_r10": 100.0, "t2i_r1": 16.67,
                                       "t2i_r5": 66.67, "t2i_r10": 100.0, "mean_recall": 63.89, "ranks": [1, 2]},
        "zeroshot": {"top1": 50.0, "top5": 100.0, "mean_per_class": 50.0, "classes": 4, "samples": 6,
                     "confusions": [{"true": "cat", "predicted": "dog", "count": 1}]}}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def ok(r):
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def one_line_error(r, pattern: str):
    assert r.exit_code == 2, r.output + repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert re.search(pattern, lines[0]), lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """12 pairs in 3 shards, and a clip and an albef run (momentum copy, queues, fusion encoder) of 2 steps each;
    an eval.json beside the albef run's checkpoint."""
    tmp = tmp_path_factory.mktemp("export")
    found = {"shards": colour_pairs(tmp, 12), "images": sorted((tmp / "src").glob("*.png"))}
    for preset, extra in (("clip", []), ("albef", ALBEF)):
        sets = [x for s in TINY + extra for x in ("--set", s)]
        ok(invoke("run", tmp / "ds", "--out", tmp / preset, "--preset", preset, "--steps", 2, "--batch-size", 4,
                  "--device", "cpu", *sets))
        found[preset] = tmp / preset / "last.pt"
    (tmp / "albef" / "eval.json").write_text(json.dumps(EVAL))
    return found


def exported(runs, preset: str, tmp_path: Path, *args) -> Path:
    out = tmp_path / f"{preset}-export"
    r = ok(invoke("export", runs[preset], out, *args))
    assert f"wrote {out}/" in r.output
    return out


def embeddings(net, images, ids, mask):
    with torch.no_grad():
        return net.encode_image(images)[1], net.encode_text(ids, mask)[1]


@pytest.mark.parametrize("preset", ["clip", "albef"])
def test_the_export_rebuilds_the_checkpoints_model_bit_for_bit(runs, tmp_path, preset):
    out = exported(runs, preset, tmp_path)
    ckpt, exp = load(runs[preset]), load(out)
    assert exp["export"] is True and exp["step"] == ckpt["step"] == 2 and exp["config"] == ckpt["config"]
    a, b = model_from(ckpt, runs[preset]).eval(), model_from(exp, out).eval()
    assert b.momentum is None and not hasattr(b, "image_queue")  # no EMA copy or queues, rather than random ones
    images = torch.randn(3, 3, 32, 32)
    tok = tokenizer_for("tiny")(CAPTIONS[:3], padding="longest", return_tensors="pt")
    for x, y in zip(embeddings(a, images, tok["input_ids"], tok["attention_mask"]),
                    embeddings(b, images, tok["input_ids"], tok["attention_mask"])):
        assert torch.equal(x, y)
    if preset == "albef":  # the fusion encoder and ITM head too (the MLM decoder's tie is restored)
        assert b.mlm_decoder.weight is b.text_encoder.get_input_embeddings().weight
        model_c, model_e = vltrain.load(runs[preset], device="cpu"), vltrain.load(out, device="cpu")
        pics = runs["images"][:3]
        assert torch.equal(model_c.match(pics, CAPTIONS[:3]), model_e.match(pics, CAPTIONS[:3]))
        assert torch.equal(model_c.encode_images(pics), model_e.encode_images(pics)) and model_e.step == 2


def test_the_export_holds_no_optimiser_queues_momentum_or_rng(runs, tmp_path):
    out = exported(runs, "albef", tmp_path)
    ckpt = torch.load(runs["albef"], weights_only=True)
    assert {"optimizer", "rng", "sampler"} <= set(ckpt) and "image_queue" in ckpt["model"]
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert not [k for k in keys if k.startswith(EXPORT_DROPS)]
    assert not [k for k in keys if "queue" in k or k.startswith("momentum")]
    # exactly what the model an export rebuilds has, less the tied decoder weight stored once
    meta = json.loads((out / "config.json").read_text())
    ours = build_model(model_config({**ckpt["config"]["model"], **EXPORT_MODEL}, "x")).state_dict()
    assert keys | set(meta["tied"]) == set(ours) and set(meta["tied"]) == {"mlm_decoder.weight"}
    # what is left out is the EMA copy and the queues, nothing else
    dropped = set(ckpt["model"]) - set(ours)
    assert dropped == {k for k in ckpt["model"] if k.startswith(EXPORT_DROPS)}
    assert {"image_queue", "text_queue", "queue_ptr"} < dropped and any(k.startswith("momentum.") for k in dropped)
    assert meta["dropped"]["tensors"] == len(dropped)

    def keys_of(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from keys_of(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from keys_of(v)

    # no optimiser or RNG state anywhere (config.sampler is the sampler's config, not the run's sampler state)
    assert not {"optimizer", "rng", "ranks", "curriculum_log", "consumed"} & set(keys_of(meta))
    assert not {"sampler", "epoch", "best", "model"} & set(meta)


def test_config_json_readme_and_tokenizer(runs, tmp_path):
    out = exported(runs, "albef", tmp_path)
    meta = json.loads((out / "config.json").read_text())
    ckpt = load(runs["albef"])
    assert meta["format"] == "vltrain-export" and meta["version"] == 1 and meta["config"] == ckpt["config"]
    pre = meta["preprocessing"]
    old = ("image_input", "image_size", "mean", "std", "resize", "max_len")  # the keys of earlier exports, unchanged
    assert {k: pre[k] for k in old} == {"image_input": "pixels", "image_size": 32, "mean": [0.5] * 3,
                                        "std": [0.5] * 3, "resize": "shorter side then centre crop", "max_len": 12}
    assert (pre["interpolation"], pre["antialias"], pre["channel_order"], pre["layout"], pre["dtype"]) == \
        ("bilinear", True, "RGB", "NCHW", "float32")
    assert (pre["tokenizer_files"], pre["padding"], pre["pad_token"], pre["pad_id"], pre["max_length"]) == \
        ("tokenizer", "longest", "[PAD]", 0, 12)
    assert meta["tokenizer"] == "tiny" and meta["feature_encoder"] is None
    src = meta["source"]
    assert src["step"] == 2 and src["preset"] == "albef" and src["data"] == ckpt["data"] and len(src["data"]) > 8
    assert src["checkpoint"] == str(runs["albef"].resolve())
    assert meta["eval"]["retrieval"]["mean_recall"] == 63.89 and "ranks" not in meta["eval"]["retrieval"]
    assert meta["eval"]["zeroshot"]["top1"] == 50.0 and "confusions" not in meta["eval"]["zeroshot"]
    assert json.loads((exported(runs, "clip", tmp_path) / "config.json").read_text())["eval"] is None

    from transformers import AutoTokenizer  # the export tokenises without vltrain

    theirs = AutoTokenizer.from_pretrained(str(out / "tokenizer"), local_files_only=True)
    assert theirs(CAPTIONS)["input_ids"] == tokenizer_for("tiny")(CAPTIONS)["input_ids"]
    readme = (out / "README.md").read_text()
    for fact in ("`albef` preset", "16-dimensional", "1 fusion layer", "2 steps", src["data"], "63.89",
                 "vltrain.load("):
        assert fact in readme, fact


def test_an_export_is_read_without_pickle(runs, tmp_path, monkeypatch):
    out = exported(runs, "albef", tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("unpickler used")

    for target, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, refuse)
    ckpt = load(out)
    assert all(torch.is_tensor(v) for v in ckpt["model"].values())
    assert model_from(ckpt, out) is not None


def ort_session(path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("preset", ["clip", "albef"])
def test_onnx_graphs_match_torch_on_dynamic_batches(runs, tmp_path, preset):
    pytest.importorskip("onnxruntime")
    out = exported(runs, preset, tmp_path, "--onnx")
    meta = json.loads((out / "config.json").read_text())
    assert meta["onnx"]["image"]["input"]["name"] == "pixels" and max(meta["onnx"]["max_abs_diff"].values()) < 1e-4
    model = vltrain.load(out, device="cpu")
    image, text = ort_session(out / "image_encoder.onnx"), ort_session(out / "text_encoder.onnx")
    assert [i.name for i in image.get_inputs()] == ["pixels"]
    assert [i.name for i in text.get_inputs()] == ["input_ids", "attention_mask"]
    for n in (3, 5):
        pics, captions = runs["images"][:n], CAPTIONS[:n]
        pixels = model.pixels(pics)  # the eval transform's float32 (B, 3, S, S)
        tok = model.tokens(captions)  # lengths differ: padded, attention mask with zeros
        got_image = image.run(None, {"pixels": pixels.numpy()})[0]
        got_text = text.run(None, {k: v.numpy().astype(np.int64) for k, v in tok.items()})[0]
        assert got_image.shape == got_text.shape == (n, 16)
        assert np.abs(got_image - model.encode_images(pics).numpy()).max() < 1e-4
        assert np.abs(got_text - model.encode_texts(captions).numpy()).max() < 1e-4


def test_a_features_model_exports_an_image_graph_over_its_tokens(tmp_path):
    pytest.importorskip("onnxruntime")
    ckpt = tiny_checkpoint(tmp_path / "feat.pt", image_model="features")
    out = tmp_path / "feat-export"
    ok(invoke("export", ckpt, out, "--onnx"))
    meta = json.loads((out / "config.json").read_text())
    assert meta["preprocessing"]["image_input"] == "tokens" and meta["preprocessing"]["mean"] is None
    assert meta["onnx"]["image"]["input"] == {"name": "tokens", "dtype": "float32", "shape": ["batch", "tokens", 8]}
    # no record of the encoder: the tokens graph is the only image graph, and nothing describes pixels
    assert "image_tokens" not in meta["onnx"] and not (out / "image_tokens_encoder.onnx").exists()
    assert meta["preprocessing"]["interpolation"] is None and meta["preprocessing"]["max_length"] == 12
    assert "tokens only (the export has no record of their encoder" in (out / "README.md").read_text()
    net = model_from(load(out), out).eval()
    image = ort_session(out / "image_encoder.onnx")
    for n, tokens in ((3, 4), (5, 7)):
        x = torch.randn(n, tokens, 8)
        with torch.no_grad():
            want = net.encode_image(x)[1].numpy()
        assert np.abs(image.run(None, {"tokens": x.numpy()})[0] - want).max() < 1e-4


def test_a_features_models_pixel_graph_needs_its_encoders_weights(tmp_path):
    pytest.importorskip("onnxruntime")
    from vltrain.config import Config, DataConfig, ModelConfig, to_dict

    weights = tmp_path / "resnet18.pt"
    spec = {"encoder": "torchvision:resnet18", "weights": str(weights), "weights_sha256": "0" * 16, "size": 64,
            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "tokens": 4, "dim": 512, "dtype": "float16"}
    mc = ModelConfig(text_model="tiny", image_model="features", feature_dim=512, feature_encoder=spec, embed_dim=16,
                     fusion_layers=0)
    ckpt = tmp_path / "feat.pt"
    torch.save({"model": build_model(mc).state_dict(),
                "config": to_dict(Config(model=mc, data=DataConfig(image_size=32, max_len=12)))}, ckpt)
    # the weights file is gone: the pixels graph cannot be built, in one line; without --onnx nothing needs it
    one_line_error(invoke("export", ckpt, tmp_path / "out", "--onnx"),
                   r"resnet18\.pt, which is missing; the ONNX image graph holds that encoder: restore its weights, or "
                   r"export without --onnx$")
    assert not (tmp_path / "out" / "config.json").exists()
    ok(invoke("export", ckpt, tmp_path / "out"))


def test_the_export_folder_is_refused_or_replaced_as_it_should(runs, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_error(invoke("export", runs["clip"], out), r"not empty and is not a vltrain export.*--overwrite")
    ok(invoke("export", runs["clip"], out, "--overwrite"))
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").exists()
    # a previous export (of another checkpoint: with --overwrite) is replaced, and files of the earlier one that this
    # one lacks go
    again = exported(runs, "clip", tmp_path, "--onnx")
    ok(invoke("export", runs["albef"], again, "--overwrite"))
    assert not (again / "image_encoder.onnx").exists()
    assert json.loads((again / "config.json").read_text())["source"]["preset"] == "albef"
    one_line_error(invoke("export", runs["clip"], again / "config.json"), r"is a file")


def test_a_failed_export_is_no_complete_export(runs, tmp_path, monkeypatch):
    import vltrain.export as export_mod

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "write_onnx", broken)
    out = tmp_path / "half"
    with pytest.raises(OSError):
        export_mod.export(runs["clip"], out, onnx=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # written beside OUT, swapped in only when complete
    monkeypatch.undo()
    out.mkdir()  # an unfinished export (an older vltrain wrote in place): refused on load, replaced on export
    (out / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"not a complete vltrain export \(no config.json"):
        load(out)
    ok(invoke("export", runs["clip"], out))  # an unfinished export is a previous export: exported again
    assert load(out)["export"] is True


def test_damaged_exports_and_other_folders_are_one_line_errors(runs, tmp_path):
    out = exported(runs, "clip", tmp_path)
    weights, config = (out / "model.safetensors").read_bytes(), (out / "config.json").read_text()
    (out / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    r = invoke("eval", out, runs["shards"], "--device", "cpu", "--out", tmp_path / "e.json")
    one_line_error(r, r"model.safetensors: not a readable safetensors file \(truncated or corrupt")
    (out / "model.safetensors").write_bytes(weights)
    (out / "config.json").write_text(config[:len(config) // 2])
    with pytest.raises(CheckpointError, match=r"config.json: not readable JSON"):
        load(out)
    (out / "config.json").write_text(json.dumps({**json.loads(config), "version": 2}))
    with pytest.raises(CheckpointError, match=r"newer vltrain \(export version 2"):
        load(out)
    (out / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))  # a Hugging Face folder
    with pytest.raises(CheckpointError, match=r"is a folder, and its config.json is not a vltrain export's"):
        load(out)
    (out / "config.json").write_text(config)
    (out / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no model.safetensors"):
        load(out)
    with pytest.raises(CheckpointError, match=r"is a folder, not a checkpoint file"):  # as before exports
        load(runs["clip"].parent / "tb")


def test_eval_reads_an_export_and_resume_refuses_one(runs, tmp_path):
    out = exported(runs, "albef", tmp_path)
    scores = {}
    for name, path in (("ckpt", runs["albef"]), ("export", out)):
        ok(invoke("eval", path, runs["shards"], "--device", "cpu", "--itm-rerank-k", 4, "--out",
                  tmp_path / f"{name}.json"))
        result = json.loads((tmp_path / f"{name}.json").read_text())
        scores[name] = (result["retrieval"], result["itm_rerank"]["mean_recall"])
    assert scores["export"] == scores["ckpt"]
    # --resume reads OUT/last.pt: an export has none (and no optimiser state to resume), and --resume does not start
    # a run in it as it starts one in an OUT without a checkpoint
    sets = [x for s in TINY + ALBEF for x in ("--set", s)]
    r = invoke("run", runs["shards"], "--out", out, "--preset", "albef", "--steps", 4, "--batch-size", 4,
               "--device", "cpu", "--resume", *sets)
    one_line_error(r, r"--resume: .* is a `vltrain export` folder and holds no last\.pt")
    assert not (out / "last.pt").exists() and not (out / "metrics.jsonl").exists()

"""vltrain on `vlprep features` output: detected without flags, never mixed, and checkpoints that also read pixels."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from vlprep.encoders import features_spec
from vlprep.features import FeaturesConfig, features
from vlprep.shards import ShardsConfig, build_shards
from vltrain.checkpoint import load_checkpoint
from vltrain.cli import app
from vltrain.config import DataConfig
from vltrain.evaluate import embed_split, reads_features

TINY_TEXT = ["model.text_model=tiny", "model.embed_dim=16", "data.workers=0", "data.max_len=12", "log_every=1",
             "optim.warmup_steps=2", "optim.lr=0.01"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """24 pairs as pixels, the same as 64 px EfficientNet-Lite0 features (2x2 tokens), and 96 px features (3x3)."""
    tmp = tmp_path_factory.mktemp("feat")
    src = tmp / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        colour = rng.integers(0, 255, 3)
        img = np.clip(colour + rng.integers(-30, 30, (80, 80, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(src / f"{i:03d}.png")
        (src / f"{i:03d}.txt").write_text(f"thing {i} in colour {i % 6}")
    build_shards(ShardsConfig(src=src, out=tmp / "pix", samples_per_shard=8, workers=1))
    features(FeaturesConfig(src=tmp / "pix", out=tmp / "f64", size=64, device="cpu", decode_threads=0))
    features(FeaturesConfig(src=tmp / "pix", out=tmp / "f96", size=96, device="cpu", decode_threads=0))
    out = tmp / "run"
    r = CliRunner().invoke(app, ["run", str(tmp / "f64"), "--preset", "clip", "--steps", "6", "--batch-size", "6",
                                 "--device", "cpu", "--out", str(out), *[a for s in TINY_TEXT for a in ("--set", s)]])
    assert r.exit_code == 0, r.output
    return {"tmp": tmp, "pix": tmp / "pix", "f64": tmp / "f64", "f96": tmp / "f96", "run": out, "output": r.output}


def test_trainer_detects_features_and_records_their_encoder(world):
    spec = features_spec(world["f64"])
    assert "image    cached efficientnet-lite0 tokens 4x1280 float16" in world["output"]
    ck = torch.load(world["run"] / "last.pt", weights_only=True)
    assert ck["config"]["data"]["input"] == "features"
    m = ck["config"]["model"]
    assert m["image_model"] == "features" and m["feature_dim"] == 1280 and m["feature_encoder"] == spec


def test_feature_trained_checkpoint_reads_pixels_through_the_same_encoder(world):
    model, cfg = load_checkpoint(world["run"] / "last.pt")
    assert reads_features(model, [str(world["f64"])]) and not reads_features(model, [str(world["pix"])])
    assert not reads_features(model, [str(world["f96"])])  # another encoder's tokens: its pixels are used
    dev = torch.device("cpu")
    args = ("train", DataConfig(val_frac=0.0, max_len=12, image_size=224, workers=0), 8, dev)
    a = embed_split(model, [str(world["f64"])], *args, use_features=True)
    b = embed_split(model, [str(world["pix"])], *args, use_features=False)
    assert a["captions"] == b["captions"]
    # The pixel route rounds the encoder's tokens to float16 as the cache does; oneDNN may pick other kernels for
    # other batch shapes at 64 px, so allow a last-bit float16 difference.
    assert torch.allclose(a["img"], b["img"], atol=2e-3) and torch.equal(a["txt"], b["txt"])
    # vltrain eval on either dataset gives the same table.
    results = {}
    for name in ("f64", "pix"):
        r = CliRunner().invoke(app, ["eval", str(world["run"] / "last.pt"), str(world[name]), "--out",
                                     str(world["tmp"] / f"{name}.json")])
        assert r.exit_code == 0, r.output
        results[name] = json.loads((world["tmp"] / f"{name}.json").read_text())
    assert results["f64"]["input"] == "features" and results["pix"]["input"] == "pixels"
    assert results["f64"]["retrieval"] == results["pix"]["retrieval"]
    # vlprep embed on the pixel shards takes the same route.
    from vlprep.embed import EmbedConfig, embed, load_embeddings
    from vltrain.checkpoint_encoder import CheckpointEncoder

    embed(EmbedConfig(src=world["pix"], out=world["tmp"] / "emb", modality="image"),
          CheckpointEncoder(world["run"] / "last.pt", "cpu"))
    _, x = load_embeddings(world["tmp"] / "emb")
    assert np.allclose(x, a["img"].numpy(), atol=2e-3)


def test_mixing_inputs_or_encoders_is_one_line(world, tmp_path):
    base = ["--preset", "clip", "--steps", "1", "--batch-size", "4", "--device", "cpu",
            *[a for s in TINY_TEXT for a in ("--set", s)]]
    for folders, msg in (([world["f64"], world["pix"]], "cannot mix feature datasets"),
                         ([world["f64"], world["f96"]], "hold features of different encoders (size 64 vs 96)")):
        r = CliRunner().invoke(app, ["run", *map(str, folders), "--out", str(tmp_path / "x"), *base])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and msg in lines[0], r.output
    # data.input=pixels trains on the images of a features dataset.
    r = CliRunner().invoke(app, ["run", str(world["f64"]), "--out", str(tmp_path / "p"), *base,
                                 "--set", "data.input=pixels", "--set", "model.image_model=tiny",
                                 "--set", "data.image_size=32"])
    assert r.exit_code == 0 and "image    tiny on 32px pixels" in r.output, r.output


def test_bow_on_features_keeps_the_cached_tokens_trainable(world, tmp_path):
    """`vlprep bow` on a features dataset copies the npy members, so its meta.json carries the features record and
    vltrain reads the tokens, not pixels (before, the BoW copy silently trained the image tower on pixels)."""
    from vlprep.bow import BowConfig, bow

    bow(BowConfig(src=world["f64"], out=tmp_path / "bow", ops="shuffle,keep:2", workers=1))
    assert features_spec(tmp_path / "bow") == features_spec(world["f64"])
    bow(BowConfig(src=world["pix"], out=tmp_path / "bow-pix", ops="shuffle,keep:2", workers=1))
    assert features_spec(tmp_path / "bow-pix") is None
    r = CliRunner().invoke(app, ["run", str(tmp_path / "bow"), "--preset", "clip", "--steps", "2", "--batch-size", "6",
                                 "--device", "cpu", "--out", str(tmp_path / "run"),
                                 *[a for s in TINY_TEXT for a in ("--set", s)]])
    assert r.exit_code == 0, r.output
    assert "image    cached efficientnet-lite0 tokens 4x1280 float16" in r.output

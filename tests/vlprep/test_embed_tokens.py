"""vlprep embed (and filter's CLIP score) on a `vlprep features` dataset: the cached tokens are read when the
checkpoint was trained on the same encoder's tokens, with the same embeddings as its pixels."""

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import colour_pairs
from vlprep.embed import EmbedConfig, embed, load_embeddings
from vlprep.encoders import features_spec
from vlprep.features import FeaturesConfig, features
from vltrain.checkpoint_encoder import CheckpointEncoder

# The module's fixture (a features run, a checkpoint with a tiny text model) takes about 5 s on 2 cores.
pytestmark = pytest.mark.slow


def features_checkpoint(path, spec: dict, seed: int = 0, record: bool = True):
    """A random tiny model that reads `spec`'s tokens (image_model features + its feature_encoder, or no record of
    the encoder), in vltrain's checkpoint format."""
    from vltrain.config import Config, DataConfig, ModelConfig, to_dict
    from vltrain.model import build_model

    torch.manual_seed(seed)
    mc = ModelConfig(text_model="tiny", image_model="features", embed_dim=16, fusion_layers=0,
                     feature_dim=spec["dim"], feature_encoder=spec if record else {})
    torch.save({"model": build_model(mc).state_dict(),
                "config": to_dict(Config(model=mc, data=DataConfig(max_len=12, input="features")))}, path)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """10 pairs in 3 shards as pixels, the same through a random MobileNetV3-Small at 64 px (2 x 2 tokens, float16), a
    checkpoint trained on those tokens, and one whose record names other weights."""
    import torchvision

    tmp = tmp_path_factory.mktemp("embtok")
    pix = colour_pairs(tmp, 10)
    torch.manual_seed(0)
    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), tmp / "m.pt")
    features(FeaturesConfig(src=pix, out=tmp / "feat", image_model="torchvision:mobilenet_v3_small",
                            weights=tmp / "m.pt",
                            size=64, device="cpu", decode_threads=0))
    spec = features_spec(tmp / "feat")
    other = {**spec, "weights_sha256": "0" * 16}
    return {"tmp": tmp, "pix": pix, "feat": tmp / "feat", "spec": spec,
            "ckpt": features_checkpoint(tmp / "ckpt.pt", spec), "other": features_checkpoint(tmp / "other.pt", other),
            "norecord": features_checkpoint(tmp / "norecord.pt", spec, record=False)}


def run_embed(src, out, ckpt) -> tuple[dict, np.ndarray, list]:
    report = embed(EmbedConfig(src=src, out=out, modality="image", batch_size=4), CheckpointEncoder(ckpt, "cpu"))
    keys, x = load_embeddings(out)
    return report, x, keys


def test_the_token_path_equals_the_pixel_path_bit_for_bit(world):
    tok, a, keys_a = run_embed(world["feat"], world["tmp"] / "e-tok", world["ckpt"])
    pix, b, keys_b = run_embed(world["pix"], world["tmp"] / "e-pix", world["ckpt"])
    assert tok["image_input"] == {"tokens": 10, "pixels": 0} and pix["image_input"] == {"tokens": 0, "pixels": 10}
    assert keys_a == keys_b and a.shape == (10, 16)
    assert np.array_equal(a, b)
    meta = json.loads((world["tmp"] / "e-tok" / "meta.json").read_text())
    assert meta["options"]["image_input"] == "tokens"
    assert "image_input" not in json.loads((world["tmp"] / "e-pix" / "meta.json").read_text())["options"]


def test_the_token_path_is_the_model_on_the_stored_tokens(world):
    """An independent derivation: each sample's npy member through VLModel.encode_image, L2-normalised."""
    from vlprep.dataset import iter_samples
    from vltrain.checkpoint import load_checkpoint

    _, x, keys = run_embed(world["feat"], world["tmp"] / "e-tok2", world["ckpt"])
    model, _ = load_checkpoint(world["ckpt"])
    model.eval()
    stored = {s["__key__"]: np.load(io.BytesIO(s["npy"])) for s in iter_samples(world["feat"], decode=False)}
    assert {t.dtype for t in stored.values()} == {np.dtype(np.float16)}
    t = torch.from_numpy(np.stack([stored[k] for k in keys])).float()
    # embed's batches: per shard of 4, 4 and 2 samples, batches of 4 -> rows [0:4], [4:8], [8:10] (the same shapes,
    # so the same float sums)
    with torch.no_grad():
        want = np.concatenate([model.encode_image(t[i:i + 4])[1].numpy() for i in (0, 4, 8)])
    want = want / np.maximum(np.linalg.norm(want, axis=1, keepdims=True), 1e-12)
    assert want.dtype == np.float32 and np.array_equal(x, want)


def test_which_path_is_a_match_of_the_encoder_record(world):
    enc = CheckpointEncoder(world["ckpt"], "cpu")
    spec = world["spec"]
    assert enc.reads_tokens(spec) and not enc.reads_tokens(None)
    assert enc.reads_tokens({**spec, "weights": "/elsewhere/m.pt"})  # the bytes (sha256) name the weights
    for k, v in (("encoder", "torchvision:resnet34"), ("weights_sha256", "0" * 16), ("size", 96),
                 ("mean", [0.5] * 3), ("std", [0.5] * 3), ("tokens", 9), ("dim", 256)):
        assert not enc.reads_tokens({**spec, k: v}), k


def test_a_checkpoint_with_no_encoder_record_reads_tokens_of_its_width_and_refuses_pixels(world, tmp_path):
    from vlprep import VlprepError

    enc = CheckpointEncoder(world["norecord"], "cpu")
    assert enc.reads_tokens(world["spec"]) and not enc.reads_tokens({**world["spec"], "dim": 7})
    report, x, _ = run_embed(world["feat"], tmp_path / "t", world["norecord"])
    assert report["image_input"] == {"tokens": 10, "pixels": 0} and x.shape == (10, 16)
    with pytest.raises(VlprepError, match="reads precomputed features"):
        run_embed(world["pix"], tmp_path / "p", world["norecord"])
    assert not (tmp_path / "p").exists()  # refused before anything is written


def test_another_encoder_record_falls_back_to_pixels(world):
    """A checkpoint whose recorded encoder has other weights embeds the features dataset from its images."""
    enc = CheckpointEncoder(world["other"], "cpu")
    assert not enc.reads_tokens(world["spec"])
    # its recorded weights are not the file's: the pixel path cannot rebuild the encoder (a one-line error)
    from vlprep import VlprepError

    with pytest.raises(VlprepError, match="sha256"):
        run_embed(world["feat"], world["tmp"] / "e-other", world["other"])


def test_a_sample_without_tokens_takes_the_pixel_path(world, tmp_path):
    """Samples that lack the `npy` member (here: one shard rewritten without them) are decoded and counted."""
    import shutil

    from vlprep.dataset import iter_tar, open_dataset
    from vlprep.output import Out, write_shard

    ds = tmp_path / "mixed"
    shutil.copytree(world["feat"], ds)
    shard = open_dataset(ds).shards[0]
    samples = [{k: v for k, v in s.items() if k not in ("npy", "__url__")} for s in iter_tar(ds / shard)]
    side = pq.read_table(ds / shard.replace(".tar", ".parquet"))
    write_shard(Out(ds), shard, samples, side.to_pylist(), schema=side.schema.remove_metadata(), stats={})
    report, x, _ = run_embed(ds, tmp_path / "e", world["ckpt"])
    assert report["image_input"] == {"tokens": 10 - len(samples), "pixels": len(samples)}
    _, want, _ = run_embed(world["pix"], tmp_path / "p", world["ckpt"])
    assert np.array_equal(x, want)


def test_filter_clip_score_reads_the_tokens(world, tmp_path):
    from vlprep.filter import FilterConfig, filter_dataset

    cfg = FilterConfig(src=world["feat"], out=tmp_path / "f", clip_score_top=0.5, workers=1)
    filter_dataset(cfg, CheckpointEncoder(world["ckpt"], "cpu"))
    r = json.loads((tmp_path / "f" / "_embed" / "image" / "report.json").read_text())
    assert r["image_input"] == {"tokens": 10, "pixels": 0}

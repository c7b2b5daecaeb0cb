"""vlprep embed and the views of pseudolabel, with an encoder object (vltrain.checkpoint_encoder.CheckpointEncoder)."""

import hashlib

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.conftest import cli_in_process
from vlprep import VlprepError
from vlprep.dataset import iter_samples
from vlprep.embed import EmbedConfig, crop_seed, crop_views, embed, intact_captions
from vltrain.checkpoint_encoder import CheckpointEncoder


def test_embed_text_and_image(world, tmp_path, capfd):
    from vlprep.embed import EmbedConfig, embed, load_embeddings
    from vltrain.checkpoint import load_checkpoint

    encoder = CheckpointEncoder(world["ckpt"], "cpu")
    rep = embed(EmbedConfig(src=world["aligned"], out=tmp_path / "t", modality="text", batch_size=7), encoder)
    keys, x = load_embeddings(tmp_path / "t")
    assert keys == [f"al_{i:09d}" for i in range(40)] and x.shape == (40, 16) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
    model, cfg = load_checkpoint(world["ckpt"])
    from vltrain.model import build_tokenizer

    enc = build_tokenizer(model.cfg)(world["captions"][:5], padding="longest", return_tensors="pt")
    with torch.no_grad():
        ref = model.encode_text(enc["input_ids"], enc["attention_mask"])[1].numpy()
    np.testing.assert_allclose(x[:5], ref, atol=1e-5)
    assert rep["written"] == 40 and rep["dim"] == 16

    rep = embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "i", modality="image", batch_size=4), encoder)
    keys, x = load_embeddings(tmp_path / "i")
    assert len(keys) == 14 and x.shape == (14, 16) and rep["skipped"] == {}
    from vlprep.encoders import eval_transform
    from vlprep.dataset import decode_rgb

    first = next(iter_samples(world["unaligned"], decode=False))
    with torch.no_grad():
        ref = model.encode_image(eval_transform(32, model.image_mean, model.image_std)(decode_rgb(first["png"]))[None])[1]
    np.testing.assert_allclose(x[0], ref[0].numpy(), atol=1e-5)
    with pytest.raises(VlprepError, match="--modality must be image or text"):
        embed(EmbedConfig(src=world["aligned"], out=tmp_path / "z", modality="audio"), encoder)
    r = cli_in_process(capfd, "embed", world["aligned"], tmp_path / "z", "--checkpoint", tmp_path / "nope.pt", "--device", "cpu")
    assert r.returncode == 2 and "checkpoint not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_embed_resumes_per_shard(world, tmp_path):
    enc = CheckpointEncoder(world["ckpt"], "cpu")
    a = embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "a", batch_size=4), enc)
    assert a["shards_resumed"] == 0 and a["written"] == 14
    (tmp_path / "a" / "_parts" / "un-000001.parquet").unlink()  # as if stopped before that shard finished
    again = embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "a", batch_size=4), enc)
    assert again["shards_resumed"] == 2


@pytest.mark.slow  # two spawned worker processes, each importing torch and vltrain and loading the checkpoint
def test_workers_give_the_same_bytes(world, tmp_path):
    """(Split from the resume test, which runs inline in the fast tier: this half is the spawned pool's cost.) A
    resumed inline run (one shard redone) and a fresh run on two workers write the same bytes."""
    enc = CheckpointEncoder(world["ckpt"], "cpu")
    embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "a", batch_size=4), enc)
    (tmp_path / "a" / "_parts" / "un-000001.parquet").unlink()  # as if stopped before that shard finished
    assert embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "a", batch_size=4), enc)["shards_resumed"] == 2
    b = embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "b", batch_size=4, workers=2), enc)
    assert b["shards_resumed"] == 0
    for name in ("embeddings.npy", "keys.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_encoder_pickles_as_its_path_not_its_weights(world):
    import pickle

    enc = CheckpointEncoder(world["ckpt"], "cpu")
    blob = pickle.dumps(enc)
    assert len(blob) < 1000 and b"tensor" not in blob
    again = pickle.loads(blob)
    assert again.fingerprint == enc.fingerprint and again.dim == enc.dim == 16
    np.testing.assert_array_equal(again.texts(["a red dog"]), enc.texts(["a red dog"]))


def test_crops_depend_on_seed_and_key_only(world):
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    torch.manual_seed(123)
    a = crop_views(image, "k1", 3, 4, 16, 0.5)
    torch.manual_seed(999)  # the global RNG state does not matter, and it is left as it was
    state = torch.get_rng_state()
    b = crop_views(image, "k1", 3, 4, 16, 0.5)
    assert torch.equal(state, torch.get_rng_state())
    assert a.shape == (4, 16, 16, 3) and a.dtype == np.uint8 and (a == b).all()
    assert not (crop_views(image, "k2", 3, 4, 16, 0.5) == a).all()
    h = hashlib.blake2b(b"crop:3:k1", digest_size=8).digest()
    assert crop_seed(3, "k1") == int.from_bytes(h, "big") >> 1


def test_intact_captions_prefer_caption_raw():
    t = pa.table({"caption": ["dog red", "x"], "caption_raw": ["A red dog.", None]})
    assert intact_captions(t) == ["A red dog.", "x"]
    assert intact_captions(t, deformed=True) == ["dog red", "x"]
    assert intact_captions(t.drop_columns(["caption_raw"])) == ["dog red", "x"]


def test_a_features_model_cannot_embed_images(world, tmp_path):
    from tests.conftest import tiny_checkpoint

    enc = CheckpointEncoder(tiny_checkpoint(tmp_path / "f.pt", image_model="features"), "cpu")
    with pytest.raises(VlprepError, match="cannot embed images"):
        embed(EmbedConfig(src=world["unaligned"], out=tmp_path / "o"), enc)
    assert not (tmp_path / "o").exists()
    rep = embed(EmbedConfig(src=world["aligned"], out=tmp_path / "t", modality="text"), enc)
    assert rep["written"] == 40

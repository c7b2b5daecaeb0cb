"""`vltrain eval --itm-rerank-k`'s ITM scorer fuses each chunk's distinct images once (VLModel.fuse's image_rows):
its match logits equal those of fusing every pair's own copy of its image tokens, the path it took before.

The re-derivation below is that path: index the image tokens per pair, fuse without image_rows. The two differ only
in image_to_text and the key/value projections running as matmuls over the distinct images instead of over the pairs,
which a BLAS may sum in another order: in float64 that moves a logit by ~1e-15 (tests/vltrain/test_fusion_kv.py
derives 1e-12 for these 2-layer 32-wide models). The scorer hands back float32 (itm_rerank's scores), so two float64
logits 1e-12 apart may round to neighbouring float32 values: one float32 step, at most 2^-23 of the value, plus that
1e-12.
"""

import json

import pytest
import torch

from tests.conftest import colour_pairs
from vltrain import evaluate
from vltrain.config import ModelConfig
from vltrain.evaluate import _itm_scorer, itm_rerank
from vltrain.losses import upcast
from vltrain.model import autocast, build_model

ONE_FLOAT32_STEP = dict(rtol=2.0 ** -23 + 1e-12, atol=1e-12)


def repeated_rows_scorer(model, emb: dict, dev):
    """The scorer before image_rows: each pair fuses its own copy of its image's tokens."""

    def itm_score(img_idx, txt_idx):
        mask = emb["mask"][txt_idx]
        length = int(mask.sum(dim=1).max())
        with autocast(dev):
            fused = model.fuse(emb["hidden"][txt_idx, :length].to(dev), mask[:, :length].to(dev),
                               emb["tokens"][img_idx].to(dev))
            return upcast(model.itm_logits(fused)[:, 1]).float().cpu()

    return itm_score


def tiny_fusion_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=2)).eval()


def cached(model, n_img: int, n_txt: int, seed: int = 0) -> dict:
    """embed_split's keep_fusion part for random inputs: image tokens (n_img, n, D), text states with ragged masks."""
    g = torch.Generator().manual_seed(seed)
    L = 10
    with torch.no_grad():
        tokens, _ = model.encode_image(torch.randn(n_img, 3, 32, 32, generator=g))
    mask = (torch.arange(L) < torch.randint(2, L + 1, (n_txt, 1), generator=g)).long()
    return {"tokens": tokens, "hidden": torch.randn(n_txt, L, 32, generator=g), "mask": mask}


@pytest.mark.parametrize("groups", [0, 2])
def test_the_shared_image_scorer_equals_fusing_each_pairs_own_image_float64(default_float64, groups):
    model = tiny_fusion_model()
    model.set_unpad(groups)
    emb = cached(model, 7, 21)
    g = torch.Generator().manual_seed(1)
    img_idx = torch.randint(0, 7, (40,), generator=g).sort().values  # itm_rerank's chunks: sorted by image
    txt_idx = torch.randint(0, 21, (40,), generator=g)
    dev = torch.device("cpu")
    with torch.no_grad():
        new = _itm_scorer(model, emb, dev)(img_idx, txt_idx)
        old = repeated_rows_scorer(model, emb, dev)(img_idx, txt_idx)
        unsorted = _itm_scorer(model, emb, dev)(img_idx.flip(0), txt_idx.flip(0))  # any order of the pairs
    assert new.dtype == torch.float32 and new.shape == (40,)
    torch.testing.assert_close(new, old, **ONE_FLOAT32_STEP)
    torch.testing.assert_close(unsorted.flip(0), old, **ONE_FLOAT32_STEP)
    assert old.std() > 1e-3  # the logits differ between pairs: a pair fused with another image would show


def test_a_rerank_with_the_shared_image_scorer_equals_the_repeated_rows_one_float64(default_float64):
    """itm_rerank's whole path (top-k pairs, chunks of 16) over both scorers: the same re-ranked score matrices."""
    model = tiny_fusion_model(seed=2)
    emb = cached(model, 9, 27, seed=3)
    sim = torch.randn(9, 27, generator=torch.Generator().manual_seed(4))
    dev = torch.device("cpu")
    with torch.no_grad():
        new = itm_rerank(sim, 5, _itm_scorer(model, emb, dev), batch=16)
        old = itm_rerank(sim, 5, repeated_rows_scorer(model, emb, dev), batch=16)
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(a, b, **ONE_FLOAT32_STEP)


@pytest.fixture(scope="module")
def fusion_checkpoint(tmp_path_factory):
    """A random tiny model with a 2-layer fusion encoder in vltrain's checkpoint format, and 12 pairs in 3 shards."""
    from vltrain.config import Config, DataConfig, to_dict

    tmp = tmp_path_factory.mktemp("itm-shared")
    model = tiny_fusion_model(seed=5)
    torch.save({"model": model.state_dict(), "config": to_dict(Config(model=model.cfg, data=DataConfig(
        image_size=32, max_len=12)))}, tmp / "best.pt")
    return tmp / "best.pt", colour_pairs(tmp, 12)


def test_vltrain_eval_itm_rerank_is_unchanged(fusion_checkpoint, monkeypatch, tmp_path):
    """`vltrain eval --itm-rerank-k 4` of a tiny float32 checkpoint: the same re-ranked recalls and pair count as
    with the repeated-rows scorer (recalls are ranks: a float32 rounding difference changes one only on a tie)."""
    from typer.testing import CliRunner

    from vltrain.cli import app

    ckpt, shards = fusion_checkpoint
    results = {}
    for name in ("shared", "repeated"):
        if name == "repeated":
            monkeypatch.setattr(evaluate, "_itm_scorer", repeated_rows_scorer)
        out = tmp_path / f"{name}.json"
        r = CliRunner().invoke(app, ["eval", str(ckpt), str(shards), "--device", "cpu", "--itm-rerank-k", "4",
                                     "--out", str(out)])
        assert r.exit_code == 0, r.output + repr(r.exception)
        results[name] = json.loads(out.read_text())
        for timing in ("seconds", "seconds_per_1k_images"):
            results[name]["itm_rerank"].pop(timing)
    assert results["shared"]["itm_rerank"]["pairs"] > 0
    assert results["shared"] == results["repeated"]

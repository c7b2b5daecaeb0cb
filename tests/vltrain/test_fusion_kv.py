"""VLModel.fuse's image_rows: the image tokens' cross-attention keys and values projected once per distinct image and
indexed per row give the numbers of fusing the images repeated per row (ITM's 3B rows over B images).

The re-derivation is the path the rows took before: index the image tokens per row, then fuse without image_rows.
The two do the same arithmetic on every row except that image_to_text and the key/value projections run as matmuls
over M images instead of R >= M rows, so a BLAS may block (and so sum) each dot product in another order. In float64
(u = 2^-53 ~ 1.1e-16) a dot product of D = 32 terms of size O(1) then moves by at most ~2 D u ~ 7e-15; the fusion
encoder (LayerNorms, softmax, a GELU feed-forward; 2 layers) and the loss carry that through a few tens of ops with
O(1) gains, so 1e-12 absolute and relative (~10^4 u) holds with room and still catches any real change (a row fused
with another row's image moves its outputs by O(1)). In float32 (u = 6e-8) the same count gives 1e-4 for the
outputs of the same O(1) size.
"""

import copy

import pytest
import torch

from tests.vltrain.test_fidelity import make_batch
from vltrain import step as step_mod
from vltrain.config import ModelConfig
from vltrain.config_load import load_config
from vltrain.model import VLModel, build_model, host_ends
from vltrain.objectives import matching
from vltrain.objectives.matching import hard_negatives

TOL64 = dict(rtol=1e-12, atol=1e-12)
TOL32 = dict(rtol=1e-4, atol=1e-4)
B = 6
CAPTIONS = [f"a photo of thing {i} and colour {i % 3}" + " with a dog" * (i % 2) for i in range(B)]


@pytest.fixture
def float64(default_float64):
    """Models and tensors built in float64 for the test's duration (tests/conftest.py's fixture)."""


def tiny_model(seed: int = 0) -> VLModel:
    torch.manual_seed(seed)
    return build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=2)).eval()


def inputs(model, rows: int, images: int, seed: int = 0):
    """Text hidden (rows, L, D) with a ragged mask, `images` distinct image tokens, and each row's image index."""
    g = torch.Generator().manual_seed(seed)
    L = 9
    hidden = torch.randn(rows, L, 32, generator=g)
    mask = (torch.arange(L) < torch.randint(2, L + 1, (rows, 1), generator=g)).long()
    tokens, _ = model.encode_image(torch.randn(images, 3, 32, 32, generator=g))
    index = torch.randint(0, images, (rows,), generator=g)
    index[:images] = torch.arange(images)  # every image read at least once
    return hidden, mask, tokens.detach(), index


@pytest.mark.parametrize("groups", [0, 2])
@pytest.mark.parametrize("maps", [False, True])
def test_fuse_with_image_rows_equals_fusing_each_rows_image_float64(float64, groups, maps):
    model = tiny_model()
    model.set_unpad(groups)
    hidden, mask, tokens, index = inputs(model, 3 * B, B)
    ends = mask.sum(dim=1).tolist()  # right-padded: the lengths are the row ends
    shared_tokens = tokens.clone().requires_grad_()
    copied_tokens = tokens.clone().requires_grad_()
    new = model.fuse(hidden, mask, shared_tokens, return_attn=maps, ends=ends, image_rows=index)
    old = model.fuse(hidden, mask, copied_tokens[index], return_attn=maps, ends=ends)
    new_x, new_maps = new if maps else (new, [])
    old_x, old_maps = old if maps else (old, [])
    keep = mask.bool()
    # the attended positions (past a row's mask the length groups leave what each group computed there)
    torch.testing.assert_close(new_x[keep], old_x[keep], **TOL64)
    for a, b in zip(new_maps, old_maps, strict=True):
        torch.testing.assert_close(a, b, **TOL64)
    # gradients: into the distinct images (each summed over the rows that read it) and every parameter
    loss = lambda x, m: (x[keep] ** 2).sum() + sum((p * p).sum() for p in m)
    g_new = torch.autograd.grad(loss(new_x, new_maps), [shared_tokens, *model.fusion.parameters(),
                                                        *model.image_to_text.parameters()])
    g_old = torch.autograd.grad(loss(old_x, old_maps), [copied_tokens, *model.fusion.parameters(),
                                                        *model.image_to_text.parameters()])
    for a, b in zip(g_new, g_old, strict=True):
        torch.testing.assert_close(a, b, **TOL64)


def test_fuse_with_image_rows_float32_and_patch_weights():
    model = tiny_model()
    hidden, mask, tokens, index = inputs(model, 2 * B, B, seed=1)
    keep = mask.bool()
    new = model.fuse(hidden, mask, tokens, image_rows=index)
    old = model.fuse(hidden, mask, tokens[index])
    torch.testing.assert_close(new[keep], old[keep], **TOL32)
    # SoftMask++'s per-row weights multiply the tokens before the projections: indexed first, nothing shared
    weights = torch.rand(2 * B, tokens.shape[1], generator=torch.Generator().manual_seed(2))
    new = model.fuse(hidden, mask, tokens, patch_weights=weights, image_rows=index)
    old = model.fuse(hidden, mask, tokens[index], patch_weights=weights)
    torch.testing.assert_close(new[keep], old[keep], **TOL32)
    # and a row's output does depend on which image it reads
    other = model.fuse(hidden, mask, tokens, image_rows=index.roll(1))
    assert (other[:, 0] - new[:, 0]).abs().amax() > 1e-3


def test_state_dict_is_unchanged():
    """The shared keys and values are a computation, not a module: a checkpoint's keys stay what they were."""
    model = tiny_model()
    names = [k for k in model.state_dict() if ".cross_attn." in k]
    assert names and all(k.rsplit(".", 2)[-2] in ("q", "k", "v", "o", "ln") for k in names)


PRESETS = {"albef-base": [], "albef": ["model.queue_size=16"], "grit": [], "softmask": ["model.queue_size=16"]}


@pytest.mark.slow  # 1-6 s a preset on 2 cores
@pytest.mark.parametrize("preset", list(PRESETS))
def test_training_step_losses_and_gradients_equal_the_repeated_rows(float64, monkeypatch, preset):
    """A whole training step (ITM's 3B rows, MLM, SoftMask++'s soft ITM reading ITM's maps) with the images shared
    and with them repeated per row: the same losses and gradients."""
    cfg = load_config(preset, sets=["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16",
                                    "data.max_len=16", "model.fusion_layers=1", *PRESETS[preset]])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.set_unpad(2)
    twin = copy.deepcopy(model)
    # The twin's ITM rows built as they were: B positives, caption i with its negative image, image i with its
    # negative caption, the image tokens copied per row (the negatives recorded as each step draws them)
    drawn = []
    monkeypatch.setattr(matching, "hard_negatives", lambda *a: drawn.append(hard_negatives(*a)) or drawn[-1])
    twin_fuse = twin.fuse

    def old_rows(text_hidden, text_mask, image_tokens, image_rows=None, **kw):
        if image_rows is not None:
            assert image_tokens.shape[0] == B
            image_tokens = torch.cat([image_tokens, image_tokens[drawn[-1][1]], image_tokens])
        return twin_fuse(text_hidden, text_mask, image_tokens, **kw)

    twin.fuse = old_rows
    batch = make_batch(CAPTIONS)
    batch["images"] = batch["images"].double()
    batch["text_ends"] = host_ends(batch["attention_mask"])
    seen = []
    fuse = model.fuse
    monkeypatch.setattr(model, "fuse", lambda *a, **k: seen.append(k.get("image_rows")) or fuse(*a, **k))
    torch.manual_seed(1)  # dropout draws the same masks in both
    new = step_mod.train_step(model, batch, cfg.loss, torch.Generator().manual_seed(3), None, 0.4)
    torch.manual_seed(1)
    old = step_mod.train_step(twin, batch, cfg.loss, torch.Generator().manual_seed(3), None, 0.4)
    assert any(r is not None and len(r) == 3 * B for r in seen)  # ITM's rows went through image_rows
    assert "itm_loss" in new and (preset != "softmask" or "softmask_itm_loss" in new)
    for k in new:
        if k != "queue_feats":
            torch.testing.assert_close(new[k], old[k], **TOL64, msg=f"{preset} {k}")
    new["total"].backward()
    old["total"].backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL64, msg=f"{preset} {name}")

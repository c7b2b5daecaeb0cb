"""SoftMask++: attention maps, Grad-CAM, word choice, the soft mask and its sources, masked features,
the soft ITM loss, MMDA (augment recipes, masked_text_all) and a tiny `softmask` run that resumes exactly.

Each formula is checked against a re-derivation written here: plain loops, a hand-written forward of one fusion
layer, finite differences.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vltrain import step as step_mod
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.layers import Attention, FusionLayer
from vltrain.losses import softmask_itm_loss
from vltrain.config import parse_source
from vltrain.softmask import attention_map, gradcam, masks_for, random_mask, sample_words, soft_mask

from tests.vltrain.test_fidelity import CAPTIONS, cfg_for, make_batch, model_for
from tests.vltrain.test_train import losses, run, shards  # noqa: F401  (the module-scoped shard fixture)


def run_step(model, batch, cfg, generator, **kw):
    """train_step with the loss config of a whole Config."""
    return step_mod.train_step(model, batch, cfg.loss, generator, **kw)


# --- attention maps ----------------------------------------------------------------------------------------------


def test_explicit_attention_path_matches_sdpa_in_float64():
    torch.manual_seed(0)
    att = Attention(16, 4, 1e-12, 0.0, 0.0).double().eval()
    x, ctx = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 7, 16, dtype=torch.float64)
    key_mask = torch.ones(3, 7, dtype=torch.bool)
    key_mask[1, 5:] = False
    fast = att(x, ctx, key_mask)
    slow, probs = att(x, ctx, key_mask, return_attn=True)
    assert torch.allclose(fast, slow, atol=1e-12)
    assert probs.shape == (3, 4, 5, 7) and torch.allclose(probs.sum(-1), torch.ones(3, 4, 5, dtype=torch.float64))
    assert probs[1, :, :, 5:].abs().max() == 0  # masked keys get no weight


def one_layer_fusion(seed: int = 0):
    """A 1-layer, 1-head fusion (FusionLayer) and an ITM head, in float64, eval mode (no dropout)."""
    torch.manual_seed(seed)
    layer = FusionLayer(8, 1, 16, 1e-12, 0.0, 0.0).double().eval()
    head = torch.nn.Linear(8, 2).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    image = torch.randn(2, 5, 8, dtype=torch.float64)
    text_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    return layer, head, x, image, text_mask


def s_of_probs(layer, head, x, image, text_mask, probs):
    """The re-derivation: the layer's forward written out by hand from the cross-attention probabilities on, and
    s+ = sum over the batch of softmax(ITM logits of [CLS])[match]."""
    xs = layer.self_attn(x, x, text_mask)
    ca = layer.cross_attn
    v = ca.v(image)  # (B, N, D), one head
    a = probs[:, 0] @ v  # (B, L, D)
    h = F.layer_norm(xs + ca.o(a), (8,), ca.ln.weight, ca.ln.bias, ca.ln.eps)
    out = F.layer_norm(h + layer.ffn_out(F.gelu(layer.ffn_in(h))), (8,), layer.ffn_ln.weight, layer.ffn_ln.bias,
                       layer.ffn_ln.eps)
    return head(out[:, 0]).softmax(dim=-1)[:, 1].sum(), a


def test_gradcam_gradient_matches_the_chain_rule_and_finite_differences():
    layer, head, x, image, text_mask = one_layer_fusion()
    out, probs = layer(x, text_mask, image, return_attn=True)
    s = head(out[:, 0]).softmax(dim=-1)[:, 1].sum()
    (g,) = torch.autograd.grad(s, [probs])  # what train_step takes: d s+ / d A

    # chain rule through a = A v: dS/dA[b, l, n] = sum_d dS/da[b, l, d] * v[b, n, d]
    p = probs.detach().clone()
    s_ref, a = s_of_probs(layer, head, x, image, text_mask, p)
    assert torch.allclose(s_ref, s.detach(), atol=1e-12)
    (ds_da,) = torch.autograd.grad(s_ref, [a])
    by_hand = torch.einsum("bld,bnd->bln", ds_da, layer.cross_attn.v(image)).unsqueeze(1)
    assert torch.allclose(g, by_hand, atol=1e-10)

    # central finite difference on one attention entry
    eps, idx = 1e-6, (1, 0, 2, 3)
    up, down = p.clone(), p.clone()
    up[idx] += eps
    down[idx] -= eps
    with torch.no_grad():
        fd = (s_of_probs(layer, head, x, image, text_mask, up)[0]
              - s_of_probs(layer, head, x, image, text_mask, down)[0]) / (2 * eps)
    assert float(g[idx]) == pytest.approx(float(fd), rel=1e-5, abs=1e-9)


def test_gradcam_is_the_mean_over_layers_and_heads_of_a_times_relu_g():
    torch.manual_seed(1)
    attns = [torch.rand(2, 3, 4, 5) for _ in range(2)]
    grads = [torch.randn(2, 3, 4, 5) for _ in range(2)]
    cam = gradcam(attns, grads)
    ref = torch.zeros(2, 4, 5)
    for b in range(2):
        for l_ in range(4):
            for n in range(5):
                terms = [attns[k][b, h, l_, n] * max(float(grads[k][b, h, l_, n]), 0.0)
                         for k in range(2) for h in range(3)]
                ref[b, l_, n] = sum(terms) / len(terms)
    assert torch.allclose(cam, ref, atol=1e-6)
    assert torch.allclose(attention_map(attns), torch.stack(attns).mean(dim=(0, 2)))


# --- word choice and the mask ------------------------------------------------------------------------------------


def test_sample_words_is_uniform_over_valid_tokens_and_never_padding():
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([sample_words(valid, g) for _ in range(3000)])  # (3000, 3)
    assert bool(valid[torch.arange(3), picks].all())
    for row, n in ((0, 3), (1, 5)):
        counts = torch.bincount(picks[:, row], minlength=5)[:n].float()
        assert (counts / 3000 - 1 / n).abs().max() < 0.04  # [CLS] (position 0) included
    assert bool((picks[:, 2] == 0).all())


def soft_mask_by_hand(row: list[float]) -> list[float]:
    """The rule re-derived in float64 Python, one row: min-max to w (a constant row: 0.5); if fewer than N / 2
    entries are positive, every positive one goes to 1; else bisect for the scale s with sum(min(s * w, 1)) = N / 2,
    on [0, 1 / min positive w] (where the sum is the positive count >= N / 2), down to a relative width of 1e-15."""
    n, lo, hi = len(row), min(row), max(row)
    if hi == lo:
        return [0.5] * n
    w = [(v - lo) / (hi - lo) for v in row]
    positive = [v for v in w if v > 0]
    if len(positive) <= n / 2:
        return [1.0 - (1.0 if v > 0 else 0.0) for v in w]
    a, b = 0.0, 1.0 / min(positive)
    while b - a > 1e-15 * b:
        mid = (a + b) / 2
        if sum(min(mid * v, 1.0) for v in w) < n / 2:
            a = mid
        else:
            b = mid
    return [1.0 - min(b * v, 1.0) for v in w]


def sum_tolerance(n: int) -> float:
    """How far sum(1 - M) may be from N / 2 in float32 (u = 2^-24, the unit roundoff): an unclipped weight is
    (N/2 - k) * (w / R_k) with R_k a suffix sum of at most N terms in [0, 1], so R_k is off by at most (N - 1) u R_k,
    the division adds u and the product another u: each unclipped weight is off by (N + 1) u relative and their
    sum, at most N / 2, by (N + 1) u N / 2. M = 1 - w rounds once more, 2^-25 per entry, N u / 2 in all (1 - M
    is exact again: M >= 1/2 there). Summed in float64 here, the test adds nothing. Twice the bound, for
    second-order terms."""
    u = 2.0 ** -24
    return 2 * ((n + 1) * u * n / 2 + n * u / 2)


def entry_tolerance(n: int) -> float:
    """Entrywise against the float64 derivation: the min-max in float32 puts each w off by up to 3 u relative (the
    subtraction, the span, the division), which moves R_k by 3 u relative too; with the (N + 1) u above and the
    2^-25 of 1 - M, each M is within (N + 5) u; twice that."""
    return 2 * (n + 5) * 2.0 ** -24


def gaussian_bump(sigma: float, centre=(3.0, 3.0), side: int = 7) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.arange(side, dtype=torch.float32), torch.arange(side, dtype=torch.float32),
                            indexing="ij")
    return torch.exp(-((yy - centre[0]) ** 2 + (xx - centre[1]) ** 2) / (2 * sigma ** 2)).reshape(1, -1)


def old_masked_total(cam: torch.Tensor) -> torch.Tensor:
    """What soft_mask masked before (rescale to N / 2, then clip), per row, in float64."""
    lo, hi = cam.min(-1, keepdim=True).values, cam.max(-1, keepdim=True).values
    w = ((cam - lo) / (hi - lo)).double()
    return (w * (cam.shape[-1] / 2) / w.sum(-1, keepdim=True)).clamp(0, 1).sum(-1)


def check_against_the_derivation(cams: torch.Tensor) -> torch.Tensor:
    """soft_mask(cams) entrywise against soft_mask_by_hand, its masked total against N / 2 (or the positive count
    of a degenerate row) within sum_tolerance; returns M."""
    n = cams.shape[-1]
    m = soft_mask(cams)
    assert m.dtype == torch.float32 and float(m.min()) >= 0 and float(m.max()) <= 1
    for i in range(cams.shape[0]):
        ref = soft_mask_by_hand(cams[i].double().tolist())
        assert m[i].tolist() == pytest.approx(ref, abs=entry_tolerance(n)), i
        row = cams[i]
        positive = int((row > row.min()).sum())
        want = n / 2 if positive > n / 2 or bool((row == row.min()).all()) else positive
        assert sum(1 - v for v in ref) == pytest.approx(want, abs=1e-12)  # the derivation reaches it
        assert float((1 - m[i]).double().sum()) == pytest.approx(want, abs=sum_tolerance(n)), i
    return m


def test_soft_mask_against_the_rule_by_hand():
    torch.manual_seed(2)
    cams = torch.cat([torch.rand(3, 10), torch.full((1, 10), 0.7), torch.tensor([[0.0] * 9 + [5.0]]),
                      torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])])
    m = soft_mask(cams.requires_grad_())
    assert not m.requires_grad
    check_against_the_derivation(cams.detach())
    assert m[3].tolist() == [0.5] * 10  # a constant row, exactly
    w = 1 - m
    assert w[4].tolist() == [0.0] * 9 + [1.0]  # [0,..,0,5]: one positive entry of 10, at 1; the row masks 1 < 5
    assert w[5].tolist() == pytest.approx([0.0] + [5 / 9] * 9)  # sum(w) = 9 > 5: scaled down, nothing clipped


def test_soft_mask_sums_to_half_the_patches_on_a_peaked_map():
    """Gaussian bumps on the 7 x 7 grid: rescale-then-clip masked 6.1 of 24.5 at sigma 0.5; now 24.5 exactly."""
    cams = torch.cat([gaussian_bump(s) for s in (0.5, 1.0, 1.5, 2.0)] + [gaussian_bump(0.7, (1.0, 5.0))])
    old = old_masked_total(cams)
    assert old.tolist() == pytest.approx([6.14, 14.38, 20.81, 23.40, old[4].item()], abs=0.01)
    assert float(old.max()) < 24
    m = check_against_the_derivation(cams)
    assert (1 - m[0]).max() == 1 and int(((1 - m[0]) == 1).sum()) > 1  # the peak and its neighbours saturate


def test_soft_mask_sums_to_half_the_patches_on_a_flat_map():
    for n in (49, 50, 1):
        m = check_against_the_derivation(torch.full((2, n), 3.25))
        assert m.tolist() == [[0.5] * n] * 2
    # nearly flat: every entry positive but the minimum, sum(w) > N / 2, scaled down below 1 and nothing clipped
    cams = torch.tensor([[1.0] * 48 + [0.0]]) + 1e-3 * torch.arange(49.0)
    check_against_the_derivation(cams)


def test_soft_mask_sums_to_half_the_patches_on_random_maps():
    g = torch.Generator().manual_seed(11)
    for n in (49, 50, 196, 7):
        uniform = torch.rand(4, n, generator=g)
        peaked = torch.rand(4, n, generator=g) ** 12
        heavy = torch.randn(4, n, generator=g).mul(2).exp()
        relu = torch.randn(4, n, generator=g).clamp(min=0) * torch.rand(4, n, generator=g)  # Grad-CAM's ReLU zeros
        ties = torch.randint(0, 4, (4, n), generator=g).float()
        check_against_the_derivation(torch.cat([uniform, peaked, heavy, relu, ties]))


def test_soft_mask_keeps_the_order_of_the_map():
    """A larger cam value never gets a larger M (equal values get equal M): M along the row sorted by cam is
    nonincreasing. Exact, with no tolerance: every step (min-max, the scale, the clip) is a monotone rounding."""
    g = torch.Generator().manual_seed(12)
    cams = torch.cat([torch.rand(8, 49, generator=g) ** 6, torch.randint(0, 5, (8, 49), generator=g).float(),
                      torch.cat([gaussian_bump(s) for s in (0.5, 1.0, 2.0)])])
    m = soft_mask(cams)
    order = cams.argsort(dim=-1)
    m_sorted, c_sorted = m.gather(1, order), cams.gather(1, order)
    assert bool((m_sorted[:, 1:] <= m_sorted[:, :-1]).all())
    same = c_sorted[:, 1:] == c_sorted[:, :-1]
    assert bool((m_sorted[:, 1:][same] == m_sorted[:, :-1][same]).all())


def test_soft_mask_degenerate_rows_mask_their_positive_entries():
    """Fewer than N / 2 entries above the row's minimum: no scale reaches N / 2, so every positive entry is 1, the
    zeros stay 0 and the row masks the count of positive entries; exactly N / 2 positive entries reach N / 2."""
    cams = torch.zeros(3, 49)
    cams[0, :9] = torch.arange(1.0, 10.0)
    cams[1, 3] = 1e-30  # one positive entry, tiny: still 1
    cams[2, :24] = torch.rand(24) + 0.1
    m = check_against_the_derivation(cams)
    w = 1 - m
    assert w[0].tolist() == [1.0] * 9 + [0.0] * 40
    assert w[1].sum().item() == 1.0 and w[1, 3].item() == 1.0
    assert w[2].sum().item() == 24.0  # 24 of the 24.5 it would need
    even = torch.zeros(1, 10)
    even[0, :5] = torch.tensor([0.1, 0.2, 0.3, 0.4, 1.0])
    assert (1 - soft_mask(even)).tolist() == [[1.0] * 5 + [0.0] * 5]  # p = N / 2 exactly: the target, reached


def test_soft_mask_keeps_float64_and_reads_any_float_dtype():
    """A float64 map gets a float64 mask (it came back rounded to float32 before); other dtypes get float32."""
    g = torch.Generator().manual_seed(13)
    cam = torch.rand(3, 49, generator=g, dtype=torch.float64) ** 4
    m64, m32 = soft_mask(cam), soft_mask(cam.float())
    assert m64.dtype == torch.float64 and m32.dtype == torch.float32
    assert soft_mask(cam.half()).dtype == torch.float32
    for i in range(3):
        assert m64[i].tolist() == pytest.approx(soft_mask_by_hand(cam[i].tolist()), abs=1e-13)
    assert float((1 - m64).sum(-1).sub(24.5).abs().max()) < 1e-12
    assert float((m64 - m32.double()).abs().max()) < entry_tolerance(49)  # the same mask to float32 rounding


def bisect_fill(w: torch.Tensor, total: float) -> torch.Tensor:
    """The water-filling by float64 bisection on the scale, rows at once: w (B, N) float64 -> clip(s w, 0, 1)."""
    positive = w > 0
    p = positive.sum(-1, keepdim=True)
    lo = torch.zeros_like(w[:, :1])
    hi = 1 / w.masked_fill(~positive, torch.inf).amin(-1, keepdim=True).clamp(min=1e-300)  # every positive at 1
    for _ in range(1100):  # halving from at most 1e300 down to a relative 1e-16 of s >= total / N
        mid = (lo + hi) / 2
        low = (mid * w).clamp(max=1).sum(-1, keepdim=True) < total
        lo, hi = torch.where(low, mid, lo), torch.where(low, hi, mid)
    return torch.where(p > total, (hi * w).clamp(max=1), positive.double())


def maps(n: int, g: torch.Generator) -> torch.Tensor:
    """Peaked, flat, sparse and heavy-tailed float32 maps of N entries, and ones with a tiny tail (the boundary)."""
    rows = [torch.rand(2, n, generator=g) ** 12, torch.full((1, n), 2.0), 1 + 1e-3 * torch.rand(1, n, generator=g),
            torch.randn(2, n, generator=g).clamp(min=0) * (torch.rand(2, n, generator=g) < 0.3),
            torch.randn(2, n, generator=g).mul(3).exp()]
    tail = torch.rand(2, n, generator=g) + 0.5
    tail[:, n // 2:] *= torch.tensor([[1e-10], [1e-6]])  # half the row tiny: the (N/2)-th breakpoint lands near N/2
    return torch.cat(rows + [tail])


def test_soft_mask_matches_a_float64_bisection_at_every_n():
    """N from 1 to 577, odd and even: soft_mask entrywise against the float64 bisection of the min-max'd float32 map
    (entry_tolerance: the min-max's 3 u plus the suffix sum's (N + 1) u), and its masked total against the
    bisection's (sum_tolerance). Before, the tiny-tail rows at even N masked nothing."""
    g = torch.Generator().manual_seed(21)
    for n in [1, 2, 3, 4, 7, 16, 49, 50, 196, 197, 576, 577]:
        cams = maps(n, g)
        m = soft_mask(cams)
        c = cams.double()
        lo, hi = c.min(-1, keepdim=True).values, c.max(-1, keepdim=True).values
        w = torch.where(hi > lo, (c - lo) / (hi - lo).clamp(min=1e-300), torch.full_like(c, 0.5))
        ref = torch.where(hi > lo, bisect_fill(w, n / 2), w)
        assert float(((1 - m.double()) - ref).abs().max()) <= entry_tolerance(n), n
        masked, want = (1 - m.double()).sum(-1), ref.sum(-1)
        assert float((masked - want).abs().max()) <= sum_tolerance(n), n


def test_soft_mask_masks_half_when_the_half_breakpoint_rounds_to_n_over_2():
    """Even N, the (N/2)-th breakpoint rounding to exactly N/2 in float32 with a tiny but positive rest: the scale
    came out 0 and the row masked nothing (M = 1 everywhere)."""
    assert soft_mask(torch.tensor([[1.0, 1.0, 1e-9, 0.0]]))[0].tolist() == pytest.approx([0, 0, 1, 1], abs=1e-8)
    yy, xx = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    bump = torch.exp(-(yy ** 2 + xx ** 2) / (2 * 0.3 ** 2)).reshape(1, -1)  # sigma 0.3 at a corner of 4 x 4
    assert float((1 - soft_mask(bump)).sum()) == pytest.approx(8.0, abs=sum_tolerance(16))
    g = torch.Generator().manual_seed(22)
    cams = torch.rand(2000, 196, generator=g) + 0.5
    cams[:, 98:] *= 1e-10
    masked = (1 - soft_mask(cams)).double().sum(-1)
    assert float((masked - 98).abs().max()) <= sum_tolerance(196)  # 1,788 of these rows masked nothing before


def test_soft_mask_reaches_half_with_subnormal_weights():
    """Float32-subnormal weights are reachable (the scale is large but finite): 24 entries at 1, one subnormal and
    24 zeros mask 24.5, not 24 (they were clamped to the smallest normal number, and the row fell short)."""
    cam = torch.zeros(1, 49)
    cam[0, :24] = 1.0
    cam[0, 24] = 1e-40  # float32 subnormal
    assert cam[0, 24].item() != 0 and cam[0, 24].item() < torch.finfo(torch.float32).tiny
    w = 1 - soft_mask(cam)
    assert float(w.double().sum()) == pytest.approx(24.5, abs=sum_tolerance(49))
    assert w[0, :24].tolist() == [1.0] * 24 and w[0, 24].item() == pytest.approx(0.5, abs=1e-6)


def test_random_mask_zeroes_round_r_n_tokens_per_row():
    g = torch.Generator().manual_seed(0)
    for ratio, zeros in ((0.3, 15), (0.5, 24)):
        n = 49 if ratio == 0.5 else 50
        m = random_mask(4, n, ratio, g)
        assert set(m.unique().tolist()) <= {0.0, 1.0}
        assert (m == 0).sum(dim=1).tolist() == [round(ratio * n)] * 4 == [zeros] * 4


def test_the_three_mask_sources():
    torch.manual_seed(3)
    attns = [torch.rand(2, 2, 4, 6).softmax(-1) for _ in range(2)]
    grads = [torch.randn(2, 2, 4, 6) for _ in range(2)]
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    g = torch.Generator().manual_seed(7)
    words = sample_words(valid, torch.Generator().manual_seed(7))
    m = masks_for("gradcam", attns, grads, valid, 6, g)
    assert torch.allclose(m, soft_mask(gradcam(attns, grads)[torch.arange(2), words]))
    m = masks_for("attention", attns, None, valid, 6, torch.Generator().manual_seed(7))
    assert torch.allclose(m, soft_mask(attention_map(attns)[torch.arange(2), words]))
    m = masks_for("random:0.5", None, None, valid, 6, torch.Generator().manual_seed(7))
    assert (m == 0).sum(dim=1).tolist() == [3, 3]
    assert parse_source("random:0.3") == ("random", 0.3)
    for bad in ("random", "random:1.5", "gradcam:1", "saliency"):
        with pytest.raises(ValueError, match="unknown loss.softmask_source"):
            parse_source(bad)


# --- masked features and the loss ----------------------------------------------------------------------------------


def test_masked_features_change_itm_and_a_mask_of_ones_changes_nothing():
    cfg = cfg_for("softmask")
    model = model_for(cfg)
    batch = make_batch(CAPTIONS)
    with torch.no_grad():
        tokens, _ = model.encode_image(batch["images"])
        hidden, _ = model.encode_text(batch["input_ids"], batch["attention_mask"])
        plain = model.itm_logits(model.fuse(hidden, batch["attention_mask"], tokens))
        ones = model.itm_logits(model.fuse(hidden, batch["attention_mask"], tokens,
                                           patch_weights=torch.ones(tokens.shape[:2])))
        half = torch.ones(tokens.shape[:2])
        half[:, ::2] = 0.0
        masked = model.itm_logits(model.fuse(hidden, batch["attention_mask"], tokens, patch_weights=half))
    assert torch.equal(plain, ones)
    assert (masked - plain).abs().max() > 1e-4


def test_softmask_itm_loss_is_cross_entropy_with_label_match():
    logits = torch.tensor([[0.2, 1.5], [2.0, -1.0], [0.0, 0.0]])
    ref = sum(-math.log(math.exp(b) / (math.exp(a) + math.exp(b))) for a, b in logits.tolist()) / 3
    assert float(softmask_itm_loss(logits)) == pytest.approx(ref)


@pytest.mark.parametrize("source", ["gradcam", "attention", "random:0.3"])
def test_train_step_logs_softmask_itm_loss_for_every_source(source):
    cfg = cfg_for("softmask", f"loss.softmask_source={source}")
    model = model_for(cfg).train()
    out = run_step(model, make_batch(CAPTIONS), cfg, torch.Generator().manual_seed(0))
    assert {"itc_loss", "itm_loss", "softmask_itm_loss", "mlm_loss"} <= set(out)
    parts = sum(float(out[k].detach()) for k in ("itc_loss", "itm_loss", "softmask_itm_loss", "mlm_loss"))
    assert float(out["total"].detach()) == pytest.approx(parts)
    out["total"].backward()  # the retained graph still backpropagates after autograd.grad took the CAM gradient
    assert model.itm_head.weight.grad is not None


@pytest.mark.parametrize("source", ["gradcam", "random:0.3"])
def test_the_mask_source_is_parsed_when_the_config_is_built_not_at_each_step(monkeypatch, source):
    import vltrain.config as vc
    import vltrain.softmask as sm

    cfg = cfg_for("softmask", f"loss.softmask_source={source}")
    assert cfg.loss.softmask == sm.parse_source(source)
    batches = [make_batch(CAPTIONS, seed) for seed in range(2)]  # (make_batch builds a config of its own)

    def parsed_again(text):
        raise AssertionError(f"softmask_source {text!r} parsed during a step")

    monkeypatch.setattr(sm, "parse_source", parsed_again)
    monkeypatch.setattr(vc, "parse_source", parsed_again)
    model = model_for(cfg).train()
    for seed, batch in enumerate(batches):
        out = run_step(model, batch, cfg, torch.Generator().manual_seed(seed))
        assert torch.isfinite(out["softmask_itm_loss"])


def test_gradcam_step_mask_follows_the_recomputed_cam(monkeypatch):
    """The mask train_step applies is soft_mask of the Grad-CAM row of the sampled word, recomputed here."""
    import vltrain.softmask as sm

    cfg = cfg_for("softmask", "loss.masked_text_all=false")
    model = model_for(cfg)  # eval: no dropout, so the recomputation sees the same numbers
    seen = {}
    real_fuse, real_words = model.fuse, sm.sample_words

    def fuse(text_hidden, text_mask, image_tokens, patch_weights=None, return_attn=False, ends=None, image_rows=None):
        if patch_weights is not None:
            seen["mask"] = patch_weights.detach()
        out = real_fuse(text_hidden, text_mask, image_tokens, patch_weights=patch_weights, return_attn=return_attn,
                        ends=ends, image_rows=image_rows)
        if return_attn:
            seen["maps"], seen["logits"] = out[1], model.itm_logits(out[0])
        return out

    def words(valid, generator=None):
        seen["words"] = real_words(valid, generator)
        return seen["words"]

    model.fuse = fuse
    monkeypatch.setattr(sm, "sample_words", words)
    batch = make_batch(CAPTIONS)
    run_step(model, batch, cfg, torch.Generator().manual_seed(5))
    b = len(CAPTIONS)
    assert bool(batch["attention_mask"].bool()[torch.arange(b), seen["words"]].all())
    s_pos = seen["logits"][:b].softmax(-1)[:, 1].sum()
    grads = torch.autograd.grad(s_pos, seen["maps"], retain_graph=True)
    cam = torch.zeros(b, *seen["maps"][0].shape[2:])  # the Grad-CAM by loops: layers x heads
    k = 0
    for a, g in zip(seen["maps"], grads):
        for h in range(a.shape[1]):
            cam += a[:b, h].detach() * g[:b, h].clamp(min=0)
            k += 1
    cam /= k
    assert torch.allclose(seen["mask"], soft_mask(cam[torch.arange(b), seen["words"]]), atol=1e-5)


# --- config --------------------------------------------------------------------------------------------------------


def test_bad_softmask_configs_are_one_line_errors():
    cases = [({"loss.focal_gamma": 2, "loss.distill_alpha": 0.4}, "no published form combines it"),
             ({"loss.softmask_source": "saliency"}, "unknown loss.softmask_source"),
             ({"data.augment": "strong"}, "unknown data.augment"),
             ({"loss.itm": 0}, "reads the ITM positives"),
             ({"loss.mlm": 0}, "loss.masked_text_all needs loss.mlm > 0")]
    for sets, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            load_config("softmask", sets=[f"{k}={v}" for k, v in sets.items()])
        assert "\n" not in str(e.value)


# --- MMDA ----------------------------------------------------------------------------------------------------------


def test_masked_text_all_off_is_bit_identical_to_the_code_before_softmask():
    """Pinned: what train_step gave at commit 621e3a1, before SoftMask++ existed (tiny albef and grit, one step),
    computed in float64 on both sides (that commit's one float32 cast, of the momentum MLM targets, made a no-op
    for float64 as train_step's `upcast` now is). In float32 the pins would hold only on the CPU that made them:
    other kernels round a loss differently by ~1e-6 relative. In float64 that rounding is ~1e-15, so rel=1e-9 holds
    on any CPU while any change to what the step computes (a dropped term, another draw) moves a loss far more."""
    before = {"albef": {"itc_loss": 7.429577303703006, "itm_loss": 0.7039978089075286,
                        "mlm_loss": 10.330845059746215, "rng": 1178333580},
              "grit": {"itc_loss": 1.924943246640225, "itc_consistency_loss": 0.23765487371963276,
                       "itm_loss": 0.7090308027714564, "mlm_loss": 10.32698877891492, "rng": 642412254}}
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for preset, want in before.items():
            cfg = cfg_for(preset)
            assert not cfg.loss.masked_text_all and cfg.loss.softmask_itm == 0
            model = model_for(cfg).train()
            torch.manual_seed(1)
            g = torch.Generator().manual_seed(3)
            out = run_step(model, make_batch(CAPTIONS), cfg, g)
            assert int(torch.randint(0, 2**31, (1,), generator=g)) == want["rng"]  # the same draws, in order
            for k, v in want.items():
                if k != "rng":
                    assert out[k].dtype == torch.float64
                    assert float(out[k].detach()) == pytest.approx(v, rel=1e-9), (preset, k)
    finally:
        torch.set_default_dtype(dtype)


def test_masked_text_all_encodes_the_masked_caption_once(monkeypatch):
    cfg = cfg_for("softmask", "loss.softmask_itm=0")
    model = model_for(cfg).train()
    seen = []
    real = model.encode_text
    model.encode_text = lambda ids, mask, ends=None: (seen.append(ids.clone()), real(ids, mask, ends))[1]
    batch = make_batch(CAPTIONS)
    run_step(model, batch, cfg, torch.Generator().manual_seed(0))
    assert len(seen) == 1  # one text pass (the momentum copy has its own)
    changed = seen[0] != batch["input_ids"]
    assert bool(changed.any()) and float(changed.float().mean()) < 0.5


def test_augment_recipes():
    from torchvision.transforms import v2

    from vltrain.data.samples import train_transform

    names = {a: [type(t).__name__ for t in train_transform(64, [0.5] * 3, [0.5] * 3, 0.5, a).transforms]
             for a in ("none", "albef", "softmask")}
    # uint8 views: ToDtype and Normalize happen on the device (vltrain.data.collate.to_device)
    assert names["none"] == ["ToImage", "RandomResizedCrop", "RandomHorizontalFlip"]
    assert names["albef"][:4] == ["ToImage", "RandomResizedCrop", "RandomHorizontalFlip", "RandAugment"]
    assert names["softmask"][4:7] == ["RandomApply", "RandomGrayscale", "RandomApply"]
    tf = train_transform(64, [0.5] * 3, [0.5] * 3, 0.5, "softmask")
    crop, ra = tf.transforms[1], tf.transforms[3]
    assert crop.scale == (0.2, 1.0) and (ra.num_ops, ra.magnitude) == (2, 7)
    jitter, gray, blur = tf.transforms[4], tf.transforms[5], tf.transforms[6]
    assert jitter.p == 0.8 and isinstance(jitter.transforms[0], v2.ColorJitter) and gray.p == 0.2
    assert blur.p == 0.5 and blur.transforms[0].sigma == [0.1, 2.0]
    from PIL import Image

    x = tf(Image.new("RGB", (80, 70), (200, 30, 30)))
    assert x.shape == (3, 64, 64) and x.dtype == torch.uint8


# --- a tiny run ----------------------------------------------------------------------------------------------------


def test_tiny_softmask_run_resumes_exactly(shards, tmp_path, monkeypatch):  # noqa: F811
    """The held-out evaluations run (eval_every=2) but draw no learning curve: nothing here reads it
    (test_trainer_usability does), and matplotlib was most of each evaluation."""
    monkeypatch.setattr("vltrain.runlog.plot_learning_curve", lambda rows, path: None)
    common = ["--preset", "softmask", "--set", "model.fusion_layers=1", "--set", "model.queue_size=16",
              "--set", "optim.warmup_steps=0", "--set", "optim.min_lr_ratio=1.0", "--set", "data.val_frac=0.2",
              "--set", "eval_every=2"]
    r = run(shards, tmp_path / "full", *common, "--steps", "6")
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = run(shards, tmp_path / "part", *common, "--steps", "3")
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = run(shards, tmp_path / "part", *common, "--steps", "6", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    for key in ("total", "itc_loss", "itm_loss", "softmask_itm_loss", "mlm_loss"):
        a, b = losses(tmp_path / "full", key), losses(tmp_path / "part", key)
        assert sorted(a) == list(range(1, 7)) and a == b, key  # bit for bit
    rows = [json.loads(ln) for ln in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["softmask_itm_loss"]) for r in rows if "softmask_itm_loss" in r)


def test_gradcam_command_draws_a_figure_and_refuses_a_missing_word(shards, tmp_path):  # noqa: F811
    from typer.testing import CliRunner

    from vltrain.cli import app

    r = run(shards, tmp_path / "run", "--preset", "softmask", "--set", "model.fusion_layers=1", "--steps", "2",
            "--set", "model.queue_size=16")
    assert r.exit_code == 0, r.output
    image = next(Path(shards).parent.glob("src/*.png"))
    caption = "a red cat number 3"
    out = tmp_path / "gc.png"
    r = CliRunner().invoke(app, ["gradcam", str(tmp_path / "run" / "last.pt"), str(image), caption, "--words",
                                 "red,cat", "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    from PIL import Image

    assert Image.open(out).size[0] > 200 and "p(match)" in r.output
    r = CliRunner().invoke(app, ["gradcam", str(tmp_path / "run" / "last.pt"), str(image), caption, "--words",
                                 "zebra", "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 2 and "word 'zebra' is not in the caption's tokens" in r.output
    clip = tmp_path / "clip"
    assert run(shards, clip, "--preset", "clip", "--steps", "1").exit_code == 0
    r = CliRunner().invoke(app, ["gradcam", str(clip / "last.pt"), str(image), caption, "--device", "cpu"])
    assert r.exit_code == 2 and "has no fusion encoder" in r.output

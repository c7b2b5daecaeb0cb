import math

import pytest
import torch

from vltrain.losses import (dedupe_targets, distill_targets, focal_itc_loss, hard_negative_weights, hardest_negatives,
                            itc_consistency_loss, itc_logits as itc_logits_fn, itc_loss, itm_loss, mlm_loss, mlm_mask,
                            sample_hard_negatives, tonics_ir_loss, tonics_tr_loss)

# References below are re-derived from the papers with Python floats and loops, never by calling torch the way
# vltrain.losses does, so a shared mistake cannot make both sides agree.


def rows(t: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v in r] for r in t.detach().double()]


def log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def softmax(xs: list[float]) -> list[float]:
    return [math.exp(v) for v in log_softmax(xs)]


def ref_soft_xent(logits: list[list[float]], targets: list[list[float]] | None) -> float:
    total = 0.0
    for i, r in enumerate(logits):
        lp = log_softmax(r)
        t = targets[i] if targets is not None else [1.0 if j == i else 0.0 for j in range(len(r))]
        total += -sum(tj * lj for tj, lj in zip(t, lp))
    return total / len(logits)


def ref_kl(p: list[float], q: list[float]) -> float:
    return sum(pj * math.log(pj / qj) for pj, qj in zip(p, q) if pj > 0)


def itc_logits(b: int = 4, q: int = 3, seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, b + q, generator=g, dtype=dtype) * 2, torch.randn(b, b + q, generator=g, dtype=dtype) * 2


def random_probs(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(*shape, generator=g) + 1e-3
    return t / t.sum(-1, keepdim=True)


# --- ITC -------------------------------------------------------------------------------------------------------


def test_itc_loss_one_hot_matches_loops():
    li, lt = itc_logits()
    want = (ref_soft_xent(rows(li), None) + ref_soft_xent(rows(lt), None)) / 2
    assert itc_loss(li, lt).item() == pytest.approx(want, rel=1e-5)


def test_itc_loss_soft_targets_match_loops():
    li, lt = itc_logits(seed=1)
    ti, tt = random_probs(li.shape, 2), random_probs(lt.shape, 3)
    want = (ref_soft_xent(rows(li), rows(ti)) + ref_soft_xent(rows(lt), rows(tt))) / 2
    assert itc_loss(li, lt, ti, tt).item() == pytest.approx(want, rel=1e-5)


def test_itc_loss_no_queue_and_bad_shapes():
    li, lt = itc_logits(b=3, q=0, seed=4)
    want = (ref_soft_xent(rows(li), None) + ref_soft_xent(rows(lt), None)) / 2
    assert itc_loss(li, lt).item() == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="targets shape"):
        itc_loss(li, lt, torch.ones(3, 4), None)
    with pytest.raises(ValueError, match=r"\(B, B\+Q\)"):
        itc_loss(torch.zeros(4, 3), torch.zeros(4, 3))


def test_itc_loss_gradcheck_and_targets_are_constants():
    li, lt = itc_logits(b=3, q=2, seed=5, dtype=torch.float64)
    li.requires_grad_(True)
    lt.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: itc_loss(a, b), (li, lt))
    ti = random_probs(li.shape, 6).double().requires_grad_(True)
    itc_loss(li, lt, ti, None).backward()
    assert ti.grad is None


def ref_itc_grads(u: list[list[float]], v: list[list[float]], uq: list[list[float]], vq: list[list[float]],
                  tau: float, detach_keys: bool) -> tuple[list[list[float]], list[list[float]]]:
    """d itc_loss / d image feats u and text feats v, derived by hand for one-hot targets.

    L = 1/2 (1/B sum_i -log p_i2t[i, i] + 1/B sum_i -log p_t2i[i, i]), s_i2t[i, j] = u_i . k_j / tau with keys
    k = [v; vq]. d(-log p[i, i]) / d s[i, j] = p[i, j] - [i == j]. The query side gets sum_j (p - y)[i, j] k_j / tau;
    a key v_j (j < B) gets sum_i (p - y)[i, j] u_i / tau unless keys are detached. Queue columns carry no gradient.
    """
    b, e = len(u), len(u[0])
    dot = lambda a, c: sum(x * y for x, y in zip(a, c))
    gu, gv = [[0.0] * e for _ in range(b)], [[0.0] * e for _ in range(b)]
    for q, k, gq, gk in ((u, v + vq, gu, gv), (v, u + uq, gv, gu)):
        for i in range(b):
            p = softmax([dot(q[i], kj) / tau for kj in k])
            for j, kj in enumerate(k):
                c = (p[j] - (1.0 if i == j else 0.0)) / (2 * b * tau)
                for d in range(e):
                    gq[i][d] += c * kj[d]
                    if j < b and not detach_keys:
                        gk[j][d] += c * q[i][d]
    return gu, gv


@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.parametrize("q", [0, 3])
def test_itc_gradient_with_detached_keys_matches_the_hand_derivation(detach, q):
    b, e, tau = 4, 5, 0.1
    g = torch.Generator().manual_seed(31)
    u = torch.nn.functional.normalize(torch.randn(b, e, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    v = torch.nn.functional.normalize(torch.randn(b, e, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    uq = torch.nn.functional.normalize(torch.randn(e, q, generator=g, dtype=torch.float64), dim=0) if q else None
    vq = torch.nn.functional.normalize(torch.randn(e, q, generator=g, dtype=torch.float64), dim=0) if q else None
    # No momentum model: the keys are the features themselves, as train_step passes them.
    li, lt = itc_logits_fn(u, v, u, v, tau, uq, vq, detach_keys=detach)
    assert li.shape == lt.shape == (b, b + q)
    itc_loss(li, lt).backward()
    cols = lambda t: [] if t is None else rows(t.t())
    gu, gv = ref_itc_grads(rows(u), rows(v), cols(uq), cols(vq), tau, detach)
    assert rows(u.grad) == [pytest.approx(r, abs=1e-12) for r in gu]
    assert rows(v.grad) == [pytest.approx(r, abs=1e-12) for r in gv]


def test_dedupe_targets_spread_mass_evenly_over_duplicates():
    caps = ["a", "b", "a", "c", "a", "b"]
    same = torch.tensor([[x == y for y in caps] for x in caps])
    t = dedupe_targets(same, len(caps) + 2)
    for i, x in enumerate(caps):  # hand-built: 1/k on each of the k captions equal to row i's, queue columns 0
        k = caps.count(x)
        want = [1 / k if y == x else 0.0 for y in caps] + [0.0, 0.0]
        assert t[i].tolist() == pytest.approx(want)
    eye = dedupe_targets(torch.zeros(3, 3, dtype=torch.bool), 3)  # no duplicates (even a False diagonal): one-hot
    assert eye.tolist() == torch.eye(3).tolist()
    li, lt = itc_logits(6, 2, seed=9)  # with the targets, itc_loss is the soft cross-entropy against them
    want = (ref_soft_xent(rows(li), rows(t)) + ref_soft_xent(rows(lt), rows(t))) / 2
    assert itc_loss(li, lt, t, t).item() == pytest.approx(want, rel=1e-5)
    d = distill_targets(li, 0.4, t)  # ALBEF's mix with the deduplicated hard part
    for i in range(6):
        p = softmax(rows(li)[i])
        assert d[i].tolist() == pytest.approx([0.4 * p[j] + 0.6 * float(t[i, j]) for j in range(8)], abs=1e-6)
    with pytest.raises(ValueError, match="G >= B"):
        dedupe_targets(torch.zeros(3, 2, dtype=torch.bool), 3)


def test_dedupe_targets_over_every_ranks_keys():
    """Under torchrun the mask is (B, B_global): this rank's rows first, the other ranks' captions after them."""
    same = torch.tensor([[False, False, True, False], [False, False, False, False]])  # row 0 = column 2's caption
    t = dedupe_targets(same, 6)  # 4 in-batch keys and 2 queue columns
    assert t.tolist() == [[0.5, 0.0, 0.5, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]


def test_distill_targets_values_and_no_grad():
    lm, _ = itc_logits(seed=7)
    lm.requires_grad_(True)
    alpha = 0.4
    out = distill_targets(lm, alpha)
    assert out.shape == lm.shape and not out.requires_grad
    for i, r in enumerate(rows(lm)):
        p = softmax(r)
        for j in range(len(r)):
            assert float(out[i, j]) == pytest.approx(alpha * p[j] + (1 - alpha) * (i == j), abs=1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(lm.shape[0]))


def test_itc_with_alpha0_distill_targets_equals_one_hot():
    li, lt = itc_logits(seed=8)
    lm_i, lm_t = itc_logits(seed=9)
    got = itc_loss(li, lt, distill_targets(lm_i, 0.0), distill_targets(lm_t, 0.0))
    assert got.item() == pytest.approx(itc_loss(li, lt).item(), rel=1e-6)


def test_focal_itc_matches_loops():
    li, lt = itc_logits(seed=10)
    for gamma in (2.0, 0.5):
        want = 0.0
        for m in (rows(li), rows(lt)):
            s = 0.0
            for i, r in enumerate(m):
                p = softmax(r)[i]
                s += -((1 - p) ** gamma) * math.log(p)
            want += s / len(m) / 2
        assert focal_itc_loss(li, lt, gamma).item() == pytest.approx(want, rel=1e-5)


def test_focal_gamma0_equals_plain_itc_and_down_weights_easy_rows():
    li, lt = itc_logits(seed=11)
    assert focal_itc_loss(li, lt, 0.0).item() == pytest.approx(itc_loss(li, lt).item(), rel=1e-6)
    assert focal_itc_loss(li, lt, 2.0).item() < itc_loss(li, lt).item()


def test_focal_gradcheck():
    li, lt = itc_logits(b=3, q=1, seed=12, dtype=torch.float64)
    li.requires_grad_(True)
    lt.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: focal_itc_loss(a, b, 2.0), (li, lt))


# --- GRIT consistency ------------------------------------------------------------------------------------------


def test_consistency_matches_loops_on_in_batch_block():
    b, q = 4, 3
    li, lt = itc_logits(b, q, seed=13)
    want = 0.0
    for i in range(b):
        p_i2t = softmax(rows(li)[i][:b])
        p_t2i = softmax(rows(lt)[i][:b])
        want += 0.5 * (ref_kl(p_i2t, p_t2i) + ref_kl(p_t2i, p_i2t)) / b
    assert itc_consistency_loss(li, lt).item() == pytest.approx(want, rel=1e-5)
    # Queue columns are not part of eq. 6.
    li2, lt2 = li.clone(), lt.clone()
    li2[:, b:] += 5.0
    lt2[:, b:] -= 3.0
    assert itc_consistency_loss(li2, lt2).item() == pytest.approx(want, rel=1e-5)
    assert itc_consistency_loss(li, li).item() == pytest.approx(0.0, abs=1e-6)


def test_consistency_gradient_flows_only_into_the_non_sg_side():
    # d/dz of KL(sg(p) || softmax(z)) is softmax(z) - p, so with the 1/2 and the batch mean:
    # grad wrt logits_i2t[i, :B] = (p_i2t[i] - p_t2i[i]) / (2B), and symmetrically; queue columns get 0.
    # Without the stop-gradient the KL(p_i2t || .) term would add a second, different contribution.
    b, q = 4, 2
    li, lt = itc_logits(b, q, seed=14, dtype=torch.float64)
    li.requires_grad_(True)
    lt.requires_grad_(True)
    itc_consistency_loss(li, lt).backward()
    for i in range(b):
        p_i2t = softmax(rows(li)[i][:b])
        p_t2i = softmax(rows(lt)[i][:b])
        for j in range(b):
            assert float(li.grad[i, j]) == pytest.approx((p_i2t[j] - p_t2i[j]) / (2 * b), abs=1e-10)
            assert float(lt.grad[i, j]) == pytest.approx((p_t2i[j] - p_i2t[j]) / (2 * b), abs=1e-10)
    assert torch.all(li.grad[:, b:] == 0) and torch.all(lt.grad[:, b:] == 0)

    # Same check against a version without stop-gradient: the gradients must differ.
    li_n = li.detach().clone().requires_grad_(True)
    lt_n = lt.detach().clone().requires_grad_(True)
    pa, pb = li_n[:, :b].softmax(-1), lt_n[:, :b].softmax(-1)
    no_sg = 0.5 * ((pa * (pa.log() - pb.log())).sum(-1) + (pb * (pb.log() - pa.log())).sum(-1)).mean()
    no_sg.backward()
    assert not torch.allclose(li_n.grad, li.grad)


# --- ITM hard negatives ----------------------------------------------------------------------------------------


def test_hard_negative_weights_match_loops():
    b, q = 5, 3
    li, lt = itc_logits(b, q, seed=15)
    li.requires_grad_(True)
    w_i2t, w_t2i = hard_negative_weights(li, lt)
    assert w_i2t.shape == (b, b) and not w_i2t.requires_grad
    for w, m in ((w_i2t, rows(li)), (w_t2i, rows(lt))):
        for i in range(b):
            p = softmax(m[i][:b])
            for j in range(b):
                assert float(w[i, j]) == pytest.approx(0.0 if i == j else p[j], abs=1e-6)


def test_global_negatives_span_every_ranks_batch():
    """BLIP's global ITM negatives: weights over W = B_global columns (this rank's B rows first, positive of row i
    at column i), and the negatives are drawn or picked among all W, never the positive."""
    b, width, q = 3, 7, 2
    li, lt = itc_logits(b, width - b + q, seed=21)  # (3, 9): 7 in-batch keys of every rank, then 2 queue columns
    w_i2t, w_t2i = hard_negative_weights(li, lt, width=width)
    assert w_i2t.shape == (b, width)
    for w, m in ((w_i2t, rows(li)), (w_t2i, rows(lt))):
        for i in range(b):
            p = softmax(m[i][:width])
            assert w[i].tolist() == pytest.approx([0.0 if j == i else p[j] for j in range(width)], abs=1e-6)
    assert hardest_negatives(w_i2t).tolist() == ref_hardest(rows(w_i2t))
    g = torch.Generator().manual_seed(4)
    drawn = torch.stack([sample_hard_negatives(w_i2t, g) for _ in range(300)])  # (300, 3)
    assert (drawn != torch.arange(b)).all() and int(drawn.max()) >= b  # other ranks' rows are drawn too
    exclude = torch.zeros(b, width, dtype=torch.bool)
    exclude[0, 5] = True  # a duplicate caption on another rank is never a negative
    assert float(hard_negative_weights(li, lt, exclude, width)[0][0, 5]) == 0.0
    with pytest.raises(ValueError, match="width"):
        hard_negative_weights(li, lt, width=2)


def test_hard_negative_weights_fall_back_to_uniform():
    b = 4
    li = torch.zeros(b, b + 2)
    li[torch.arange(b), torch.arange(b)] = 1e4  # every negative underflows to exactly 0 in float32
    li[1] = torch.randn(b + 2, generator=torch.Generator().manual_seed(0))  # a healthy row keeps its softmax
    li[2, 0] = float("nan")  # a NaN row must not reach torch.multinomial
    w, _ = hard_negative_weights(li, li)
    for i in (0, 2, 3):
        assert w[i].tolist() == pytest.approx([0.0 if j == i else 1 / (b - 1) for j in range(b)])
    p = softmax(rows(li)[1][:b])
    assert w[1].tolist() == pytest.approx([0.0 if j == 1 else p[j] for j in range(b)], abs=1e-6)
    w1, _ = hard_negative_weights(torch.zeros(1, 3), torch.zeros(1, 3))
    assert w1.tolist() == [[0.0]]  # B == 1 has no negative at all
    with pytest.raises(ValueError, match="at least 2"):
        sample_hard_negatives(w1)


def test_sampled_hard_negatives_never_positive_and_follow_weights():
    b, draws = 5, 4000
    g = torch.Generator().manual_seed(16)
    li, _ = itc_logits(b, 2, seed=17)
    w, _ = hard_negative_weights(li, li)
    counts = torch.zeros(b, b)
    for _ in range(draws):
        idx = sample_hard_negatives(w, generator=g)
        assert idx.dtype == torch.long and idx.shape == (b,)
        counts[torch.arange(b), idx] += 1
    assert (counts.diagonal() == 0).all()
    expected = w / w.sum(-1, keepdim=True)
    # 4000 draws per row: binomial std <= 0.008, so 0.035 is > 4 sigma.
    assert (counts / draws - expected).abs().max() < 0.035


def test_sample_hard_negatives_masks_raw_weights_and_is_reproducible():
    b = 3
    w = torch.full((b, b), 1.0)
    w.fill_diagonal_(1e6)  # a caller passing unmasked weights still never gets the positive
    for _ in range(500):
        assert (sample_hard_negatives(w) != torch.arange(b)).all()
    a = [sample_hard_negatives(w, torch.Generator().manual_seed(3)).tolist() for _ in range(2)]
    assert a[0] == a[1]


def ref_hardest(w: list[list[float]]) -> list[int]:
    """Per row the largest off-diagonal weight, the first one on ties (a strict > scan from the left)."""
    out = []
    for i, r in enumerate(w):
        best = None
        for j, v in enumerate(r):
            if j != i and (best is None or v > r[best]):
                best = j
        out.append(best)
    return out


def test_hardest_negatives_match_a_loop_with_ties_and_never_the_diagonal():
    w = torch.tensor([[9.0, 1.0, 3.0, 3.0],    # tie between 2 and 3 -> 2; the larger diagonal is never taken
                      [2.0, 0.0, 2.0, 1.0],    # tie between 0 and 2 -> 0
                      [0.0, 0.0, 5.0, 0.0],    # all off-diagonal equal -> 0
                      [0.1, 0.7, 0.2, 0.0]])
    assert hardest_negatives(w).tolist() == ref_hardest(rows(w)) == [2, 0, 0, 1]
    for seed in range(5):  # random weights, and weights rounded so that ties are frequent
        li, lt = itc_logits(6, 2, seed=40 + seed)
        for m in (hard_negative_weights(li, lt)[0], torch.round(torch.rand(6, 6, generator=torch.Generator()
                                                                            .manual_seed(seed)) * 3)):
            idx = hardest_negatives(m)
            assert idx.dtype == torch.long and idx.tolist() == ref_hardest(rows(m))
            assert (idx != torch.arange(6)).all()
    nan_row = torch.tensor([[1.0, float("nan"), 0.5], [float("nan")] * 3, [0.2, 0.9, 0.0]])
    assert hardest_negatives(nan_row).tolist() == [2, 0, 1]  # NaN is never the max; an all-NaN row -> lowest off-diag
    with pytest.raises(ValueError, match="W >= B"):
        hardest_negatives(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="at least 2"):
        hardest_negatives(torch.zeros(1, 1))


def test_hard_negative_weights_exclude_pairs_and_empty_rows():
    b = 4
    li, lt = itc_logits(b, 1, seed=21)
    exclude = torch.zeros(b, b, dtype=torch.bool)
    exclude[0, 1] = exclude[1, 0] = True                                         # 0 and 1 share a caption
    exclude[3, :] = exclude[:, 3] = True                                         # 3 shares one with everyone
    w, _ = hard_negative_weights(li, lt, exclude)
    for i in range(b):
        p = softmax(rows(li)[i][:b])
        want = [0.0 if i == j or exclude[i, j] else p[j] for j in range(b)]
        assert w[i].tolist() == pytest.approx(want, abs=1e-6)
    assert w[3].tolist() == [0.0] * b
    dead = torch.zeros(b, b + 1)
    dead[torch.arange(b), torch.arange(b)] = 1e4  # underflow: uniform over the allowed pairs only
    w, _ = hard_negative_weights(dead, dead, exclude)
    assert w[0].tolist() == pytest.approx([0, 0, 1, 0]) and w[2].tolist() == pytest.approx([0.5, 0.5, 0, 0])


def test_itm_loss_matches_loops():
    b = 3
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(3 * b, 2, generator=g)
    labels = torch.tensor([1] * b + [0] * (2 * b))
    want = sum(-log_softmax(r)[int(y)] for r, y in zip(rows(logits), labels)) / (3 * b)
    assert itm_loss(logits, labels).item() == pytest.approx(want, rel=1e-5)


# --- MLM -------------------------------------------------------------------------------------------------------

PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 1000


def token_batch(b: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(200, VOCAB, (b, length), generator=g)
    ids[:, 0] = CLS
    ids[:, -8:] = PAD
    ids[:, -9] = SEP
    return ids


def test_mlm_mask_statistics():
    ids = token_batch(64, 512, seed=19)
    before = ids.clone()
    prob = 0.15
    masked, labels = mlm_mask(ids, prob, [PAD, CLS, SEP, MASK], MASK, VOCAB, torch.Generator().manual_seed(20))
    assert torch.equal(ids, before)
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    selected = labels != -100
    assert not (selected & special).any()
    assert torch.equal(labels[selected], ids[selected])
    assert (labels[~selected] == -100).all()
    assert torch.equal(masked[~selected], ids[~selected])
    n_sel, n_free = int(selected.sum()), int((~special).sum())
    assert abs(n_sel / n_free - prob) < 0.01
    sel_out, sel_in = masked[selected], ids[selected]
    frac_mask = float((sel_out == MASK).float().mean())
    frac_same = float((sel_out == sel_in).float().mean())
    frac_random = 1 - frac_mask - frac_same
    assert abs(frac_mask - 0.8) < 0.03 and abs(frac_same - 0.1) < 0.02 and abs(frac_random - 0.1) < 0.02
    randoms = sel_out[(sel_out != MASK) & (sel_out != sel_in)]
    assert randoms.min() >= 0 and randoms.max() < VOCAB and randoms.unique().numel() > 200


def test_mlm_mask_edges_and_reproducible():
    ids = token_batch(4, 32, seed=21)
    m0, l0 = mlm_mask(ids, 0.0, [PAD, CLS, SEP], MASK, VOCAB)
    assert torch.equal(m0, ids) and (l0 == -100).all()
    _, l1 = mlm_mask(ids, 1.0, [PAD, CLS, SEP], MASK, VOCAB)
    assert torch.equal(l1 != -100, (ids != PAD) & (ids != CLS) & (ids != SEP))
    a = mlm_mask(ids, 0.5, [PAD], MASK, VOCAB, torch.Generator().manual_seed(1))
    b = mlm_mask(ids, 0.5, [PAD], MASK, VOCAB, torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    _, l_none = mlm_mask(ids, 1.0, [], MASK, VOCAB)
    assert (l_none != -100).all()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        mlm_mask(ids, 1.5, [PAD], MASK, VOCAB)


def mlm_case(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, length, v = 2, 5, 7
    logits = torch.randn(b, length, v, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (b, length), generator=g)
    labels[0, 1] = labels[1, 0] = labels[1, 4] = -100
    soft = torch.rand(b, length, v, generator=g, dtype=dtype) + 1e-3
    return logits, labels, soft / soft.sum(-1, keepdim=True)


def ref_mlm(logits, labels, soft, alpha) -> float:
    ce = kd = 0.0
    n = 0
    for bi in range(logits.shape[0]):
        for li in range(logits.shape[1]):
            y = int(labels[bi, li])
            if y == -100:
                continue
            lp = log_softmax([float(x) for x in logits[bi, li]])
            ce += -lp[y]
            if soft is not None:
                kd += -sum(float(t) * lj for t, lj in zip(soft[bi, li], lp))
            n += 1
    return (1 - alpha) * ce / n + alpha * kd / n


def test_mlm_loss_matches_loops():
    logits, labels, soft = mlm_case(22)
    assert mlm_loss(logits, labels).item() == pytest.approx(ref_mlm(logits, labels, None, 0.0), rel=1e-5)
    assert mlm_loss(logits, labels, soft, 0.0).item() == pytest.approx(ref_mlm(logits, labels, None, 0.0), rel=1e-5)
    assert mlm_loss(logits, labels, soft, 0.4).item() == pytest.approx(ref_mlm(logits, labels, soft, 0.4), rel=1e-5)
    with pytest.raises(ValueError, match="soft_targets"):
        mlm_loss(logits, labels, None, 0.4)


def test_mlm_loss_gradcheck_and_no_masked_positions():
    logits, labels, soft = mlm_case(23, torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: mlm_loss(x, labels, soft, 0.3), (logits,))
    empty = torch.full_like(labels, -100)
    zero = mlm_loss(logits, empty, soft, 0.3)
    assert zero.item() == 0.0 and zero.grad_fn is not None
    zero.backward()
    assert logits.grad is not None and (logits.grad == 0).all()


# --- TOnICS ----------------------------------------------------------------------------------------------------


def test_tonics_losses_match_paper_formulas():
    g = torch.Generator().manual_seed(24)
    s = torch.randn(5, 5, generator=g) * 3
    m = rows(s)
    n = len(m)
    # L_IR(i) = -log exp(s(i,i)) / sum_j exp(s(i,j));  L_TR(i) = -log exp(s(i,i)) / sum_j exp(s(j,i)).
    ir = sum(-(m[i][i] - math.log(sum(math.exp(m[i][j]) for j in range(n)))) for i in range(n)) / n
    tr = sum(-(m[i][i] - math.log(sum(math.exp(m[j][i]) for j in range(n)))) for i in range(n)) / n
    assert tonics_ir_loss(s).item() == pytest.approx(ir, rel=1e-5)
    assert tonics_tr_loss(s).item() == pytest.approx(tr, rel=1e-5)
    assert tonics_tr_loss(s).item() == pytest.approx(tonics_ir_loss(s.T).item(), rel=1e-6)


# --- autocast --------------------------------------------------------------------------------------------------


def test_losses_are_float32_under_autocast():
    li, lt = (x.bfloat16() for x in itc_logits(seed=25))
    logits, labels, soft = mlm_case(26)
    logits = logits.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = {
            "itc": (itc_loss(li, lt), itc_loss(li.float(), lt.float())),
            "focal": (focal_itc_loss(li, lt), focal_itc_loss(li.float(), lt.float())),
            "cons": (itc_consistency_loss(li, lt), itc_consistency_loss(li.float(), lt.float())),
            "mlm": (mlm_loss(logits, labels, soft, 0.4), mlm_loss(logits.float(), labels, soft, 0.4)),
            "ir": (tonics_ir_loss(li[:, :4]), tonics_ir_loss(li[:, :4].float())),
        }
        w, _ = hard_negative_weights(li, lt)
    assert w.dtype == torch.float32
    for name, (half, full) in got.items():
        assert half.dtype == torch.float32, name
        assert half.item() == pytest.approx(full.item(), rel=1e-6, abs=1e-7), name

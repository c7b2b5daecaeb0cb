"""Method fidelity: what `train_step` does with each new option, on a tiny model and one batch.

Each reference is re-derived here with plain Python loops over the model's own embeddings, never by calling
vltrain.losses the way train_step does.
"""

import math

import pytest
import torch

from vltrain import step as step_mod
from vltrain.config_load import load_config
from vltrain.model import build_model, build_tokenizer


def run_step(model, batch, cfg, generator, **kw):
    """train_step with the loss config and the data flag it takes from a whole Config."""
    return step_mod.train_step(model, batch, cfg.loss, generator, **kw)


TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.max_len=12"]
B = 6


def cfg_for(preset: str, *sets: str):
    # The tiny BERT has 2 layers: presets with a fusion encoder split it 1 + 1.
    fusion = ["model.fusion_layers=1"] if load_config(preset).model.fusion_layers else []
    return load_config(preset, sets=[*TINY, *fusion, *sets])


def make_batch(captions: list[str], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tok = build_tokenizer(cfg_for("clip").model)(captions, padding="longest", return_tensors="pt")
    return {"images": torch.randn(len(captions), 3, 32, 32, generator=g), "input_ids": tok["input_ids"],
            "attention_mask": tok["attention_mask"], "captions": captions}


CAPTIONS = [f"a photo of thing {i} and colour {i % 4}" for i in range(B)]


def model_for(cfg, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg.model).eval()  # eval: no dropout, so the test's own forward passes see the same numbers


def record_fuse(model) -> list:
    """Wrap model.fuse so the test sees what train_step fused (text hidden, mask, image tokens)."""
    calls, real = [], model.fuse

    def fuse(text_hidden, text_mask, image_tokens, image_rows=None, **kw):
        per_row = image_tokens if image_rows is None else image_tokens[image_rows]  # each row's image tokens
        calls.append((text_hidden.detach(), text_mask, per_row.detach()))
        return real(text_hidden, text_mask, image_tokens, image_rows=image_rows, **kw)

    model.fuse = fuse
    return calls


def ref_argmax_off_diag(sim: list[list[float]], banned=lambda i, j: False) -> list[int | None]:
    out = []
    for i, r in enumerate(sim):
        best = None
        for j, v in enumerate(r):
            if j != i and not banned(i, j) and (best is None or v > r[best]):
                best = j
        out.append(best)
    return out


def sims(model, batch) -> tuple[list[list[float]], list[list[float]], torch.Tensor, torch.Tensor]:
    """Image->text and text->image cosine / temp as Python lists, plus the text hidden states and image tokens."""
    with torch.no_grad():
        tokens, img = model.encode_image(batch["images"])
        hidden, txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        t = float(model.temperature().detach())
    i2t = [[float(sum(a * b for a, b in zip(img[i].tolist(), txt[j].tolist()))) / t for j in range(len(img))]
           for i in range(len(img))]
    t2i = [[i2t[j][i] for j in range(len(img))] for i in range(len(img))]
    return i2t, t2i, hidden, tokens


MARGIN = 1e-3  # in cosine / temperature units, where the step's float32 kernels and sims() differ by ~1e-6


def runner_up_gap(sim: list[list[float]], banned=lambda i, j: False, group=lambda j: j) -> float:
    """The smallest gap, over the rows, between the hardest allowed negative and the next allowed one of another
    group (columns of one group, e.g. copies of one caption, are one candidate)."""
    gaps = []
    for i, r in enumerate(sim):
        best = {}
        for j, v in enumerate(r):
            if j != i and not banned(i, j):
                best[group(j)] = max(best.get(group(j), -math.inf), v)
        top = sorted(best.values(), reverse=True)
        if len(top) > 1:
            gaps.append(top[0] - top[1])
    return min(gaps)


def batch_without_near_ties(model, captions: list[str], banned=lambda i, j: False):
    """The first image seed whose hardest allowed negatives win by MARGIN both ways, with its sims(): the step's
    argmax and the test's re-derivation then pick the same negative on any CPU (no near-tie left to rounding).
    Copies of one caption are one candidate: they tie up to the rounding of their rows' kernels."""
    for seed in range(200):
        batch = make_batch(captions, seed)
        s = sims(model, batch)
        if min(runner_up_gap(s[0], banned, group=captions.__getitem__), runner_up_gap(s[1], banned)) >= MARGIN:
            return batch, s
    raise AssertionError("no image seed below 200 gives a batch without near-ties")


# --- item 1: ITM hard negatives are the hardest (GRIT-VLP) -----------------------------------------------------


def test_itm_hardest_negatives_are_the_argmax_of_in_batch_similarity():
    cfg = cfg_for("albef-base", "loss.itm_negatives=hardest", "loss.mlm=0")
    model = model_for(cfg)
    batch, (i2t, t2i, hidden, tokens) = batch_without_near_ties(model, CAPTIONS)
    calls = record_fuse(model)
    run_step(model, batch, cfg, torch.Generator().manual_seed(0))
    (text_in, _, image_in), = calls
    neg_text, neg_image = ref_argmax_off_diag(i2t), ref_argmax_off_diag(t2i)
    # Rows B..2B: caption i with its hardest image; rows 2B..3B: image i with its hardest caption.
    assert torch.allclose(image_in[B:2 * B], tokens[neg_image]) and torch.allclose(text_in[B:2 * B], hidden)
    assert torch.allclose(text_in[2 * B:], hidden[neg_text]) and torch.allclose(image_in[2 * B:], tokens)
    # The same batch again gives the same negatives: no draw is involved.
    calls.clear()
    run_step(model, batch, cfg, torch.Generator().manual_seed(1))
    assert torch.equal(calls[0][0], text_in) and torch.equal(calls[0][2], image_in)


# --- item 2: ITC gradient through the query side only (GRIT-VLP's released code) --------------------------------


def leaf_features(model, batch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the ITC embeddings train_step sees by leaves the test owns, to read their gradients."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(B, 16, generator=g), dim=-1).requires_grad_()
    v = torch.nn.functional.normalize(torch.randn(B, 16, generator=g), dim=-1).requires_grad_()
    enc_i, enc_t = model.encode_image, model.encode_text
    model.encode_image = lambda images: (enc_i(images)[0], u)
    model.encode_text = lambda ids, mask, ends=None: (enc_t(ids, mask, ends)[0], v)
    return u, v


@pytest.mark.parametrize("detach", [True, False])
def test_train_step_detaches_itc_keys_when_asked(detach):
    cfg = cfg_for("clip", f"loss.itc_detach_keys={str(detach).lower()}")
    model = model_for(cfg)
    u, v = leaf_features(model, make_batch(CAPTIONS))
    run_step(model, make_batch(CAPTIONS), cfg, torch.Generator())["itc_loss"].backward()
    tau = float(model.temperature().detach())
    # Re-derivation: one-hot cross-entropy both ways, keys stopped by hand (or not).
    ru, rv = u.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    ku, kv = (ru.detach(), rv.detach()) if detach else (ru, rv)
    li, lt = ru @ kv.t() / tau, rv @ ku.t() / tau
    ref = -(li.log_softmax(1).diagonal().mean() + lt.log_softmax(1).diagonal().mean()) / 2
    ref.backward()
    assert torch.allclose(u.grad, ru.grad, atol=1e-6) and torch.allclose(v.grad, rv.grad, atol=1e-6)


# --- item 4: the distillation weight train_step uses is the one it is given (the warm-up ramp) --------------------


def test_train_step_distils_with_the_given_alpha():
    cfg = cfg_for("albef", "model.queue_size=0", "loss.itm=0", "loss.mlm=0")
    model = model_for(cfg)
    batch = make_batch(CAPTIONS)
    with torch.no_grad():
        _, u = model.encode_image(batch["images"])
        _, v = model.encode_text(batch["input_ids"], batch["attention_mask"])
        _, um = model.momentum.encode_image(batch["images"])
        _, vm = model.momentum.encode_text(batch["input_ids"], batch["attention_mask"])
        tau = float(model.temperature().detach())
    dot = lambda a, b: sum(x * y for x, y in zip(a.tolist(), b.tolist()))

    def ref(alpha: float) -> float:
        """ALBEF ITC with momentum distillation: keys and targets from the momentum encoders."""
        total = 0.0
        for q, k, qm in ((u, vm, um), (v, um, vm)):
            for i in range(B):
                s = [dot(q[i], k[j]) / tau for j in range(B)]
                sm = [dot(qm[i], k[j]) / tau for j in range(B)]
                lse = max(s) + math.log(sum(math.exp(x - max(s)) for x in s))
                pm = [math.exp(x - max(sm)) for x in sm]
                pm = [x / sum(pm) for x in pm]
                y = [alpha * pm[j] + (1 - alpha) * (i == j) for j in range(B)]
                total -= sum(y[j] * (s[j] - lse) for j in range(B)) / B
        return total / 2

    for alpha in (0.0, 0.1, 0.4):
        got = run_step(model, batch, cfg, torch.Generator(), alpha=alpha)["itc_loss"].detach()
        assert float(got) == pytest.approx(ref(alpha), rel=1e-5)
    assert float(run_step(model, batch, cfg, torch.Generator())["itc_loss"].detach()) == pytest.approx(
        ref(0.4), rel=1e-5)


# --- item 9: the fistful preset (A Fistful of Words 3, eq. 1-2) ------------------------------------------------


def test_fistful_step_is_infonce_against_momentum_keys_and_a_memory_bank_at_fixed_tau():
    cfg = cfg_for("fistful", "model.queue_size=8")
    model = model_for(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.image_queue.copy_(torch.nn.functional.normalize(torch.randn(16, 8, generator=g), dim=0))
        model.text_queue.copy_(torch.nn.functional.normalize(torch.randn(16, 8, generator=g), dim=0))
    batch = make_batch(CAPTIONS)
    with torch.no_grad():
        u = model.encode_image(batch["images"])[1].tolist()
        v = model.encode_text(batch["input_ids"], batch["attention_mask"])[1].tolist()
        um = model.momentum.encode_image(batch["images"])[1].tolist()
        vm = model.momentum.encode_text(batch["input_ids"], batch["attention_mask"])[1].tolist()
    bank_t, bank_i = model.text_queue.t().tolist(), model.image_queue.t().tolist()
    d = lambda a, b: sum(x * y for x, y in zip(a, b))  # cosine: every vector is unit length
    tau, total = 0.02, 0.0
    for i in range(B):  # L_i^image (eq. 1) and L_i^text (eq. 2) over the batch's EMA keys and the bank
        for q, keys in ((u[i], vm + bank_t), (v[i], um + bank_i)):
            s = [d(q, k) / tau for k in keys]
            top = max(s)
            total += -(s[i] - top - math.log(sum(math.exp(x - top) for x in s))) / (2 * B)
    losses = run_step(model, batch, cfg, torch.Generator())
    assert set(losses) == {"itc_loss", "total", "queue_feats"}  # no ITM, MLM or distillation
    assert float(losses["itc_loss"].detach()) == pytest.approx(total, rel=1e-5)
    losses["total"].backward()
    assert model.temp.grad is None and float(model.temperature().detach()) == pytest.approx(0.02)


# --- item 10: loss.dedupe=caption -------------------------------------------------------------------------------

DUP = ["Star. geometry, shapes", "a red cat", "Star. geometry, shapes", "a dog", "a red cat",
       "Star. geometry, shapes"]
# Lowercase and truncation give these the same token ids as DUP[0]; they are different captions, so negatives.
NEAR = ["star. geometry, shapes", "a red cat", "Star. geometry, shapes", "a dog", "a red cat",
        "Star. geometry, shapes "]


def test_dedupe_caption_itc_targets_are_the_hand_built_ones():
    cfg = cfg_for("clip", "loss.dedupe=caption")
    model = model_for(cfg)
    for caps in (DUP, NEAR):
        batch = make_batch(caps)
        i2t, t2i, _, _ = sims(model, batch)
        total = 0.0
        for s in (i2t, t2i):
            for i in range(B):
                pos = [j for j in range(B) if caps[j].encode() == caps[i].encode()]  # byte-identical
                top = max(s[i])
                lse = top + math.log(sum(math.exp(x - top) for x in s[i]))
                total -= sum((s[i][j] - lse) / len(pos) for j in pos) / B
        got = run_step(model, batch, cfg, torch.Generator())["itc_loss"]
        assert float(got.detach()) == pytest.approx(total / 2, rel=1e-5)
    off = cfg_for("clip")  # dedupe none: plain one-hot ITC, duplicates are negatives
    i2t, t2i, _, _ = sims(model, make_batch(DUP))
    plain = -sum(s[i][i] - max(s[i]) - math.log(sum(math.exp(x - max(s[i])) for x in s[i]))
                 for s in (i2t, t2i) for i in range(B)) / (2 * B)
    got = run_step(model, make_batch(DUP), off, torch.Generator())["itc_loss"]
    assert float(got.detach()) == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("negatives", ["sample", "hardest"])
def test_dedupe_caption_never_draws_a_duplicate_as_itm_negative(negatives):
    cfg = cfg_for("albef-base", "loss.dedupe=caption", f"loss.itm_negatives={negatives}", "loss.mlm=0")
    model = model_for(cfg)
    dup = lambda i, j: DUP[i] == DUP[j]
    batch, (i2t, t2i, hidden, tokens) = batch_without_near_ties(model, DUP, dup)
    calls = record_fuse(model)
    for seed in range(20 if negatives == "sample" else 1):
        calls.clear()
        out = run_step(model, batch, cfg, torch.Generator().manual_seed(seed))
        text_in, _, image_in = calls[0]
        assert text_in.shape[0] == 3 * B and torch.isfinite(out["itm_loss"])  # every row has a negative here
        for i in range(B):
            img = next(j for j in range(B) if torch.equal(image_in[B + i], tokens[j]))  # caption i's negative image
            txt = next(j for j in range(B) if torch.equal(text_in[2 * B + i], hidden[j]))  # image i's negative caption
            assert not dup(i, img) and not dup(i, txt) and img != i and txt != i
            if negatives == "hardest":  # the hardest among the allowed ones
                # Which copy of a duplicated caption is drawn is the tie rule's business, and the copies' embeddings
                # tie only up to the rounding of their rows: the rule is tested on exact ties in test_losses.
                assert img == ref_argmax_off_diag(t2i, dup)[i] and DUP[txt] == DUP[ref_argmax_off_diag(i2t, dup)[i]]


def test_dedupe_caption_rows_without_any_negative_sit_out_of_itm():
    cfg = cfg_for("albef-base", "loss.dedupe=caption", "loss.mlm=0")
    model = model_for(cfg)
    caps = ["same"] * 4 + ["other", "third"]  # the four "same" rows can only pair with 4 and 5
    batch = make_batch(caps)
    calls = record_fuse(model)
    run_step(model, batch, cfg, torch.Generator())
    assert calls[0][0].shape[0] == 3 * B
    calls.clear()
    batch = make_batch(["same"] * B)  # nothing but duplicates: no negative at all, only the B positives count
    logits = []
    itm_logits = model.itm_logits
    model.itm_logits = lambda fused: logits.append(itm_logits(fused)) or logits[-1]
    out = run_step(model, batch, cfg, torch.Generator())
    # every row is fused (a fixed 3B: no read of how many have a negative); the negative rows sit out of the loss
    assert calls[0][0].shape[0] == 3 * B and torch.isfinite(out["itm_loss"])
    positives = logits[0][:B].detach().double()
    want = sum(-positives[i].log_softmax(dim=0)[1] for i in range(B)) / B  # CE of the positives, label match
    assert out["itm_loss"].item() == pytest.approx(want.item(), rel=1e-5)  # float32 logits, 2-way softmax


@pytest.mark.parametrize("masked_all", [False, True])
def test_mlm_loss_from_masked_positions_only_equals_the_full_vocabulary_loss(masked_all):
    """train_step scores the vocabulary at the masked positions only; the loss must be ALBEF's: (1 - alpha) CE +
    alpha soft CE against the momentum model's distribution, at every masked position, from full (B, L, V) logits."""
    from vltrain.losses import mlm_mask
    cfg = cfg_for("albef", "loss.itm=0", "loss.itc=0", "loss.mlm_prob=0.4",
                  *(["loss.masked_text_all=true"] if masked_all else []))
    model, batch = model_for(cfg), make_batch(CAPTIONS)
    alpha = 0.4
    out = run_step(model, batch, cfg, torch.Generator().manual_seed(7), alpha=alpha)
    # The same draw (the MLM mask is the step's first use of the generator with ITM off), then full logits.
    tok = build_tokenizer(cfg.model)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    masked, labels = mlm_mask(ids, 0.4, tok.all_special_ids, tok.mask_token_id, model.text_encoder.config.vocab_size,
                              torch.Generator().manual_seed(7))
    with torch.no_grad():
        image_tokens, _ = model.encode_image(batch["images"])
        logits = model.mlm_logits(model.fuse(model.encode_text(masked, mask)[0], mask, image_tokens))
        mom = model.momentum
        soft = mom.mlm_logits(mom.fuse(mom.encode_text(masked, mask)[0], mask,
                                       mom.encode_image(batch["images"])[0])).softmax(dim=-1)
    terms = []
    for i in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if labels[i, j] == -100:
                continue
            logp = logits[i, j].double().log_softmax(dim=0)
            ce = -logp[labels[i, j]].item()
            soft_ce = -(soft[i, j].double() * logp).sum().item()
            terms.append((1 - alpha) * ce + alpha * soft_ce)
    assert len(terms) > 0
    assert out["mlm_loss"].item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)

"""MLM's masked positions taken at a size the host knows (vltrain.losses.mlm_cap, mlm_rows): no read of their count
from the device, the loss the boolean index gave, and the positions past the cap counted, not lost unseen."""

import math

import pytest
import torch

from tests.conftest import default_float64  # noqa: F401  (fixture)
from tests.vltrain.test_fidelity import CAPTIONS, cfg_for, make_batch, model_for
from vltrain import step as step_mod
from vltrain.losses import MLM_TAIL, mlm_cap, mlm_loss, mlm_mask, mlm_rows
from vltrain.model import build_tokenizer, host_ends
from vltrain.objectives import Draws
from vltrain.objectives import masked_lm as masked_lm_mod
from vltrain.objectives.masked_lm import masked_lm_loss


def binomial_tail(n: int, p: float, c: int) -> float:
    """P(X > c) for X ~ Binomial(n, p), summed term by term in log space."""
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
            + (n - k) * math.log1p(-p) for k in range(c + 1, n + 1)]
    return math.fsum(math.exp(x) for x in logs)


@pytest.mark.parametrize("p", [0.01, 0.15, 0.5, 0.9])
def test_the_cap_is_exceeded_with_probability_below_the_tail(p):
    # the selection probability as float32 uniforms give it: p rounded up to their grid (step 2^-24 at most)
    q = p + 2.0 ** -24
    for n in (0, 1, 5, 16, 30, 64, 100, 512, 3840, 5120):
        cap = mlm_cap(n, p)
        assert 0 <= cap <= n
        assert binomial_tail(n, q, cap) < MLM_TAIL, (n, p, cap)


def test_the_cap_at_a_typical_batch():
    """docs/TRAINING.md's figure: B = 128 captions of 30 real tokens at 15%: 725 rows for an expected 576, and the
    exact binomial bound at the same tail (the smallest c with P(X > c) < 1e-9) is 713."""
    n, p = 128 * 30, 0.15
    assert mlm_cap(n, p) == 725
    exact = next(c for c in range(int(n * p), n + 1) if binomial_tail(n, p + 2.0 ** -24, c) < MLM_TAIL)
    assert exact == 713
    assert round(mlm_cap(n, p) / (n * p), 2) == 1.26


def test_mlm_rows_are_the_first_masked_positions_in_row_order():
    g = torch.Generator().manual_seed(0)
    labels = torch.where(torch.rand(5, 7, generator=g) < 0.3, torch.randint(1, 99, (5, 7), generator=g), -100)
    flat = labels.reshape(-1)
    where = [i for i in range(flat.numel()) if flat[i] != -100]  # row order
    count = len(where)
    assert count > 4
    for cap in (0, 4, count, count + 6):
        rows, kept, left_out = mlm_rows(labels, cap)
        assert rows.shape == kept.shape == (cap,)
        used = min(cap, count)
        assert rows[:used].tolist() == where[:used]
        assert kept[:used].tolist() == [int(flat[i]) for i in where[:used]]
        assert kept[used:].tolist() == [-100] * (cap - used)  # the fill, out of the loss
        assert rows[used:].tolist() == [0] * (cap - used)  # a real row: its logits are finite
        assert int(left_out) == max(0, count - cap)


def boolean_index_loss(model, batch: dict, masked: torch.Tensor, labels: torch.Tensor, alpha: float,
                       limit: int | None = None) -> float:
    """ALBEF's MLM loss as the step took it before: the masked positions by a boolean index (a count the host reads),
    the first `limit` of them in row order (None: all), then the mean of (1 - alpha) CE + alpha soft CE against the
    momentum model's distribution, position by position."""
    mask = batch["attention_mask"]
    with torch.no_grad():
        picked = labels != -100
        logits = model.mlm_logits(model.fuse(model.encode_text(masked, mask)[0], mask,
                                             model.encode_image(batch["images"])[0])[picked])
        mom = model.momentum
        soft = mom.mlm_logits(mom.fuse(mom.encode_text(masked, mask)[0], mask,
                                       mom.encode_image(batch["images"])[0])[picked]).softmax(dim=-1)
    targets = labels[picked]
    terms = []
    for i in range(logits.shape[0] if limit is None else limit):
        logp = logits[i].log_softmax(dim=0)
        terms.append((1 - alpha) * -float(logp[targets[i]]) + alpha * -float((soft[i] * logp).sum()))
    return math.fsum(terms) / len(terms)


def mlm_case(preset_sets: tuple, ends: bool, prob: float = 0.4):
    """A tiny albef model in eval mode (no dropout), a batch, and an MLM draw for it."""
    cfg = cfg_for("albef", "loss.itm=0", "loss.itc=0", f"loss.mlm_prob={prob}", *preset_sets)
    model, batch = model_for(cfg), make_batch(CAPTIONS)
    if ends:
        batch["text_ends"] = host_ends(batch["attention_mask"])
    tok = build_tokenizer(cfg.model)
    draw = mlm_mask(batch["input_ids"], prob, tok.all_special_ids, tok.mask_token_id,
                    model.text_encoder.config.vocab_size, torch.Generator().manual_seed(7))
    return cfg, model, batch, draw


# float64 both sides: the same arithmetic but for the head's row count and the sums' order, each op rounding to
# 2^-53 relative over a few hundred ops a term: far below 1e-12 relative
@pytest.mark.parametrize("masked_all", [False, True])
@pytest.mark.parametrize("ends", [False, True])
def test_the_loss_is_the_boolean_index_loss(default_float64, masked_all, ends):
    cfg, model, batch, (masked, labels) = mlm_case(("loss.masked_text_all=true",) if masked_all else (), ends)
    alpha = 0.4
    rows_seen = []
    head = model.mlm_logits
    model.mlm_logits = lambda x: rows_seen.append(x.shape[0]) or head(x)
    f = step_mod.encode(model, batch, cfg.loss, Draws(mlm=(masked, labels)))
    out = masked_lm_loss(model, f, cfg.loss, Draws(mlm=(masked, labels)), None, alpha, True, fixed=True)
    model.mlm_logits = head
    # the host's bound: the rows' real tokens when it knows their ends, else every position
    n = sum(batch["text_ends"]) if ends else labels.numel()
    assert rows_seen == [mlm_cap(n, 0.4)]
    assert int(out["mlm_overflow"]) == 0
    assert out["mlm_loss"].dtype == torch.float64
    assert float(out["mlm_loss"].detach()) == pytest.approx(boolean_index_loss(model, batch, masked, labels, alpha), rel=1e-12)
    # train_step's mlm_loss is this one (the same draw: with ITM off, MLM's mask is the generator's first use), on a
    # CPU taken by the boolean index (fixed_rows): the masked rows alone, the same loss up to the sums' rounding
    rows_seen.clear()
    model.mlm_logits = lambda x: rows_seen.append(x.shape[0]) or head(x)
    step = step_mod.train_step(model, batch, cfg.loss, Draws(mlm=(masked, labels)), alpha=alpha)
    model.mlm_logits = head
    assert rows_seen == [int((labels != -100).sum())]
    assert float(step["mlm_loss"].detach()) == pytest.approx(float(out["mlm_loss"].detach()), rel=1e-12)
    # the count rides along for the flush to report, and is not a loss: the total is the weighted mlm_loss alone
    assert int(step["mlm_overflow"]) == 0
    assert float(step["total"].detach()) == cfg.loss.mlm * float(step["mlm_loss"].detach())


def test_past_the_cap_the_first_positions_are_kept_and_the_rest_counted(default_float64, monkeypatch):
    cfg, model, batch, (masked, labels) = mlm_case((), True)
    count = int((labels != -100).sum())
    assert count > 3
    monkeypatch.setattr(masked_lm_mod, "mlm_cap", lambda n, prob: 3)
    f = step_mod.encode(model, batch, cfg.loss, Draws(mlm=(masked, labels)))
    out = masked_lm_loss(model, f, cfg.loss, Draws(mlm=(masked, labels)), None, 0.4, True, fixed=True)
    assert int(out["mlm_overflow"]) == count - 3
    want = boolean_index_loss(model, batch, masked, labels, 0.4, limit=3)
    assert float(out["mlm_loss"].detach()) == pytest.approx(want, rel=1e-12)


def test_nothing_masked_gives_zero_with_the_graph_connected():
    cfg, model, batch, (masked, labels) = mlm_case((), True)
    labels = torch.full_like(labels, -100)
    f = step_mod.encode(model, batch, cfg.loss, Draws(mlm=(masked, labels)))
    out = masked_lm_loss(model, f, cfg.loss, Draws(mlm=(masked, labels)), None, 0.4, True, fixed=True)
    assert float(out["mlm_loss"].detach()) == 0.0 and out["mlm_loss"].requires_grad
    assert int(out["mlm_overflow"]) == 0


@pytest.mark.slow  # Inductor generates and builds C++ for a forward and a backward (~15 s on 2 busy cores)
def test_inductor_traces_the_selection_as_one_graph_with_the_eager_numbers():
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    states = torch.randn(4, 9, 8, generator=g, requires_grad=True)
    labels = torch.where(torch.rand(4, 9, generator=g) < 0.3, torch.randint(0, 11, (4, 9), generator=g), -100)
    head = torch.randn(8, 11, generator=g)
    cap = mlm_cap(labels.numel(), 0.3)

    def loss(states, labels):
        rows, kept, left_out = mlm_rows(labels, cap)
        return mlm_loss(states.flatten(0, 1)[rows] @ head, kept), left_out

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled, left_c = torch.compile(loss, backend="inductor", dynamic=False, fullgraph=True)(states, labels)
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        (grad_c,) = torch.autograd.grad(compiled, states)
    finally:
        torch._dynamo.reset()
    eager, left_e = loss(states, labels)
    (grad_e,) = torch.autograd.grad(eager, states)
    assert graphs == 1 and breaks == {}
    assert int(left_c) == int(left_e) == 0
    # float32, a chain of a few dozen ops reordered by Inductor's fusion: 1e-5 relative as test_compile_step derives
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-6)


def test_mlm_mask_leaves_the_special_tokens_as_isin_finds_them():
    """mlm_mask compares one special id at a time (no tensor of the ids copied from the host): the positions it may
    select are exactly those torch.isin finds outside the special ids."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 12, (6, 9), generator=g)
    special = [0, 3, 7, 3]  # a repeated id changes nothing
    _, labels = mlm_mask(ids, 1.0, special, 11, 12)
    outside = ~torch.isin(ids, torch.tensor(special))
    assert torch.equal(labels != -100, outside)
    assert torch.equal(labels[outside], ids[outside])


def test_a_gaussian_six_sigma_bound_would_not_hold_for_short_batches():
    """Why mlm_cap uses Bernstein's bound: n p + 6 sqrt(n p (1 - p)) + 1 is exceeded far more often than 1e-9 when
    n p is small (the binomial's right tail is longer than the Gaussian's); mlm_cap holds there (first test)."""
    n, p = 16, 0.15
    gauss = math.floor(n * p + 6 * math.sqrt(n * p * (1 - p)) + 1)
    assert binomial_tail(n, p, gauss) > 100 * MLM_TAIL
    assert binomial_tail(n, p + 2.0 ** -24, mlm_cap(n, p)) < MLM_TAIL


@pytest.mark.slow  # a 2-step run
def test_a_step_past_the_cap_is_said_and_written_to_its_row(tmp_path, monkeypatch, capsys):
    import json

    from tests.conftest import ontology_dataset
    from tests.vltrain.test_host_reads import PER_PRESET, TINY
    from vltrain.config_load import load_config
    from vltrain.train import train

    onto = ontology_dataset(tmp_path)
    monkeypatch.setattr(masked_lm_mod, "mlm_cap", lambda n, prob: 1)
    monkeypatch.setattr(masked_lm_mod, "fixed_rows", lambda labels: True)  # the GPU's way, on this CPU
    cfg = load_config("albef", shards=[str(onto)], out=str(tmp_path / "run"), steps=2, batch_size=4, device="cpu",
                      sets=TINY + PER_PRESET["albef"] + ["log_every=1", "loss.mlm_prob=0.5"])
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "total" in r]
    assert len(steps) == 2 and all(r["mlm_overflow"] >= 1 for r in steps)
    out = " ".join(capsys.readouterr().err.split())  # the run reports to stderr
    assert f"step 1: MLM masked {steps[0]['mlm_overflow']} positions past its cap" in out


def test_the_fixed_size_is_taken_on_a_gpu_and_in_a_graph_and_the_boolean_index_on_a_cpu():
    """A CPU reads a boolean index's count for free and scores the masked rows alone; any other device (a sync per
    read) and a compiled graph (static shapes) take mlm_cap rows."""
    assert not masked_lm_mod.fixed_rows(torch.zeros(2, 3, dtype=torch.long))
    assert masked_lm_mod.fixed_rows(torch.zeros(2, 3, dtype=torch.long, device="meta"))
    seen = []
    torch._dynamo.reset()
    torch.compile(lambda x: seen.append(masked_lm_mod.fixed_rows(x)) or x + 1, backend="eager")(torch.zeros(2))
    assert seen == [True]

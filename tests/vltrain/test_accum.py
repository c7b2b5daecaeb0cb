"""train.accum_steps: the towers on B/K rows at a time give the losses and gradients of one batch of B.

Tolerances (float64, eps = 2^-53 ~ 1.1e-16): chunking changes no formula, only the shapes the tower kernels see (a
matmul over B/K rows may block and sum in another order than over B), so K > 1 and K = 1 differ by rounding. A
gradient's rounding error is a few eps times the sum of the magnitudes of the terms it adds up, not of their sum:
where the terms cancel (an attention key bias, which softmax ignores; TOnICS' near-uniform scores at init) the
gradient is tiny and the error is not. The terms are O(1) at most here (the loss's slope in a logit is <= 1/B, the
tiny towers' weights and activations O(1)), so |g_K - g_1| <= REL |g_1| + ATOL with REL = 1e-10 and ATOL = 1e-12
(10^4 eps for ~20 ops deep) covers rounding and still catches a real error (a row lost or counted twice moves a
gradient by O(1) of itself). Against the same chunks computed with gradient in one graph the three phases do the
same arithmetic, and agree to ATOL = 1e-16.
"""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from tests.vltrain.test_fidelity import make_batch
from tests.vltrain.test_presets_pinned import PER_PRESET, float64, onto  # noqa: F401  (fixtures)
from tests.vltrain.test_presets_pinned import TINY as PIN_TINY
from vltrain import accum, session
from vltrain.accum import AccumStep, accumulated_step
from vltrain.cli import app
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.model import build_model
from vltrain.optim import build_optimizer, optimizer_step
from vltrain.step import train_step

PRESETS = ["clip", "albef", "grit", "softmask", "tonics", "sigmoid"]
# "sigmoid": SigLIP's loss (loss.itc_kind=sigmoid) on the clip preset, its bias a trained parameter
SIGMOID = ("clip", ["loss.itc_kind=sigmoid"])
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.max_len=12",
        "optim.lr=0.01"]
B = 8
CAPTIONS = [f"a photo of thing {i} and colour {i % 3} with a dog" for i in range(B)]
REL = 1e-10
ATOL = 1e-12


def set_dropout(model, p: float) -> None:
    """Every dropout of the model (nn.Dropout, and the fusion layers' attention-probability rate) set to p."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
        if isinstance(getattr(m, "attn_drop", None), float):
            m.attn_drop = p


def cfg_for(preset: str, *sets: str):
    if preset == "sigmoid":
        preset, sets = SIGMOID[0], (*SIGMOID[1], *sets)
    fusion = ["model.fusion_layers=1"] if load_config(preset).model.fusion_layers else []
    return load_config(preset, sets=[*TINY, *fusion, *PER_PRESET.get(preset, []), *sets])


def batch_for(cfg) -> dict:
    batch = make_batch(CAPTIONS)
    if cfg.data.triplets:  # TOnICS: the noun spans; here the first two word pieces of each caption
        noun = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        noun[:, 1:3] = True
        batch["noun_mask"] = noun
    return batch


def one_step(model, cfg, batch, k: int, seed: int = 1) -> tuple[dict, dict, torch.Generator]:
    """One optimiser step with K = k (grad_clip 0, so the .grad left behind is the raw gradient): (losses as
    floats, every parameter's gradient, the generator after)."""
    optimizer, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(seed)
    if k == 1:
        losses = train_step(model, batch, cfg.loss, generator, None, 0.4)
        optimizer_step(model, optimizer, params, losses["total"], 0.0, losses.pop("queue_feats"))
    else:
        losses = accumulated_step(model, batch, cfg.loss, generator, None, 0.4, k, optimizer, params, 0.0)
        assert losses.pop("stepped") is True
        losses.pop("queue_feats")
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return {n: float(v.detach()) for n, v in losses.items()}, grads, generator


def assert_same_grads(got: dict, want: dict, atol: float = ATOL) -> None:
    """Each parameter's gradient within REL of its largest entry, or ATOL."""
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert (got[name] is None) == (g is None), name
        if g is not None:
            assert float((got[name] - g).abs().max()) <= REL * float(g.abs().max()) + atol, name


def reference_grads(model, cfg, batch, k: int, seed: int = 1) -> tuple[float, dict]:
    """(total, gradients) of one graph through the towers run in the same k chunks WITH gradient (the momentum
    copy's in the same chunks, without), the losses on top, one backward: what GradCache's three phases must
    reproduce in the same arithmetic."""
    ref = copy.deepcopy(model)
    for m in [ref] if ref.momentum is None else [ref, ref.momentum]:  # the momentum copy's calls chunked too
        for name in accum.TOWERS:
            setattr(m, name, lambda *a, real=getattr(m, name): chunked_with_grad(real, k, *a))
    torch.manual_seed(seed)
    losses = train_step(ref, batch, cfg.loss, torch.Generator().manual_seed(0), None, 0.4)
    losses["total"].backward()
    return float(losses["total"].detach()), {n: None if p.grad is None else p.grad.clone()
                                             for n, p in ref.named_parameters()}


def chunked_with_grad(real, k: int, *args):
    """The same chunks as phase 1, in the same order, but with gradient, concatenated."""
    parts = [real(*[a[rows] if isinstance(a, torch.Tensor) else a for a in args])
             for rows in [slice(int(c[0]), int(c[-1]) + 1) for c in torch.arange(args[0].shape[0]).tensor_split(k)]]
    return tuple(torch.cat(p) for p in zip(*parts))


def seeded_model(cfg, dropout: float):
    """The config's model built from seed 0, in train mode, every dropout rate at `dropout`."""
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    set_dropout(model, dropout)
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_k_chunks_give_the_losses_gradients_and_draws_of_one_batch(default_float64, preset):
    cfg = cfg_for(preset)
    model = seeded_model(cfg, 0.0)
    batch = batch_for(cfg)
    models = {k: copy.deepcopy(model) for k in (1, 2, 4)}
    want, want_grads, want_gen = one_step(models[1], cfg, batch, 1)
    assert sum(g is not None for g in want_grads.values()) > 0
    for k in (2, 4):
        got, got_grads, got_gen = one_step(models[k], cfg, batch, k)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=REL, abs=1e-14), (k, name)
        assert_same_grads(got_grads, want_grads)
        # against the same chunked arithmetic with gradient, the three phases agree to a few float64 roundings
        ref_total, ref_grads = reference_grads(model, cfg, batch, k)
        assert got["total"] == pytest.approx(ref_total, rel=1e-14)
        assert_same_grads(got_grads, ref_grads, atol=1e-16)
        assert torch.equal(got_gen.get_state(), want_gen.get_state())  # every per-step draw made once, as K = 1
        # The step applied: the parameters (and momentum copy, queues) after it agree too. AdamW's first step moves
        # a weight by lr g / (|g| + eps), whose slope in g is at most lr / eps: a gradient off by delta moves it by
        # at most lr * delta / eps.
        atol = cfg.optim.lr * ATOL / 1e-8
        for (n, a), b in zip(models[1].state_dict().items(), models[k].state_dict().values()):
            assert torch.allclose(a.double(), b.double(), rtol=0, atol=atol), (k, n)


def test_unpadded_length_groups_and_channels_last_still_match(default_float64):
    cfg = cfg_for("albef")
    model = seeded_model(cfg, 0.0)
    model.set_unpad(4)
    model.image_encoder.to(memory_format=torch.channels_last)
    batch = batch_for(cfg)
    batch["input_ids"][::2, 5:] = 0  # captions of several lengths, so the length groups differ by chunk
    batch["attention_mask"][::2, 5:] = 0
    batch["images"] = batch["images"].contiguous(memory_format=torch.channels_last)
    want, want_grads, _ = one_step(copy.deepcopy(model), cfg, batch, 1)
    got, got_grads, _ = one_step(copy.deepcopy(model), cfg, batch, 4)
    assert got == pytest.approx(want, rel=REL)
    assert_same_grads(got_grads, want_grads)


@pytest.mark.parametrize("preset", ["albef", "softmask"])
def test_with_dropout_the_recompute_replays_each_chunks_masks(default_float64, preset):
    cfg = cfg_for(preset)
    model = seeded_model(cfg, 0.1)
    batch = batch_for(cfg)
    want_total, want = reference_grads(model, cfg, batch, 2)
    got, got_grads, _ = one_step(model, cfg, batch, 2)
    assert got["total"] == pytest.approx(want_total, rel=REL)
    assert_same_grads(got_grads, want)
    # and dropout is really on: K = 1 draws other masks, so its loss differs
    torch.manual_seed(1)
    plain = train_step(copy.deepcopy(model), batch, cfg.loss, torch.Generator().manual_seed(0), None, 0.4)
    assert float(plain["total"].detach()) != pytest.approx(want_total, rel=1e-6)


def test_queue_and_momentum_advance_once_per_optimiser_step(default_float64):
    cfg = cfg_for("albef")
    model = seeded_model(cfg, 0.0)
    assert cfg.model.queue_size == 16 and int(model.queue_ptr) == 0
    before = {n: p.clone() for n, p in model.momentum.named_parameters()}
    optimizer, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    accumulated_step(model, batch_for(cfg), cfg.loss, torch.Generator().manual_seed(0), None, 0.4, 4, optimizer,
                     params, 1.0)
    assert int(model.queue_ptr) == B  # B keys enqueued once, not B/K keys K times
    # one EMA update: theta_m <- m theta_m + (1 - m) theta, with theta the stepped parameters
    m = cfg.model.momentum_m
    online = dict(model.named_parameters())
    assert before
    for name, mom in model.momentum.named_parameters():
        want = m * before[name] + (1 - m) * online[name].detach()
        assert torch.allclose(mom, want, rtol=0, atol=1e-14), name


def test_the_step_object_keeps_no_tower_patch_and_resumes_the_dropout_stream(default_float64):
    cfg = cfg_for("clip")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    step = AccumStep(model, 2)
    torch.manual_seed(3)
    losses = step(batch_for(cfg), cfg.loss, torch.Generator().manual_seed(0), None, 0.0)
    assert "encode_image" not in model.__dict__ and "encode_text" not in model.__dict__
    after_phase1 = torch.get_rng_state()
    optimizer, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    step.optimizer_step(model, optimizer, params, losses["total"], 1.0, losses.pop("queue_feats"))
    assert torch.equal(torch.get_rng_state(), after_phase1)  # the replay's rewinding is undone


def test_batch_size_not_divisible_by_accum_steps_is_one_line():
    with pytest.raises(ConfigError, match=r"train.accum_steps=3 must divide batch_size=8") as e:
        load_config("clip", batch_size=8, sets=["train.accum_steps=3"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"train.accum_steps=0 is outside its range"):
        load_config("clip", batch_size=8, sets=["train.accum_steps=0"])
    assert load_config("clip").train.accum_steps == 1


def rows_of(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k.endswith("loss") or k in ("total", "step")} for r in rows if "total" in r]


@pytest.mark.parametrize("preset", ["clip", "albef", "grit", "softmask", "tonics"])
def test_vltrain_run_with_accum_steps_4_writes_the_metrics_of_accum_steps_1(onto, tmp_path, float64, monkeypatch,
                                                                            preset):
    """Every preset through `vltrain run` in float64: K = 4 alone, and K = 4 with gradient checkpointing (which
    recomputes the same operations on the same inputs, so it adds no rounding), log K = 1's losses.

    Two steps: step 1's losses are those of the seed-0 weights, step 2's those after one accumulated optimiser step
    (warm-up lr / 3 > 0; ALBEF's queue and momentum copy advanced), so the update K = 4 applies is compared too.
    Only the step rows are read: no held-out split (val_frac 0, no evaluation) where the preset allows it; TOnICS
    needs held-out images for its refresh check."""
    def no_dropout(*a, **kw):
        model = build_model(*a, **kw)
        set_dropout(model, 0.0)
        return model

    monkeypatch.setattr(session, "build_model", no_dropout)
    outs = {}
    arms = {"k1": ["train.accum_steps=1"], "k4": ["train.accum_steps=4"],
            "k4-ckpt": ["train.accum_steps=4", "train.grad_checkpointing=true"]}
    for name, extra in arms.items():
        outs[name] = tmp_path / name
        no_val = [] if preset == "tonics" else ["data.val_frac=0"]
        sets = [x for s in [*PIN_TINY, *PER_PRESET[preset], *extra, "eval_every=100", *no_val] for x in ("--set", s)]
        batch = "8" if preset == "tonics" else "16"  # TOnICS' batches are same-object: 8 images of one class
        r = CliRunner().invoke(app, ["run", str(onto), "--preset", preset, "--out", str(outs[name]), "--batch-size",
                                     batch, "--steps", "2", "--device", "cpu", *sets])
        assert r.exit_code == 0, r.output
    want = rows_of(outs["k1"])
    for name in ("k4", "k4-ckpt"):
        got = rows_of(outs[name])
        assert [r["step"] for r in got] == [1, 2]
        for a, b in zip(got, want):
            assert a.keys() == b.keys()
            for key in b:  # AdamW's eps = 1e-8 amplifies a gradient's float64 rounding: the pinned tests' 1e-9
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), (name, a["step"], key)
    assert rows_of(outs["k4-ckpt"]) == rows_of(outs["k4"])  # checkpointing: bit for bit


def test_a_grad_scaler_scales_the_phase_2_loss_once(default_float64, monkeypatch):
    """fp16's GradScaler: phase 2 backpropagates scale * loss, so every gradient (the heads' from phase 2, the towers'
    from the replay of the scaled leaf gradients) is scale times K = 1's; a power of two scales exactly."""
    cfg = cfg_for("albef")
    model = seeded_model(cfg, 0.0)
    batch = batch_for(cfg)
    _, want, _ = one_step(copy.deepcopy(model), cfg, batch, 1)
    scaled = copy.deepcopy(model)
    optimizer, params = build_optimizer(scaled, cfg.optim, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    seen = {}

    def apply(model, optimizer, params, grad_clip, enqueue, scaler_given):  # the gradients apply_gradients receives
        assert scaler_given is scaler
        seen.update({n: None if p.grad is None else p.grad / 1024.0 for n, p in model.named_parameters()})
        return True

    monkeypatch.setattr(accum, "apply_gradients", apply)
    torch.manual_seed(1)
    step = AccumStep(scaled, 2)
    losses = step(batch, cfg.loss, torch.Generator().manual_seed(0), None, 0.4)
    assert step.optimizer_step(scaled, optimizer, params, losses["total"], 0.0, losses.pop("queue_feats"), scaler)
    assert_same_grads(seen, want)


def test_batchnorm_statistics_count_each_chunk_once_not_again_in_the_replay(default_float64):
    """A trained image tower with BatchNorm: its running statistics are those of phase 1's K chunks (the replay
    restores them), i.e. of the tower run on each chunk in turn."""
    cfg = cfg_for("clip")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.image_encoder.insert(1, torch.nn.BatchNorm2d(16))
    batch = batch_for(cfg)
    ref = copy.deepcopy(model.image_encoder)
    with torch.no_grad():
        for rows in (slice(0, 4), slice(4, 8)):
            ref(batch["images"][rows])
    optimizer, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    accumulated_step(model, batch, cfg.loss, torch.Generator().manual_seed(0), None, 0.0, 2, optimizer, params, 1.0)
    bn = model.image_encoder[1]
    assert int(bn.num_batches_tracked) == 2
    assert torch.allclose(bn.running_mean, ref[1].running_mean, rtol=0, atol=1e-15)
    assert torch.allclose(bn.running_var, ref[1].running_var, rtol=0, atol=1e-15)

"""train.precision: fp16 autocast with a loss scaler (a step with inf / NaN gradients is skipped whole, counted, and
leaves the schedule where it was; the scale survives a resume), and what `auto` picks on each kind of device."""

import copy
import json
import math
import types

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from tests.vltrain.test_speed import tiny_albef
from tests.vltrain.test_train import losses, run
from vltrain import train as train_mod
from vltrain.cli import app
from vltrain.config import ConfigError, ModelConfig, OptimConfig
from vltrain.config_load import load_config
from vltrain.errors import TrainError
from vltrain.model import autocast, bf16_supported, build_model
from vltrain.optim import apply_gradients, build_optimizer, lr_at, optimizer_step
from vltrain.resume import RunState
from vltrain.session import resolve_precision
from vltrain.step import train_step

FP16 = ["--preset", "clip", "--set", "train.precision=fp16"]


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"total"' in line]


def fresh_scale() -> tuple[float, float]:
    """(the initial scale, the backoff factor) of a GradScaler at torch's defaults, as the trainer builds it."""
    scaler = torch.amp.GradScaler("cpu")
    return scaler.get_scale(), scaler.get_backoff_factor()


def watch(monkeypatch, inf_calls=frozenset()) -> list:
    """The trainer's optimizer steps of the next run, each call's result appended to the list returned; in the calls
    numbered `inf_calls` (1-based) one parameter's gradient is made inf."""
    real = train_mod.optimizer_step
    applied = []

    def step(model, optimizer, params, loss, *args):
        hit = len(applied) + 1 in inf_calls
        hook = params[0].register_hook(lambda g: torch.full_like(g, math.inf)) if hit else None
        try:
            applied.append(real(model, optimizer, params, loss, *args))
        finally:
            if hook is not None:
                hook.remove()
        return applied[-1]

    monkeypatch.setattr(train_mod, "optimizer_step", step)
    return applied


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("fp16"), 24)


@pytest.fixture(scope="module")
def clean(shards, tmp_path_factory):
    """A 4-step fp16 run and the result of each of its optimizer steps."""
    out = tmp_path_factory.mktemp("clean") / "run"
    with pytest.MonkeyPatch.context() as mp:
        applied = watch(mp)
        r = run(shards, out, "--steps", "4", *FP16)
    assert r.exit_code == 0, r.output + repr(r.exception)
    return out, applied, r.output


def consumed(ckpt: dict, output: str) -> int:
    per_epoch = int(output.split(" epochs of ")[1].split()[0])
    return ckpt["epoch"] * per_epoch + ckpt["consumed"]


def test_fp16_on_a_cpu_trains_and_counts_the_steps_its_first_scale_skips(clean):
    """torch's first scale (2^16) overflows some float16 gradients of the first steps: those steps are skipped and
    counted, each halving the scale, as loss scaling is meant to settle. The count is the scale's fall."""
    out, applied, output = clean
    assert "fp16 autocast, loss scaling, train.precision=fp16, slow on a CPU" in output
    train_rows = rows(out)
    assert [x["step"] for x in train_rows] == [1, 2, 3, 4] and applied.count(True) == 4
    assert all(math.isfinite(x["total"]) for x in train_rows)
    skips = [x["skipped_steps"] for x in train_rows]
    assert skips == [applied[:i].count(False) for i, ok in enumerate(applied, 1) if ok]
    ckpt = torch.load(out / "last.pt", weights_only=True)
    init, backoff = fresh_scale()
    assert ckpt["precision"] == "fp16" and ckpt["skipped_steps"] == skips[-1] == applied.count(False)
    assert ckpt["scaler"]["scale"] == init * backoff ** skips[-1]  # growth only after 2000 good steps in a row
    assert consumed(ckpt, output) == len(applied)  # every skipped batch was consumed
    assert {float(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {4.0}  # AdamW stepped 4 times


def test_losses_stay_float32_under_fp16_autocast():
    """fp16 autocast runs the matmuls in float16; the losses upcast (vltrain.losses.upcast), and parameters, their
    gradients (unscaled by the scaler) and AdamW's moments stay float32."""
    cfg, model, tok, batch = tiny_albef()
    opt, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    with autocast(torch.device("cpu"), "fp16"):
        out = train_step(model, batch, cfg.loss, torch.Generator().manual_seed(0), tok, 0.4)
        assert model.image_proj(torch.randn(2, model.image_proj.in_features)).dtype == torch.float16  # it is on
    feats = out.pop("queue_feats")
    # MLM's count of masked positions past its cap rides with the losses (read at the flush): an integer, 0 here
    overflow = out.pop("mlm_overflow")
    assert overflow.dtype == torch.int64 and int(overflow) == 0
    assert all(v.dtype == torch.float32 for v in out.values()), {k: v.dtype for k, v in out.items()}
    assert all(math.isfinite(float(v.detach())) for v in out.values())
    # the scaler's first scale (2^16) overflows these float16 gradients: it backs off until a step applies
    tries = 1
    while not optimizer_step(model, opt, params, out["total"], 1.0, feats, scaler):
        out["total"] = train_step(model, batch, cfg.loss, torch.Generator().manual_seed(0), tok, 0.4)["total"]
        tries += 1
        assert tries < 20
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in params if p.grad is not None)
    assert all(t.dtype == torch.float32 for s in opt.state.values() for k, t in s.items() if k != "step")
    assert model.image_queue.dtype == torch.float32


def albef_tiny():
    model = build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=1,
                                    momentum=True, queue_size=16))
    return model.train()


def fill_grads(params, value=None):
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.01 * (i % 7 + 1)) if value is None else torch.full_like(p, value)


def test_an_inf_gradient_skips_the_whole_step_and_halves_the_scale():
    torch.manual_seed(0)
    model = albef_tiny()
    optimizer, params = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # as a backward would: the scaler makes its scale on first use
    init, backoff = fresh_scale()
    keys = (torch.nn.functional.normalize(torch.randn(4, 16), dim=1),) * 2
    fill_grads(params)
    assert apply_gradients(model, optimizer, params, 1.0, keys, scaler)  # a normal step: AdamW state exists
    assert int(model.queue_ptr) == 4 and scaler.get_scale() == init
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(optimizer.state_dict())
    fill_grads(params)
    params[3].grad[0] = math.inf
    assert not apply_gradients(model, optimizer, params, 1.0, keys, scaler)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights, momentum copy, queues, queue_ptr
    opt_after = optimizer.state_dict()
    for i, s in opt_before["state"].items():
        assert all(torch.equal(v, opt_after["state"][i][k]) for k, v in s.items())  # moments and step count
    assert scaler.get_scale() == init * backoff
    # NaN skips alike
    fill_grads(params, math.nan)
    assert not apply_gradients(model, optimizer, params, 1.0, keys, scaler)
    assert scaler.get_scale() == init * backoff ** 2
    # the next finite step applies: weights, momentum copy and queue move, AdamW counts one more step
    fill_grads(params)
    assert apply_gradients(model, optimizer, params, 1.0, keys, scaler)
    moved = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], moved[k])}
    assert "queue_ptr" in changed and any(k.startswith("momentum.") for k in changed)
    assert any(not k.startswith("momentum.") and "queue" not in k for k in changed)
    assert int(model.queue_ptr) == 8
    steps = {float(s["step"]) for s in optimizer.state_dict()["state"].values()}
    assert steps == {2.0}
    assert scaler.get_scale() == init * backoff ** 2  # no growth before growth_interval good steps


def test_an_injected_inf_gradient_skips_that_step_only(clean, shards, tmp_path, monkeypatch):
    """The clean run's last optimizer call gets an inf gradient: it is skipped (counted, lr schedule not advanced),
    the next batch takes step 4 at half the scale; the steps before are the clean run's."""
    out0, applied0, _ = clean
    c = len(applied0)
    out = tmp_path / "skip"
    applied = watch(monkeypatch, {c})
    r = run(shards, out, "--steps", "4", *FP16)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert applied == applied0[:-1] + [False, True]
    clean_rows = rows(out0)
    train_rows = rows(out)
    drop = ("samples_per_s",)
    assert [{k: v for k, v in x.items() if k not in drop} for x in train_rows[:3]] == \
        [{k: v for k, v in x.items() if k not in drop} for x in clean_rows[:3]]
    assert train_rows[3]["skipped_steps"] == clean_rows[3]["skipped_steps"] + 1
    assert [x["lr"] for x in train_rows] == [lr_at(s, 0.01, 2, 4, OptimConfig().min_lr_ratio) for s in (1, 2, 3, 4)]
    ckpt = torch.load(out / "last.pt", weights_only=True)
    init, backoff = fresh_scale()
    assert ckpt["step"] == 4 and ckpt["skipped_steps"] == applied.count(False)
    assert ckpt["scaler"]["scale"] == torch.load(out0 / "last.pt", weights_only=True)["scaler"]["scale"] * backoff
    assert consumed(ckpt, r.output) == c + 1
    assert {float(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {4.0}


def test_a_resumed_fp16_run_keeps_its_scale_and_continues_exactly(shards, tmp_path, monkeypatch):
    """2 steps, then --resume to 4: the same losses and skips as a 4-step run. Both runs get an inf gradient in their
    first optimizer call, so the scale has fallen before the split on any CPU (whatever the model's own first
    steps do); a scale restarted at its initial value would differ after the resume."""
    whole = tmp_path / "whole"
    watch(monkeypatch, {1})
    assert run(shards, whole, "--steps", "4", *FP16).exit_code == 0
    split = tmp_path / "split"
    watch(monkeypatch, {1})
    assert run(shards, split, "--steps", "2", *FP16).exit_code == 0
    half = torch.load(split / "last.pt", weights_only=True)
    init, backoff = fresh_scale()
    assert half["skipped_steps"] >= 1
    assert half["scaler"]["scale"] == init * backoff ** half["skipped_steps"]
    watch(monkeypatch)  # the resumed process counts its calls afresh: no injection there
    r = run(shards, split, "--steps", "4", *FP16, "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "fp16 autocast, loss scaling, as the resumed run" in r.output
    assert losses(split) == losses(whole)
    assert losses(split, "skipped_steps") == losses(whole, "skipped_steps")
    assert torch.load(split / "last.pt", weights_only=True)["scaler"] == \
        torch.load(whole / "last.pt", weights_only=True)["scaler"]


def test_many_skips_in_a_row_stop_the_run_in_one_line(shards, tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "MAX_SKIPS", 3)
    watch(monkeypatch, set(range(1, 100)))
    r = run(shards, tmp_path / "collapse", "--steps", "4", *FP16)
    assert r.exit_code == 2, r.output
    assert "train.precision=fp16: 3 steps in a row had inf / NaN gradients after step 0" in r.output
    assert "Traceback" not in r.output


def test_skipped_counts_and_raises_after_max_skips():
    state = RunState(step=5, skipped=2)
    assert train_mod._skipped(state, 1) == 1
    assert state.step == 4 and state.skipped == 3
    with pytest.raises(TrainError, match="50 steps in a row"):
        train_mod._skipped(RunState(step=7), train_mod.MAX_SKIPS)


def test_a_non_finite_loss_under_fp16_stops_the_run_as_in_fp32_with_a_hint(tmp_path):
    """Not skipped like an inf gradient: the scale multiplies only the backward, so it cannot cure the forward."""
    run_ = types.SimpleNamespace(last_path=tmp_path / "last.pt", precision="fp16")
    with pytest.raises(TrainError, match=r"non-finite loss at step 3 \(total=inf\); under fp16 autocast the forward "
                                         "may have overflowed: try train.precision=bf16 or fp32$"):
        train_mod._finite({"total": torch.tensor(math.inf)}, 3, run_)
    run_.precision = "fp32"
    with pytest.raises(TrainError, match=r"non-finite loss at step 3 \(total=nan\)$"):
        train_mod._finite({"total": torch.tensor(math.nan)}, 3, run_)


class FakeCuda:
    """torch.cuda.is_bf16_supported for a card with native bf16 (compute capability >= 8.0) or without it (where
    torch's default, including_emulation=True, still says True)."""

    def __init__(self, native: bool):
        self.native = native
        self.asked = []

    def __call__(self, including_emulation: bool = True) -> bool:
        self.asked.append(including_emulation)
        return self.native or including_emulation


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # the autocast object is built, never entered
@pytest.mark.parametrize("native, want", [(True, "bf16"), (False, "fp16")])
def test_auto_on_cuda_is_bf16_only_where_the_card_has_it_natively(monkeypatch, native, want):
    fake = FakeCuda(native)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake)
    cuda = torch.device("cuda")
    assert bf16_supported(cuda) is native and fake.asked == [False]
    cfg = load_config("clip")
    p, why = resolve_precision(cfg, None, cuda, None, 0)
    assert p == want and why == f"auto on CUDA {'with' if native else 'without'} native bf16"
    assert resolve_precision(load_config("clip", sets=["train.precision=fp16"]), None, cuda, None, 0) == \
        ("fp16", "train.precision=fp16")
    bf16 = load_config("clip", sets=["train.precision=bf16"])
    if native:
        assert resolve_precision(bf16, None, cuda, None, 0) == ("bf16", "train.precision=bf16")
    else:
        with pytest.raises(TrainError, match="this device has no bf16 arithmetic.*use fp16, fp32 or auto"):
            resolve_precision(bf16, None, cuda, None, 0)
    # evaluation and inference follow the same rule
    ctx = autocast(cuda)
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == (torch.bfloat16 if native else torch.float16)


def test_auto_on_a_cpu_keeps_its_rule(monkeypatch):
    from vltrain import session

    model = build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16))
    cfg = load_config("clip")
    cpu = torch.device("cpu")
    monkeypatch.setattr(session, "bf16_supported", lambda device: False)
    assert resolve_precision(cfg, model, cpu, None, 0) == ("fp32", "auto: no bf16 arithmetic here")
    monkeypatch.setattr(session, "bf16_supported", lambda device: True)
    assert resolve_precision(cfg, model, cpu, None, 0) == ("fp32", "auto: a 32-wide text tower is too small to gain "
                                                                   "from bf16")
    assert isinstance(autocast(cpu), type(autocast(cpu, "fp32")))  # float32 on a CPU
    assert resolve_precision(cfg, model, cpu, {"precision": "fp16"}, 0) == ("fp16", "as the resumed run")


def test_a_bad_precision_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        load_config("clip", sets=["train.precision=half"])
    assert str(e.value) == "train.precision must be one of auto, fp32, bf16, fp16, got 'half'"
    r = CliRunner().invoke(app, ["config", "--set", "train.precision=half"])
    assert r.exit_code == 2 and "train.precision must be one of auto, fp32, bf16, fp16" in r.output

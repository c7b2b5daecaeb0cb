"""Gradient checkpointing (train.grad_checkpointing) and the model-wide dropout rate (model.dropout).

Checkpointing recomputes a layer's forward in the backward pass with the same inputs, the same kernels and (with
use_reentrant=False) the RNG state replayed, so every recomputed value is bit for bit the value the first forward
computed, and the backward then runs the same operations in the same order on the same numbers. The losses and
gradients with and without it are therefore compared for equality: any difference at all, even of float64
rounding, would mean the recompute read other inputs or drew other dropout masks.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from vltrain import step as step_mod
from vltrain.checkpoint import model_config
from vltrain.cli import app
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.model import build_model, build_tokenizer, length_groups
from vltrain.recompute import checkpointed, image_blocks

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.max_len=12"]
# Short and long captions, so that train.unpad's length groups split the batch (checkpointed there too)
CAPTIONS = [f"a photo of thing {i}" + (" with a long tail of many more words" * 3 if i % 2 else "") for i in range(24)]


def cfg_for(preset: str, *sets: str):
    fusion = ["model.fusion_layers=1"] if load_config(preset).model.fusion_layers else []  # the tiny BERT: 1 + 1
    return load_config(preset, sets=[*TINY, *fusion, *sets])


def make_batch(cfg, size: int = 32) -> dict:
    g = torch.Generator().manual_seed(0)
    tok = build_tokenizer(cfg.model)(CAPTIONS, padding="longest", return_tensors="pt")
    noun_mask = torch.zeros_like(tok["attention_mask"], dtype=torch.bool)
    noun_mask[:, 4] = True  # "thing": TOnICS' noun span
    return {"images": torch.randn(len(CAPTIONS), 3, size, size, generator=g), "input_ids": tok["input_ids"],
            "attention_mask": tok["attention_mask"], "captions": CAPTIONS, "noun_mask": noun_mask}


def step_with(model, cfg, batch, on: bool) -> tuple[dict, dict]:
    """One train_step and its backward from the same RNG states: (losses, every parameter's gradient)."""
    model.set_grad_checkpointing(on)
    model.zero_grad()
    torch.manual_seed(1)
    out = step_mod.train_step(model, batch, cfg.loss, torch.Generator().manual_seed(2))
    out["total"].backward()
    losses = {k: v.detach().clone() for k, v in out.items() if k == "total" or k.endswith("_loss")}
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("preset", ["clip", "albef", "grit", "softmask", "tonics"])
def test_checkpointing_gives_the_same_losses_and_gradients(default_float64, preset, dropout):
    """float64, training mode: with dropout off, and on (the recompute replays the RNG state, so it draws the masks
    of the first forward). Every loss and every gradient equal, exactly (see the module docstring)."""
    cfg = cfg_for(preset, f"model.dropout={dropout}")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    batch = make_batch(cfg)
    model.set_unpad(4)  # the text encoder and fusion layers on length groups: checkpointed there too
    assert length_groups(batch["attention_mask"], 4) is not None
    plain_losses, plain_grads = step_with(model, cfg, batch, False)
    ckpt_losses, ckpt_grads = step_with(model, cfg, batch, True)
    assert plain_losses.keys() == ckpt_losses.keys() and len(plain_losses) >= 2
    for k, v in plain_losses.items():
        assert torch.equal(ckpt_losses[k], v), k
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, g in plain_grads.items():
        assert torch.equal(ckpt_grads[name], g), name


def calls_of(modules) -> list[int]:
    """A counter per module of its forward calls (counted as they start: a recompute stops as soon as it has what
    the backward needs, so the last module of a checkpointed block may never return)."""
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("preset", ["albef", "tonics"])
def test_checkpointing_recomputes_each_layer_once_in_backward(preset):
    """A forward hook inside each checkpointed layer fires once a step without checkpointing and twice with it (the
    recompute); the momentum copy, which runs without gradients, never recomputes; eval mode never does."""
    cfg = cfg_for(preset, "model.dropout=0")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    batch = make_batch(cfg)
    model.set_unpad(4)
    text = model.text_encoder.encoder.layer[0].attention  # HF checkpoints BertLayer.forward: hook one inside
    watched = [text]
    watched += [model.fusion[0].self_attn] if model.fusion is not None else [model.aligner.q]
    watched += [model.momentum.fusion[0].self_attn] if model.momentum is not None else []
    counts = calls_of(watched)

    def step(on: bool) -> list[int]:
        counts[:] = [0] * len(counts)
        step_with(model, cfg, batch, on)
        return list(counts)

    plain = step(False)
    again = step(True)
    for i, (a, b) in enumerate(zip(plain, again)):
        expect = a if i == 2 else 2 * a  # index 2: the momentum copy
        assert b == expect, (i, plain, again)
    assert all(n >= 1 for n in plain)
    model.eval()
    with torch.no_grad():
        counts[:] = [0] * len(counts)
        model.encode_text(batch["input_ids"], batch["attention_mask"])
    assert counts[0] == len(length_groups(batch["attention_mask"], 4))  # once per length group


def test_set_grad_checkpointing_off_restores_the_plain_forward():
    cfg = cfg_for("albef")
    model = build_model(cfg.model).train()
    model.set_grad_checkpointing(True)
    assert model.text_encoder.is_activation_checkpointing and model.grad_ckpt
    model.set_grad_checkpointing(False)
    assert not model.text_encoder.is_activation_checkpointing and not model.grad_ckpt
    assert not model.momentum.text_encoder.is_activation_checkpointing


def tower_grads(model, images: torch.Tensor, on: bool) -> tuple[torch.Tensor, dict, dict]:
    """The image tower alone: its ITC embedding's gradient w.r.t. every parameter, and the buffers after it."""
    model.set_grad_checkpointing(on)
    model.zero_grad()
    torch.manual_seed(1)
    tokens, emb = model.encode_image(images)
    (emb.pow(2).sum(dim=0) * torch.linspace(-1, 1, emb.shape[1])).sum().add(tokens.mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.image_encoder.named_parameters() if p.grad is not None}
    return emb.detach(), grads, {n: b.clone() for n, b in model.image_encoder.named_buffers()}


def same_tower(model, images, stateful: bool) -> None:
    state = {n: b.clone() for n, b in model.image_encoder.named_buffers()}
    emb0, g0, after0 = tower_grads(model, images, False)
    for n, b in model.image_encoder.named_buffers():  # both steps from the same BatchNorm statistics
        b.copy_(state[n])
    emb1, g1, after1 = tower_grads(model, images, True)
    assert torch.equal(emb0, emb1)
    assert g0.keys() == g1.keys() and len(g0) > 2
    for name, g in g0.items():
        assert torch.equal(g1[name], g), name
    # BatchNorm moved its running statistics once, as without checkpointing, not again in the recompute
    assert after0.keys() == after1.keys()
    for name, b in after0.items():
        assert torch.equal(after1[name], b), name
    if stateful:
        assert any(not torch.equal(after0[n], state[n]) for n in state)


def test_efficientnet_tower_checkpoints_its_blocks():
    """The packaged EfficientNet-Lite0 trained (BatchNorm in training mode, drop-connect on), in float32 (the same
    operations on the same numbers: equal in any dtype, and float64 convolutions are slow): the same embeddings,
    gradients and running statistics with its MBConv blocks checkpointed."""
    cfg = load_config("clip", sets=["model.text_model=tiny", "model.image_model=efficientnet-lite0"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    counts = calls_of([model.image_encoder.net._blocks[3]._depthwise_conv])
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    same_tower(model, images, stateful=True)
    assert counts[0] == 3  # once without checkpointing; forward and recompute with it


def test_timm_vit_tower_checkpoints_its_blocks():
    """A random-initialised timm ViT (timm's own set_grad_checkpointing), in float32: the same embeddings and
    gradients; its blocks run twice a step. timm's `test_vit` (its VisionTransformer class at 64 wide, 6 blocks,
    160 px: a twentieth of ViT-Tiny/16's arithmetic) where this timm has it, else ViT-Tiny/16: the same class and
    the same checkpointing code either way."""
    timm = pytest.importorskip("timm")
    name = "test_vit" if timm.list_models("test_vit") else "vit_tiny_patch16_224"
    cfg = load_config("clip", sets=["model.text_model=tiny", f"model.image_model=timm:{name}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, pretrained=False).train()
    counts = calls_of([model.image_encoder.net.net.blocks[0].attn])
    size = model.image_encoder.net.net.patch_embed.img_size
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(0))
    same_tower(model, images, stateful=False)
    assert counts[0] == 3


def test_torchvision_vit_blocks_compute_its_forward(default_float64):
    """The torchvision ViT's block-by-block forward (what checkpointing runs) is its own forward, value and
    gradient; a torchvision CNN trunk (a Sequential with BatchNorm) keeps its running statistics."""
    from torchvision.models import VisionTransformer, resnet18

    from vlprep.encoders import ViTTokens, conv_trunk

    torch.manual_seed(0)
    vit = ViTTokens(VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16,
                                      mlp_dim=32)).train()
    images = torch.randn(2, 3, 32, 32, requires_grad=True)
    run = image_blocks(vit)
    for forward in (vit, lambda x: run(x, checkpointed)):
        torch.manual_seed(1)
        out = forward(images)
        (grad,) = torch.autograd.grad(out.pow(2).sum(), images)
        if forward is vit:
            expect = (out, grad)
        else:
            assert torch.equal(out, expect[0]) and torch.equal(grad, expect[1])
    trunk = conv_trunk(resnet18(), "torchvision:resnet18").train()
    images = torch.randn(2, 3, 64, 64)
    before = {n: b.clone() for n, b in trunk.named_buffers()}
    plain = trunk(images)
    after = {n: b.clone() for n, b in trunk.named_buffers()}
    for n, b in trunk.named_buffers():
        b.copy_(before[n])
    out = image_blocks(trunk)(images, checkpointed)
    out.sum().backward()
    assert torch.equal(out, plain)
    for n, b in trunk.named_buffers():
        assert torch.equal(b, after[n]), n


def forward_twice(model, batch) -> list[torch.Tensor]:
    outs = []
    for _ in range(2):
        tokens, img = model.encode_image(batch["images"])
        hidden, txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        outs.append(torch.cat([img, txt, hidden.flatten(1)], dim=1))
        if model.fusion is not None:
            outs[-1] = torch.cat([outs[-1], model.fuse(hidden, batch["attention_mask"], tokens).flatten(1)], dim=1)
        if model.aligner is not None:
            outs[-1] = torch.cat([outs[-1], model.align_scores(hidden[:, 4], tokens)], dim=1)
    return outs


@pytest.mark.parametrize("preset", ["albef", "tonics"])
def test_model_dropout_zero_makes_a_training_forward_deterministic(preset):
    """model.dropout=0: two training-mode forwards (text, image, fusion or aligner) are identical; 0.3 makes them
    differ, and the towers' own rates (None) are what they were."""
    cfg = cfg_for(preset)
    batch = make_batch(cfg)
    torch.manual_seed(0)
    a, b = forward_twice(build_model(cfg.model).train(), batch)
    assert not torch.equal(a, b)  # BERT's own 0.1
    torch.manual_seed(0)
    model = build_model(cfg_for(preset, "model.dropout=0").model).train()
    a, b = forward_twice(model, batch)
    assert torch.equal(a, b)
    assert model.text_encoder.config.hidden_dropout_prob == 0 == model.text_encoder.config.attention_probs_dropout_prob
    model = build_model(cfg_for(preset, "model.dropout=0.3").model).train()
    a, b = forward_twice(model, batch)
    assert not torch.equal(a, b)
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.3}
    layer = model.text_encoder.encoder.layer[0].attention.self
    assert layer.dropout.p == 0.3  # what BERT's sdpa attention passes as dropout_p


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", ".nan", "yes"])
def test_model_dropout_out_of_range_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        load_config("clip", sets=[f"model.dropout={value}"])
    assert "\n" not in str(e.value) and "model.dropout" in str(e.value)


def test_checkpoints_without_the_keys_load_with_the_towers_own_dropout():
    saved = {"text_model": "tiny", "image_model": "tiny", "embed_dim": 16}  # a checkpoint from before model.dropout
    assert model_config(saved, "old.pt").dropout is None
    assert load_config("clip", sets=["model.dropout=null"]).model.dropout is None
    assert load_config("clip").train.grad_checkpointing is False


def test_vltrain_run_with_grad_checkpointing_logs_the_same_losses(tmp_path):
    """`vltrain run --set train.grad_checkpointing=true` end to end (albef, dropout on): the same metrics rows as
    without, timing aside; and a resume may switch it (a speed option)."""
    ds = colour_pairs(tmp_path, 24)
    sets = [*TINY, "model.fusion_layers=1", "model.queue_size=16", "data.image_size=32", "data.workers=0",
            "log_every=1", "eval_every=100", "ckpt_every=2", "data.val_frac=0"]

    def run(out, *args):
        r = CliRunner().invoke(app, ["run", str(ds), "--preset", "albef", "--batch-size", "8", "--device", "cpu",
                                     "--out", str(out), *[a for s in sets for a in ("--set", s)], *args])
        assert r.exit_code == 0, r.output
        return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"}
                for line in (out / "metrics.jsonl").read_text().splitlines()]

    plain = run(tmp_path / "plain", "--steps", "3")
    ckpt = run(tmp_path / "ckpt", "--steps", "3", "--set", "train.grad_checkpointing=true")
    assert len(plain) == 3 and ckpt == plain
    resumed = run(tmp_path / "ckpt", "--steps", "4", "--resume")
    assert len(resumed) == 4


def test_a_timm_tower_with_batchnorm_is_refused_in_one_line():
    """timm recomputes its own blocks, BatchNorm's running statistics included: refused rather than moved twice."""
    pytest.importorskip("timm")
    cfg = load_config("clip", sets=["model.text_model=tiny", "model.image_model=timm:resnet18"])
    model = build_model(cfg.model, pretrained=False).train()
    with pytest.raises(ValueError, match="BatchNorm") as e:
        model.set_grad_checkpointing(True)
    assert "\n" not in str(e.value)
    frozen = load_config("clip", sets=["model.text_model=tiny", "model.image_model=timm:resnet18",
                                       "model.freeze_image=true"])
    build_model(frozen.model, pretrained=False).set_grad_checkpointing(True)  # a frozen tower recomputes nothing

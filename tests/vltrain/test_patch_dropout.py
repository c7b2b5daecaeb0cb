"""FLIP's patch dropout (model.patch_dropout): the drop itself against a re-derivation, each ViT tower family dropping
after its position embedding in training only, eval embeddings unchanged, CNN and cached-token towers refused, the
fusion encoder reading the kept tokens, and a tiny run training with it."""

import warnings
from fractions import Fraction

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import make_dataset
from tests.vltrain.tinyclip import tiny_clip, tiny_siglip
from vltrain.cli import app
from vltrain.config import ConfigError, ModelConfig
from vltrain.model import build_model
from vltrain.patchdrop import PatchDropout, drop_patches, kept

N_PATCHES = 16  # every tiny tower here: 4 x 4 patches


def tiny_vit(arch, weights=None):
    """torchvision's VisionTransformer at 32 px, patch 8 (16 patches), 1 layer of width 16."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)


def tiny_timm_vit(arch, pretrained=False, num_classes=0, **kwargs):
    """timm's VisionTransformer read at vit_tiny_patch16_224's 224 px, patch 56 (16 patches), 1 block of width 16."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=224, patch_size=56, embed_dim=16, depth=1, num_heads=2, num_classes=num_classes)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """family -> `clip:` + a tiny CLIP or SigLIP folder, written on first use and kept for the module."""
    root = tmp_path_factory.mktemp("patchdrop")
    made = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = f"clip:{(tiny_clip if family == 'clip' else tiny_siglip)(root / family)}"
        return made[family]
    return get


@pytest.fixture
def tower(folder, monkeypatch):
    """family -> (ModelConfig kwargs, input size, prefix tokens) of a tiny ViT of that family."""
    import timm
    import torchvision

    monkeypatch.setattr(torchvision.models, "get_model", tiny_vit)
    monkeypatch.setattr(timm, "create_model", tiny_timm_vit)

    def spec(family: str) -> tuple:
        if family == "torchvision":
            return dict(image_model="torchvision:vit_b_16"), 32, 1
        if family == "timm":
            return dict(image_model="timm:vit_tiny_patch16_224"), 224, 1
        name = folder(family)
        return dict(image_model=name, text_model=name), 32, 1 if family == "clip" else 0  # SigLIP: no class token
    return spec


def build(kwargs: dict, **more):
    cfg = {"text_model": "tiny", "embed_dim": 8, "fusion_layers": 0, **kwargs, **more}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random backbone weights
        return build_model(ModelConfig(**cfg))


def test_kept_is_the_floor_of_the_kept_share_and_at_least_one():
    for n, p in [(196, 0.5), (196, 0.75), (16, 0.5), (16, 0.3), (16, 0.95), (4, 0.9), (49, 0.6)]:
        want = max(1, int(Fraction(n) * (1 - Fraction(str(p)))))  # exact arithmetic on the decimal p
        assert kept(n, p) == want, (n, p)


def test_the_drop_keeps_prefix_tokens_and_k_distinct_patches_in_position_order_per_row():
    b, prefix, n, d = 5, 2, 16, 3
    # token j of row i holds (i, j, -j): every kept token names the row and position it came from
    x = torch.stack([torch.tensor([[i, j, -j] for j in range(prefix + n)], dtype=torch.float32) for i in range(b)])
    torch.manual_seed(0)
    out = drop_patches(x, 0.5, prefix)
    k = kept(n, 0.5)
    assert out.shape == (b, prefix + k, d)
    assert torch.equal(out[:, :prefix], x[:, :prefix])
    picks = []
    for i in range(b):
        pos = out[i, prefix:, 1].long()
        assert torch.equal(out[i, prefix:], x[i, pos])  # each kept token is its row's own token at its position
        assert (pos >= prefix).all() and (pos[1:] > pos[:-1]).all()  # patches only, distinct, in position order
        picks.append(tuple(pos.tolist()))
    assert len(set(picks)) > 1  # each row draws its own subset
    # the draw is torch's global RNG: the same seed, the same subsets
    torch.manual_seed(0)
    assert torch.equal(drop_patches(x, 0.5, prefix), out)


def test_each_patch_is_kept_with_probability_k_over_n():
    n, p, rows = 16, 0.75, 4000
    x = torch.arange(n, dtype=torch.float32).reshape(1, n, 1).expand(rows, n, 1)
    torch.manual_seed(1)
    counts = torch.bincount(drop_patches(x, p, 0).flatten().long(), minlength=n).double()
    q = kept(n, p) / n  # a uniform k-subset keeps each patch with probability k / n
    # each count is Binomial(rows, q): within 6 standard deviations of its mean
    assert ((counts - rows * q).abs() <= 6 * (rows * q * (1 - q)) ** 0.5).all(), counts


def test_the_module_drops_in_training_only():
    x = torch.rand(2, 1 + N_PATCHES, 4)
    drop = PatchDropout(0.5, 1)
    assert drop(x).shape == (2, 1 + kept(N_PATCHES, 0.5), 4)
    assert drop.eval()(x) is x
    assert PatchDropout(0.0, 1)(x) is x


@pytest.mark.parametrize("family", ["torchvision", "timm", "clip", pytest.param("siglip", marks=pytest.mark.slow)])
def test_a_vit_tower_drops_after_its_position_embedding_in_training_and_evaluates_unchanged(tower, family):
    kwargs, size, prefix = tower(family)
    full, dropped = build(kwargs), build(kwargs, patch_dropout=0.5)
    assert full.state_dict().keys() == dropped.state_dict().keys()
    dropped.load_state_dict(full.state_dict())
    images = torch.rand(3, 3, size, size)
    full.eval()
    dropped.eval()
    with torch.no_grad():
        t0, e0 = full.encode_image(images)
        t1, e1 = dropped.encode_image(images)
    assert t0.shape[1] == prefix + N_PATCHES
    assert torch.equal(t0, t1) and torch.equal(e0, e1)  # evaluation reads every token: the same numbers

    # training: the drop reads the tokens with their position embedding, before the first layer
    drops = [m for m in dropped.modules() if isinstance(m, PatchDropout)]
    assert len(drops) == 1
    seen = []
    drops[0].register_forward_hook(lambda mod, args, out: seen.append((args[0].detach(), out.detach())))
    dropped.train()
    tokens, emb = dropped.encode_image(images)
    k = kept(N_PATCHES, 0.5)
    assert tokens.shape == (3, prefix + k, t0.shape[-1]) and emb.shape == e0.shape
    (before, after), = seen
    assert torch.allclose(before, post_position_tokens(full, family, images), atol=1e-6)
    assert torch.equal(after[:, :prefix], before[:, :prefix])
    for i in range(3):  # each kept patch is one of the row's own tokens, in position order
        hit = (after[i, prefix:, None, :] == before[i, None, prefix:, :]).all(-1).float().argmax(-1)
        assert torch.equal(after[i, prefix:], before[i, prefix + hit]) and (hit[1:] > hit[:-1]).all()


def post_position_tokens(model, family: str, images: torch.Tensor) -> torch.Tensor:
    """The tower's tokens with the position embedding added, re-derived from its own pieces: (B, P + N, D)."""
    enc = model.image_encoder
    with torch.no_grad():
        if family in ("clip", "siglip"):
            return enc.embeddings(images)
        if family == "torchvision":
            vit = enc.net.vit
            patches = vit._process_input(images)
            return torch.cat([vit.class_token.expand(len(images), -1, -1), patches], 1) + vit.encoder.pos_embedding
        net = enc.net.net  # timm: class token first, then the learned position embedding over all tokens
        patches = net.patch_embed(images)
        return torch.cat([net.cls_token.expand(len(images), -1, -1), patches], 1) + net.pos_embed


def test_cnn_and_cached_token_towers_are_refused_in_one_line():
    for image_model, extra in [("tiny", {}), ("torchvision:resnet18", {}), ("features", {"feature_dim": 8})]:
        with pytest.raises(ConfigError) as e:
            build({"image_model": image_model, **extra}, patch_dropout=0.5)
        assert "\n" not in str(e.value) and image_model in str(e.value) and "patch_dropout" in str(e.value)
    build({"image_model": "tiny"}, patch_dropout=0.0)  # off: any tower


def test_grad_checkpointing_momentum_and_fusion_with_patch_dropout(tower):
    kwargs, size, prefix = tower("torchvision")
    model = build(kwargs, patch_dropout=0.5, fusion_layers=1, momentum=True, queue_size=8).train()
    k = kept(N_PATCHES, 0.5)
    images = torch.rand(2, 3, size, size)
    model.set_grad_checkpointing(True)  # the block-by-block path drops too
    tokens, _ = model.encode_image(images)
    assert tokens.shape[1] == prefix + k
    tokens.sum().backward()
    model.set_grad_checkpointing(False)
    with torch.no_grad():  # the momentum copy (a teacher) reads every token
        assert model.momentum.encode_image(images)[0].shape[1] == prefix + N_PATCHES
    ids = torch.randint(1000, 2000, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    hidden, _ = model.encode_text(ids, mask)
    tokens, _ = model.encode_image(images)
    _, maps = model.fuse(hidden, mask, tokens, return_attn=True)
    assert maps[0].shape[-1] == prefix + k  # cross-attention reads the kept tokens


def test_gradient_accumulation_replay_draws_the_same_tokens(tower):
    """vltrain.accum restores the global RNG state before replaying a chunk with gradients: the drop draws from that
    stream, so the replay keeps the tokens the no-grad pass kept (and its gradients are those of that pass)."""
    from vltrain.accum import rng_state, set_rng_state

    kwargs, size, _ = tower("torchvision")
    model = build(kwargs, patch_dropout=0.5).train()
    images = torch.rand(2, 3, size, size)
    state = rng_state(images.device)
    with torch.no_grad():
        first = model.encode_image(images)[0]
    set_rng_state(state, images.device)
    assert torch.equal(model.encode_image(images)[0].detach(), first)
    assert not torch.equal(model.encode_image(images)[0].detach(), first)  # the next draw is another subset


def test_a_frozen_tower_still_drops_in_training(tower):
    kwargs, size, prefix = tower("torchvision")
    model = build(kwargs, patch_dropout=0.5, freeze_image=True).train()
    assert not model.image_encoder.training
    assert model.encode_image(torch.rand(2, 3, size, size))[0].shape[1] == prefix + kept(N_PATCHES, 0.5)


def test_timm_prefix_tokens_are_kept_whatever_they_are(monkeypatch):
    """A timm ViT with no class token and one register token (test_vit2's layout, 1 block of width 16 here): its
    prefix (num_prefix_tokens = 1) stays, and its head pools the mean of the kept patches."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    monkeypatch.setattr(timm, "create_model", lambda arch, pretrained=False, num_classes=0: VisionTransformer(
        img_size=64, patch_size=16, embed_dim=16, depth=1, num_heads=2, class_token=False, reg_tokens=1,
        global_pool="avg", dynamic_img_size=True, num_classes=num_classes))
    model = build({"image_model": "timm:test_vit2"}, patch_dropout=0.5).train()
    net = model.image_encoder.net.net
    assert net.num_prefix_tokens == 1 and net.cls_token is None
    drop, = [m for m in model.modules() if isinstance(m, PatchDropout)]
    assert drop.prefix == 1 and net.patch_drop is drop
    tokens, _ = model.encode_image(torch.rand(2, 3, 64, 64))  # 4 x 4 patches of 16
    assert tokens.shape == (2, 1 + kept(N_PATCHES, 0.5), 16)


@pytest.mark.slow
def test_a_run_trains_with_patch_dropout(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setattr(torchvision.models, "get_model", tiny_vit)
    data = make_dataset(tmp_path / "data", [f"a {c} picture" for c in "abcdefgh"], 8)
    sets = ["model.text_model=tiny", "model.image_model=torchvision:vit_b_16", "model.embed_dim=16",
            "model.fusion_layers=1", "data.image_size=32", "data.workers=0", "data.max_len=12", "data.val_frac=0",
            "optim.warmup_steps=1", "model.queue_size=8", "model.patch_dropout=0.5"]
    out = tmp_path / "run"  # with gradient accumulation: its replay of each chunk draws the same kept tokens
    r = CliRunner().invoke(app, ["run", str(data), "--out", str(out), "--preset", "softmask", "--steps", "2",
                                 "--batch-size", "4", "--device", "cpu", "--set", "train.accum_steps=2",
                                 *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 0, r.output + repr(r.exception)
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["config"]["model"]["patch_dropout"] == 0.5
    cnn = [x for s in sets for x in ("--set", s.replace("torchvision:vit_b_16", "tiny"))]
    r = CliRunner().invoke(app, ["run", str(data), "--out", str(tmp_path / "cnn"), "--preset", "clip", "--steps",
                                 "1", "--batch-size", "4", "--device", "cpu", *cnn])
    line = r.output.strip()
    assert r.exit_code == 2 and line.startswith("error:") and "\n" not in line and "Traceback" not in line, line
    assert "model.patch_dropout=0.5" in line and "tiny is a CNN" in line


@pytest.mark.slow  # two benchmark rows of a tiny ViT: ~20 s on 2 busy cores
def test_the_gpu_benchmark_patch_dropout_row_runs_on_the_cpu_and_counts_fewer_flops(tmp_path, capsys, monkeypatch):
    """benchmarks/gpu.py's --patch-dropout, as scripts/gpu-check.sh's bench-patchdrop step calls it (there at size
    base on the GPU; here a size tiny-vit added for the test: the tiny text tower and timm's 6-layer test_vit of width
    64 at 32 px, 4 patches, 2 kept), against the same row at p = 0."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gpu_bench", root / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(gpu)
    finally:
        sys.path[:] = path
    monkeypatch.setitem(gpu.SIZES, "tiny-vit", {**gpu.SIZES["tiny"], "image": "timm:test_vit",
                                                "extra": [*gpu.SIZES["tiny"]["extra"], "model.image_weights="]})
    out = tmp_path / "bench.jsonl"
    common = ["--device", "cpu", "--size", "tiny-vit", "--presets", "clip", "--batches", "4", "--steps", "1",
              "--timed-steps", "2", "--runs", "1", "--warmup", "1", "--json", str(out),
              "--data-dir", str(tmp_path / "d")]
    assert gpu.main([*common, "--patch-dropout", "0,0.5", "--table"]) == 0
    full, dropped = [r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == "row"]
    assert "patch_dropout" not in full and dropped["patch_dropout"] == 0.5
    assert full["status"] == dropped["status"] == "ok", (full, dropped)
    assert 0 < dropped["gflop_per_sample"] < full["gflop_per_sample"]  # the image tower reads 1 + 2 tokens, not 1 + 4
    assert "| tiny-vit | clip (patch_dropout 0.5) | 4 |" in capsys.readouterr().out
    for bad in ("1", "x", "0,-0.5"):
        with pytest.raises(SystemExit, match=f"--patch-dropout {bad}: give values in"):
            gpu.parse_args(["--patch-dropout", bad])


def test_the_gpu_check_holds_end_to_end_runs_against_the_row_without_patch_dropout(tmp_path):
    """scripts/gpu_check.py's e2e row: its synthetic figure is the eager row that keeps every token (the e2e runs do),
    not the patch-dropout row of the same size, preset and batch that follows it in bench.jsonl."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).resolve().parents[2] / "scripts" /
                                                  "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    row = {"kind": "row", "size": "base", "preset": "clip", "batch": 128, "compile": "off", "ckpt": "off",
           "status": "ok", "samples_per_s": 100.0}
    bench = [row, {**row, "patch_dropout": 0.5, "samples_per_s": 170.0}]
    assert check.e2e_row(tmp_path, bench, "base", "clip", 128, 10)["synthetic_samples_per_s"] == 100.0
    assert check.bench_table(bench, "vendor")[0].count("patch_dropout") == 1  # its own column

"""On a CUDA device: tiny-tower runs, the CPU's step numbers, GRIT's batches and vlprep's tokens (marker `cuda`:
skipped without a device, a failure under VLTRAIN_REQUIRE_CUDA=1)."""

import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import colour_pairs, image_bytes
from vlprep.features import full_float32
from vltrain.cli import app
from vltrain.config_load import load_config
from vltrain.model import build_model, tokenizer_for
from vltrain.samplers import GritSampler
from vltrain.step import train_step

pytestmark = pytest.mark.cuda
GPU = "cuda"  # the device compared with the CPU

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "data.val_frac=0"]
ALBEF = ["model.fusion_layers=1", "model.queue_size=16"]  # the tiny BERT split 1 + 1; a queue the 24 pairs hold


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("cuda"), 24)


def run_on_cuda(shards, out: Path, preset: str, precision: str):
    extra = ALBEF if preset == "albef" else []
    sets = [x for s in TINY + extra + [f"train.precision={precision}"] for x in ("--set", s)]
    return CliRunner().invoke(app, ["run", str(shards), "--out", str(out), "--preset", preset, "--batch-size", "8",
                                    "--steps", "3", "--device", GPU, *sets])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["clip", "albef"])
def test_a_tiny_run_trains_on_cuda(shards, tmp_path, preset, precision, monkeypatch):
    # a run on CUDA setdefaults cuBLAS's determinism switch in os.environ; set here, it is undone after the test
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    r = run_on_cuda(shards, tmp_path / "r", preset, precision)
    assert r.exit_code == 0, r.output + repr(r.exception)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    totals = [row["total"] for row in rows if "total" in row]
    assert len(totals) == 3 and all(math.isfinite(t) for t in totals), rows


def step_numbers(model, batch: dict, cfg, device: str) -> tuple[dict, dict]:
    """(losses, gradients) of one float32 step of `model` moved to `device`. ITM and MLM draw their negatives and
    masks from the device's generator (another stream on CUDA than on a CPU), so the comparison turns them off and
    adds the fused match logits of the positive pairs instead: the fusion encoder's forward and backward, no draw."""
    model = model.to(device)
    b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    gen = torch.Generator(device=device).manual_seed(0)
    losses = train_step(model, b, cfg.loss, gen, tokenizer_for("tiny"), cfg.loss.distill_alpha)
    losses.pop("queue_feats")
    total = losses["total"]
    if model.fusion is not None:
        text_hidden, _ = model.encode_text(b["input_ids"], b["attention_mask"])
        image_tokens, _ = model.encode_image(b["images"])
        losses["itm_positive"] = model.itm_logits(model.fuse(text_hidden, b["attention_mask"], image_tokens)).sum()
        total = total + losses["itm_positive"]
    model.zero_grad(set_to_none=True)
    total.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {k: float(v.detach()) for k, v in losses.items()}, grads


@pytest.mark.parametrize("preset", ["clip", "albef"])
def test_a_float32_step_on_cuda_gives_the_cpus_losses_and_gradients(preset):
    """Same weights, same batch, dropout off (eval mode), TF32 off: the devices differ only in kernels and summation
    order. Float32's unit roundoff is 2^-24 = 6e-8; a dot product or reduction of length n may differ by up to
    n * 2^-24 times the sum of its terms' magnitudes, and the tiny model's longest reductions (batch 8 x 12 tokens x
    width 32, through ~20 ops forward and back) bound that at about 1e3 * 6e-8 = 6e-5 of the magnitudes involved.
    So a loss may differ by 1e-4 of itself (plus 1e-5 for a sum of logits that cancels), and a gradient entry by
    1e-4 of itself plus 1e-4 of the largest gradient entry (an entry that is a cancelling sum, the temperature's,
    errs relative to its terms, not to itself). On a CPU, this step in float32 against float64 (float32's own
    rounding) uses at most 11% of that tolerance. A real difference (a wrong mask, a missed term, an op in bf16:
    2^-8 = 4e-3) exceeds it."""
    cfg = load_config(preset, sets=TINY + (ALBEF if preset == "albef" else []) + ["loss.itm=0", "loss.mlm=0"])
    torch.manual_seed(0)
    model = build_model(cfg.model, pretrained=False).eval()
    g = torch.Generator().manual_seed(1)
    caps = [f"a red cat number {i}" for i in range(8)]
    enc = tokenizer_for("tiny")(caps, padding="max_length", truncation=True, max_length=12, return_tensors="pt")
    batch = {"images": torch.randn(8, 3, 32, 32, generator=g), "input_ids": enc["input_ids"],
             "attention_mask": enc["attention_mask"], "captions": caps}
    with full_float32():
        cpu_losses, cpu_grads = step_numbers(model, batch, cfg, "cpu")
        cuda_losses, cuda_grads = step_numbers(model, batch, cfg, GPU)
    assert cpu_losses.keys() == cuda_losses.keys() and "itc_loss" in cpu_losses
    for k, v in cpu_losses.items():
        assert abs(cuda_losses[k] - v) <= 1e-4 * abs(v) + 1e-5, (k, v, cuda_losses[k])
    assert cpu_grads.keys() == cuda_grads.keys() and cpu_grads
    largest = max(float(grad.abs().max()) for grad in cpu_grads.values())
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(cuda_grads[name], grad, rtol=1e-4, atol=1e-4 * largest,
                                   msg=lambda m, name=name: f"{name}: {m}")


def no_near_ties(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n image and text features, (n, n) float32, whose similarities image_k . text_j are a Latin
    square over the values 1/n .. n/n (up to rounding): every row and every column of the similarity holds n
    distinct values 1/n apart, so every argmax GRIT's chains take (over any subset of a row or column) has a
    margin of 1/n. The products are taken after a random rotation R, so they really round: image = R, text = T R
    with T the Latin square, image . text_j = (R R^T T^T)_kj. A float32 dot product of length n errs by at most
    n * 2^-24 * |a| |b| <= n * 2^-24 * sqrt(n) (|R_k| = 1, |T_j| <= sqrt(n)), 3e-5 for n = 64, far below the
    margin 1/64: the CPU and the GPU must take the same argmaxes."""
    rng = np.random.default_rng(seed)
    rows = rng.permutation(n)
    cols = rng.permutation(n)
    latin = ((rows[:, None] + cols[None, :]) % n + 1) / n  # T[j, k]: a permuted cyclic Latin square
    rotation, _ = np.linalg.qr(rng.normal(size=(n, n)))
    image = rotation
    text = latin @ rotation
    sim = image @ text.T  # float64: the Latin square transposed, to 1e-13
    assert np.abs(sim - latin.T).max() < 1e-9
    return torch.from_numpy(image).float(), torch.from_numpy(text).float()


def test_grit_gives_the_same_batches_on_cuda_as_on_the_cpu():
    img, txt = no_near_ties(64, seed=0)
    devices = ("cpu", GPU)
    samplers = [GritSampler(64, 8, search_space=16, queue_size=32, seed=3) for _ in devices]
    for epoch in (1, 2):
        batches = [list(s) for s in samplers]
        assert batches[1] == batches[0]
        for device, sampler, epoch_batches in zip(devices, samplers, batches):
            for batch in epoch_batches:
                b = torch.tensor(batch)
                sampler.collect(b.to(device), img[b].to(device), txt[b].to(device))
            sampler.set_epoch(epoch)
        assert samplers[1].q_img.device.type == GPU
        assert samplers[1].order.tolist() == samplers[0].order.tolist()
    assert sorted(samplers[0].order.tolist()) == list(range(64))


# Lite0's token at float32: the CPU (oneDNN) and the GPU (cuDNN, TF32 off under --precision fp32) add the same
# terms in other orders. float32's relative step 2^-24 grows over the ~49 convolutions of Lite0's longest path and
# over sums of up to ~1,000 terms (a random walk: about sqrt(1000) = 32 steps), so two float32 results differ by at
# most about 49 * 32 * 2^-24 = 9.3e-5 of the token's scale. Stored as float16, each then rounds to the nearest float16
# (half a float16 step, 2^-11 of the value, each side). An element agrees when |gpu - cpu| <= one float16 step of
# its value (np.spacing) + 1e-4 x the token's largest element.
FLOAT32_PATH = 1e-4


def test_vlprep_features_on_cuda_at_fp32_agree_with_the_cpu_within_float16_rounding(tmp_path):
    from vlprep.dataset import iter_tar, open_dataset
    from vlprep.features import FeaturesConfig, features
    from vlprep.shards import ShardsConfig, build_shards

    src = tmp_path / "imgs"
    src.mkdir()
    for i in range(256):
        (src / f"{i:03d}.png").write_bytes(image_bytes(24 + i % 9, 20 + i % 7, seed=i))
        (src / f"{i:03d}.txt").write_text(f"picture {i}")
    build_shards(ShardsConfig(src=src, out=tmp_path / "ds", samples_per_shard=64, workers=1))
    tokens = []
    for i, device in enumerate(("cpu", GPU)):
        out = tmp_path / f"out{i}"
        features(FeaturesConfig(src=tmp_path / "ds", out=out, size=64, batch_size=32, device=device,
                                decode_threads=1, precision="fp32"))
        tokens.append({s["__key__"]: np.load(io.BytesIO(s["npy"]), allow_pickle=False)
                       for shard in open_dataset(out).shards for s in iter_tar(out / shard)})
    assert len(tokens[0]) == 256 and tokens[0].keys() == tokens[1].keys()
    for key, cpu in tokens[0].items():
        gpu = tokens[1][key]
        assert gpu.shape == cpu.shape == (4, 1280) and gpu.dtype == cpu.dtype == np.float16
        scale = np.abs(cpu.astype(np.float64)).max(axis=1, keepdims=True)
        bound = np.spacing(np.maximum(np.abs(cpu), np.abs(gpu))).astype(np.float64) + FLOAT32_PATH * scale
        diff = np.abs(gpu.astype(np.float64) - cpu.astype(np.float64))
        assert (diff <= bound).all(), (key, float((diff - bound).max()))


def test_vlprep_features_auto_is_bf16_on_a_card_with_native_bf16(tmp_path):
    from vlprep.features import resolve_precision

    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert resolve_precision("auto", torch.device(GPU)) == ("bf16" if native else "fp32")


def test_accumulation_and_checkpointing_on_cuda_start_from_the_plain_steps_loss(shards, tmp_path, monkeypatch):
    """albef on CUDA with train.accum_steps=2 and train.grad_checkpointing, dropout off, float32 without TF32: step
    1's losses (computed before any update) are the plain run's up to float32 rounding of sums reordered by the
    chunking (relative 1e-5, about 100 float32 ulps); the later steps differ by what AdamW makes of that rounding,
    so they are only checked to train (finite)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    common = TINY + ALBEF + ["train.precision=fp32", "train.tf32=off", "model.dropout=0"]
    out = {}
    for name, extra in (("plain", []), ("levers", ["train.accum_steps=2", "train.grad_checkpointing=true"])):
        sets = [x for s in common + extra for x in ("--set", s)]
        r = CliRunner().invoke(app, ["run", str(shards), "--out", str(tmp_path / name), "--preset", "albef",
                                     "--batch-size", "8", "--steps", "3", "--device", GPU, *sets])
        assert r.exit_code == 0, r.output + repr(r.exception)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        out[name] = [row for row in map(json.loads, lines) if "total" in row]
    assert [row["step"] for row in out["levers"]] == [1, 2, 3]
    for key in ("itc_loss", "itm_loss", "mlm_loss", "total"):
        assert out["levers"][0][key] == pytest.approx(out["plain"][0][key], rel=1e-5), key
    assert all(math.isfinite(row["total"]) for row in out["levers"])


def test_a_clip_start_trains_on_cuda_and_its_towers_embed_there_as_the_source_does(shards, tmp_path, monkeypatch):
    """--init-from clip:PATH on CUDA: albef in bf16 with gradient checkpointing trains 3 steps (finite losses, the
    towers' HF recompute and autocast together), and the float32 towers on CUDA, TF32 off, embed as the source
    CLIPModel does on the CPU. Tolerance 1e-5 on unit vectors: about 80 float32 ulps, room for the GPU's other
    summation order over 2 layers of width 32; a wrong weight, preprocessing or pooling moves them by about 0.1."""
    import torch.nn.functional as F
    from transformers import CLIPModel

    from tests.vltrain.tinyclip import PROJECTION, SIZE, tiny_clip
    from vltrain import hfclip
    from vltrain.config import ModelConfig
    from vltrain.init_from import init_weights

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    folder = tiny_clip(tmp_path / "tiny-clip")
    sets = ["data.workers=0", "log_every=1", "data.val_frac=0", "model.fusion_layers=1", "model.queue_size=16",
            "train.precision=bf16", "train.grad_checkpointing=true"]
    r = CliRunner().invoke(app, ["run", str(shards), "--out", str(tmp_path / "r"), "--preset", "albef",
                                 "--batch-size", "8", "--steps", "3", "--device", GPU, "--init-from", f"clip:{folder}",
                                 *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 0, r.output + repr(r.exception)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    totals = [row["total"] for row in rows if "total" in row]
    assert len(totals) == 3 and all(math.isfinite(t) for t in totals), rows

    spec = f"clip:{folder}"
    model = build_model(ModelConfig(text_model=spec, image_model=spec, embed_dim=PROJECTION, fusion_layers=0))
    init_weights(model, hfclip.init_source(spec), spec)
    model = model.eval().to(GPU)
    tok = tokenizer_for(spec)
    enc = tok(["a photo of a dog", "red", "a blue car next to a small tree"], padding="longest", return_tensors="pt")
    images = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    source = CLIPModel.from_pretrained(str(folder)).eval()
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32  # a property of torch's, not an attribute to monkeypatch
    torch.backends.cuda.matmul.allow_tf32 = False
    try:  # the patch embedding is a convolution: cuDNN's TF32 off too
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            # transformers 5 returns an output with the projected features as pooler_output, 4 the tensor itself
            ref_img = source.get_image_features(pixel_values=images)
            ref_txt = source.get_text_features(**enc)
            ref_img = F.normalize(getattr(ref_img, "pooler_output", ref_img), dim=-1)
            ref_txt = F.normalize(getattr(ref_txt, "pooler_output", ref_txt), dim=-1)
            img = model.encode_image(images.to(GPU))[1].cpu()
            txt = model.encode_text(enc["input_ids"].to(GPU), enc["attention_mask"].to(GPU))[1].cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    assert torch.allclose(img, ref_img, rtol=0, atol=1e-5), (img - ref_img).abs().max()
    assert torch.allclose(txt, ref_txt, rtol=0, atol=1e-5), (txt - ref_txt).abs().max()

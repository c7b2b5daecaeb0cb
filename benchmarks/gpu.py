"""Training throughput on one GPU: samples/s and an MFU estimate for presets clip, albef and grit.

The packaged encoders (EfficientNet-Lite0 on 224 px pixels, MiniLM), the trainer's own step (`TrainStep`: forward
and named losses), backward, clipping, fused AdamW, momentum update and enqueue, as `vltrain.session.setup` builds
them with the trainer's GPU options (bf16 autocast, TF32, channels_last). Random pixels and captions time the
same as real ones. MFU = the measured model FLOP/s (3x the forward FLOPs counted by torch's FlopCounterMode) over
the device's dense bf16 peak (a table of common GPUs, or --peak-tflops). This is the script to compare against
open_clip's published throughput. On a machine without CUDA it prints "no CUDA device" and exits 0. Load
averages are printed at start and end.

    .venv/bin/python benchmarks/gpu.py [--steps 20] [--batches 128,256] [--presets clip,albef,grit]
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_line  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0,
                    "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0}
WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()


def tiny_shards(tmp: Path, n: int) -> Path:
    """n small captioned images as shards: setup reads the data's size from them (the queue is clamped to it); the
    timed batches are made by `setup_preset`."""
    from PIL import Image

    from vlprep.shards import ShardsConfig, build_shards

    src = tmp / "src"
    src.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (32, 32), (i % 256, 0, 0)).save(src / f"{i:05d}.png")
        (src / f"{i:05d}.txt").write_text(f"a {WORDS[i % len(WORDS)]} picture number {i}")
    build_shards(ShardsConfig(src=src, out=tmp / "ds", samples_per_shard=1000, workers=1), progress=None)
    return tmp / "ds"


def setup_preset(preset: str, batch: int, device: torch.device, shards: Path, out: Path):
    """The pieces `vltrain.session.setup` builds for the preset (the trainer's speed options, precision, step
    function and optimiser), and one batch of random pixels and captions on the device."""
    from vltrain.config_load import load_config
    from vltrain.session import setup

    sets = ["data.val_frac=0", "data.workers=0"]
    sets += ["loss.distill_warmup_steps=0", "model.queue_size=4096"] if preset == "albef" else []
    cfg = load_config(preset, sets=sets, shards=[str(shards)], out=str(out), batch_size=batch, device=str(device))
    s = setup(cfg, overwrite=True, quiet=True)
    s.close()  # the pieces alone: the batches are made here
    tok = s.data.tokenizer
    g = torch.Generator().manual_seed(0)
    caps = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(batch)]
    enc = tok(caps, padding="max_length", truncation=True, max_length=s.cfg.data.max_len, return_tensors="pt")
    images = torch.randn(batch, 3, 224, 224, generator=g)
    if s.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    b = {"images": images, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "captions": caps}
    b = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in b.items()}
    return s.cfg, s.model, s.step_fn, s.params, s.optimizer, tok, b


def step(cfg, model, step_fn, params, opt, tok, batch, gen) -> dict:
    from vltrain.optim import optimizer_step

    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = step_fn(batch, cfg.loss, gen, tok, cfg.loss.distill_alpha)
    feats = losses.pop("queue_feats")
    optimizer_step(model, opt, params, losses["total"], cfg.optim.grad_clip, feats)
    return losses


def forward_flops(cfg, step_fn, tok, batch, gen) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.autocast("cuda", dtype=torch.bfloat16):
        step_fn(batch, cfg.loss, gen, tok, cfg.loss.distill_alpha)
    return float(counter.get_total_flops())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--presets", default="clip,albef,grit")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak of the GPU (default: table)")
    args = ap.parse_args()
    print(load_line("start"), flush=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run this on a GPU machine)")
        print(load_line("end"))
        return 0
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)
    print(f"{name}, torch {torch.__version__}, bf16 autocast, TF32, channels_last, fused AdamW; "
          f"peak {peak or '?'} TFLOP/s bf16")
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    # enough samples that albef's 4096-entry queue is not clamped to the training split
    shards = tiny_shards(tmp, max(4096, max(map(int, args.batches.split(",")))))
    for preset in args.presets.split(","):
        for batch in map(int, args.batches.split(",")):
            built = setup_preset(preset, batch, device, shards, tmp / "out")
            gen = torch.Generator(device=device).manual_seed(0)
            try:
                times = []
                for i in range(args.steps + 3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(*built, gen)
                    torch.cuda.synchronize()
                    if i >= 3:  # allocator, cuDNN autotuning and autograd warm-up
                        times.append(time.perf_counter() - t0)
                flops = 3 * forward_flops(built[0], built[2], built[5], built[6], gen)
            except torch.cuda.OutOfMemoryError:
                print(f"  {preset:<6} batch {batch:>4}: out of memory")
                torch.cuda.empty_cache()
                continue
            sec = statistics.median(times)
            mfu = f"{100 * flops / sec / (peak * 1e12):.1f}%" if peak else "? (give --peak-tflops)"
            print(f"  {preset:<6} batch {batch:>4}: {batch / sec:8.1f} samples/s, {sec * 1e3:7.1f} ms/step, "
                  f"{flops / sec / 1e12:6.1f} TFLOP/s, MFU {mfu}")
            del built
            torch.cuda.empty_cache()
    shutil.rmtree(tmp, ignore_errors=True)
    print(load_line("end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

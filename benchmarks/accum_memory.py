"""Peak memory of one training step at train.accum_steps K = 1, 2, 4 (clip and albef presets), ratios against K = 1.

What it measures: the most bytes torch holds at once during one optimiser step (forward, backward, AdamW step,
momentum update, enqueue) ABOVE what was held when the step began (the model, its AdamW state, the batch): the
step's activations, gradients and temporaries, which is what accumulation shrinks.
- On CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus `memory_allocated()` at the
  step's start (the caching allocator's own count of live tensor bytes).
- On a CPU: `torch.profiler` with profile_memory=True records every allocation and free torch makes (bytes and
  time); the running sum of them, in time order, is the live bytes above the start; its maximum is the peak. Memory
  outside torch's allocator (Python objects, the tokenizer) is not counted on either device.
Every K runs on a copy of the same model, on the same batch, after one warm-up step (so AdamW's state exists before
the measured step on every side). The image and text towers are random-initialised (no weights are loaded).

    .venv/bin/python benchmarks/accum_memory.py [--batch 64] [--text minilm] [--image efficientnet-lite0]
"""

import argparse
import copy
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_bytes  # noqa: E402
from vltrain.accum import AccumStep
from vltrain.config_load import load_config
from vltrain.model import build_model, build_tokenizer
from vltrain.optim import build_optimizer, optimizer_step
from vltrain.step import train_step

PRESETS = {"clip": [], "albef": ["model.queue_size=1024"]}


def batch_for(cfg, b: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    captions = [f"a photo of a {['red', 'small', 'old'][i % 3]} thing number {i} next to {i % 7} dogs on a table "
                f"in the park" for i in range(b)]
    tok = build_tokenizer(cfg.model)(captions, padding="max_length", max_length=cfg.data.max_len, truncation=True,
                                     return_tensors="pt")
    size = cfg.data.image_size
    return {"images": torch.randn(b, 3, size, size, generator=g).to(device), "input_ids": tok["input_ids"].to(device),
            "attention_mask": tok["attention_mask"].to(device), "captions": captions}


def one_step(model, cfg, batch: dict, k: int, optimizer, params) -> None:
    generator = torch.Generator(device=batch["input_ids"].device).manual_seed(0)
    step = functools.partial(train_step, model) if k == 1 else AccumStep(model, k)
    losses = step(batch, cfg.loss, generator, None, 0.4)
    enqueue = losses.pop("queue_feats")
    update = optimizer_step if k == 1 else step.optimizer_step
    update(model, optimizer, params, losses["total"], cfg.optim.grad_clip, enqueue)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--text", default="minilm")
    p.add_argument("--image", default="efficientnet-lite0")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--presets", default="clip,albef")
    args = p.parse_args()
    device = torch.device(args.device)
    print(f"batch {args.batch}, text {args.text}, image {args.image} at {args.image_size} px, {args.max_len} tokens, "
          f"{device}")
    print(f"{'preset':<8} {'K':>2} {'peak MiB':>10} {'vs K=1':>7}")
    for preset in args.presets.split(","):
        cfg = load_config(preset, sets=[f"model.text_model={args.text}", f"model.image_model={args.image}",
                                        f"data.image_size={args.image_size}", f"data.max_len={args.max_len}",
                                        *PRESETS[preset]])
        torch.manual_seed(0)
        base = build_model(cfg.model, pretrained=False).to(device).train()
        batch = batch_for(cfg, args.batch, device)
        first = None
        for k in (1, 2, 4):
            model = copy.deepcopy(base)
            optimizer, params = build_optimizer(model, cfg.optim, device)
            one_step(model, cfg, batch, k, optimizer, params)  # warm-up: AdamW's state exists from here on
            peak = peak_bytes(lambda: one_step(model, cfg, batch, k, optimizer, params), device)
            first = first or peak
            print(f"{preset:<8} {k:>2} {peak / 2**20:>10.1f} {peak / first:>7.2f}")


if __name__ == "__main__":
    main()

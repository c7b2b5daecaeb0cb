"""Peak memory and time of one training step with and without train.grad_checkpointing, measured in the same run.

Model: the packaged MiniLM text encoder and EfficientNet-Lite0 image tower on pixels (trained, BatchNorm in training
   mode), built as `vltrain run` builds them (load_config of the preset, build_model, length groups on), with the
   preset's own dropout. Batch: --batch random images at --size px and captions of 6 to 30 words, tokenised at
   data.max_len 32 and padded to the longest.
Step: `train_step` (forward and losses) and the backward of its total, gradients set to None before it, so both
   ways allocate them. No optimiser step: AdamW's state is the same with and without, and not what is compared.
Peak: on CUDA, torch.cuda.max_memory_allocated during the step, less what was allocated before it. On a CPU, the
   highest running total of the bytes torch's CPU allocator hands out and takes back during the step, from every
   allocation and free event torch.profiler(profile_memory=True) records (its raw "[memory]" records, signed
   sizes), in time order (the weights and
   anything allocated before the step are not counted; gradients, activations, recomputed activations and
   temporaries are).
Time: the median of --reps steps each way, alternated, without the profiler; the first step each way is untimed.

    .venv/bin/python benchmarks/checkpoint_memory.py [--presets clip,albef] [--batch 32] [--size 224] [--reps 3]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_bytes  # noqa: E402
from vltrain.config_load import load_config  # noqa: E402
from vltrain.model import build_model, build_tokenizer  # noqa: E402
from vltrain.step import train_step  # noqa: E402

WORDS = "red green blue small large old new dog cat bird tree house car boat road sky".split()


def make_batch(cfg, batch: int, size: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, 31, (batch,), generator=g).tolist()
    captions = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n)) for i, n in enumerate(lengths)]
    tok = build_tokenizer(cfg.model)(captions, padding="longest", truncation=True, max_length=cfg.data.max_len,
                                     return_tensors="pt")
    return {"images": torch.randn(batch, 3, size, size, generator=g).to(device),
            "input_ids": tok["input_ids"].to(device), "attention_mask": tok["attention_mask"].to(device),
            "captions": captions}


def one_step(model, cfg, batch: dict) -> None:
    model.zero_grad(set_to_none=True)
    out = train_step(model, batch, cfg.loss, torch.Generator(device=batch["images"].device).manual_seed(1))
    out["total"].backward()
    if batch["images"].is_cuda:
        torch.cuda.synchronize()


def step_peak(model, cfg, batch: dict) -> int:
    """The step's peak of allocated bytes above what was allocated before it (see the module docstring)."""
    model.zero_grad(set_to_none=True)
    return peak_bytes(lambda: one_step(model, cfg, batch), batch["images"].device)


def step_time(model, cfg, batch: dict, on: bool) -> float:
    model.set_grad_checkpointing(on)
    start = time.perf_counter()
    one_step(model, cfg, batch)
    return time.perf_counter() - start


def measure(preset: str, args, device: torch.device) -> dict:
    sets = ["model.text_model=minilm", "model.image_model=efficientnet-lite0", f"data.image_size={args.size}"]
    cfg = load_config(preset, sets=sets)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).train()
    model.set_unpad(4)  # as train.unpad's default
    batch = make_batch(cfg, args.batch, args.size, device)
    peaks = {}
    for on in (False, True):
        model.set_grad_checkpointing(on)
        one_step(model, cfg, batch)  # untimed: allocator and kernels warm
        peaks[on] = step_peak(model, cfg, batch)
    times = {False: [], True: []}
    for _ in range(args.reps):
        for on in (False, True):
            times[on].append(step_time(model, cfg, batch, on))
    plain = statistics.median(times[False])
    ckpt = statistics.median(times[True])
    return {"preset": preset, "peak_off": peaks[False], "peak_on": peaks[True], "time_off": plain, "time_on": ckpt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="clip,albef")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    print(f"device {device}, batch {args.batch}, {args.size} px, MiniLM + EfficientNet-Lite0 on pixels, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    rows = [measure(preset, args, device) for preset in args.presets.split(",")]
    print("| preset | peak without | peak with | with / without | step without | step with | with / without |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mib_off = r["peak_off"] / 2**20
        mib_on = r["peak_on"] / 2**20
        print(f"| {r['preset']} | {mib_off:,.0f} MiB | {mib_on:,.0f} MiB | {r['peak_on'] / r['peak_off']:.2f} | "
              f"{r['time_off']:.2f} s | {r['time_on']:.2f} s | {r['time_on'] / r['time_off']:.2f} |")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

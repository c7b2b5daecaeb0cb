"""Training throughput on one GPU: samples/s, step-time parts, peak memory and MFU for the presets at two model sizes.

Sizes (--size): small = the packaged EfficientNet-Lite0 at 224 px + `random:minilm` (MiniLM-L6's shape, random
weights); base = timm's ViT-B/16 at 224 px (random init) + `random:bert-base`, the fusion presets with 6 fusion layers
split from the 12 (ALBEF's 6 + 6), about 210M parameters with the fusion encoder; tiny = the tests' tiny towers at
32 px (a CPU dry run). No weights are downloaded: only the packaged MiniLM's tokenizer and, for small, Lite0's
weights. --patch-dropout 0,0.5: the rows at each model.patch_dropout (FLIP's patch dropout; a ViT tower: base), P > 0
in the row as `patch_dropout` (rows without it ran at 0).
Each row is one (size, preset, batch, train.grad_checkpointing, train.compile) built by `vltrain.session.setup` with
the trainer's GPU options (TF32, channels_last, fused AdamW) and run on one batch of random pixels and captions (they
time the same as real ones). A step: the batch moved to the device, the losses (`TrainStep` under the run's
precision), backward and gradient clipping, the optimiser (AdamW, momentum update, enqueue).
Headline (samples_per_s, step_ms): --warmup untimed steps, then --runs runs of --timed-steps steps each with no
synchronisation between steps (as `vltrain run` steps: the CPU queues the next step's work while the GPU runs this
one), timed with CUDA events around each run (the wall clock on a CPU); the median run's time per step.
Parts (data_ms / forward_ms / backward_ms / optimizer_ms, and their sum sync_step_ms): --steps further steps timed
in those four parts with a device synchronisation between them (so the CPU's launch of one part cannot overlap the
GPU's work on the last; their sum is above the headline step); medians. Peak memory:
torch.cuda.max_memory_allocated, reset per row (n/a on a CPU).
FLOPs (gflop_per_sample, tflops): counted by torch's FlopCounterMode over one step's forward and backward (eager;
compiled rows reuse their eager row's count), so each forward is counted as often as it runs: a forward that carries
gradients once plus its backward as it runs (about twice the forward: gradients of inputs and of weights, fewer
where nothing needs them, e.g. a frozen tower), a no-grad forward (ALBEF's momentum model) once, and an extra
backward (SoftMask++'s Grad-CAM pass) as it runs. The optimiser has no matmuls. MFU: FLOP/s over the card's dense
bf16 peak from its vendor's data sheet (SPEC_BF16_TFLOPS; the figure every public MFU quotes), and mfu_measured over
the dense matmul peak measured at the start (bf16 8192^3 matmuls on CUDA; float32 1024^3 on a CPU, which has no
vendor figure: there mfu is the measured one). An out-of-memory row says so and the next row runs. --max-batch: for each
(size, preset, ckpt), the largest batch of 32, 64, 128, ... that steps (up to --max-batch-limit, within
--max-batch-seconds). --json FILE appends one header object and one object per row (so several calls can fill one
file); --table prints a markdown table at the end. Without CUDA (and without --device cpu) it prints "no CUDA device"
and exits 0.

    python benchmarks/gpu.py [--size small,base] [--presets clip,albef,grit,softmask] [--batches 64,128]
        [--compile off,on] [--ckpt off,on] [--patch-dropout 0,0.5] [--max-batch] [--json F] [--table]
    python benchmarks/gpu.py --device cpu --size tiny --presets clip,albef --batches 4 --steps 1 --timed-steps 2 \
        --runs 1 --json F
"""

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_line  # noqa: E402

SPEC_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0}  # dense, vendor sheets
WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()
SIZES = {
    "tiny": {"text": "tiny", "image": "tiny", "px": 32, "fusion": 1, "queue": 16,
             "extra": ["model.embed_dim=16", "data.max_len=12"]},
    "small": {"text": "random:minilm", "image": "efficientnet-lite0", "px": 224, "fusion": None, "queue": 4096,
              "extra": []},
    "base": {"text": "random:bert-base", "image": "timm:vit_base_patch16_224", "px": 224, "fusion": 6,
             "queue": 4096, "extra": ["model.image_weights="]},
}
PARTS = ("data", "forward", "backward", "optimizer")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device) -> float:
    """Measured dense matmul TFLOP/s: bf16 8192^3 on CUDA, float32 1024^3 on a CPU; the median of the timed reps."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 1024
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    times = []
    for i in range(13 if cuda else 5):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        if i >= 3:  # clocks ramping up, cuBLAS heuristics
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def tiny_shards(tmp: Path, n: int) -> Path:
    """n small captioned images as shards in tmp/ds-N (kept there for another call): setup reads the data's size
    from them (the queue is clamped to it); the timed batch is made by `build`."""
    from PIL import Image

    from vlprep.shards import ShardsConfig, build_shards

    out = tmp / f"ds-{n}"
    if (out / "sizes.json").is_file():  # written last: a finished dataset
        return out
    src = tmp / f"src-{n}"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (32, 32), (i % 256, 0, 0)).save(src / f"{i:05d}.png")
        (src / f"{i:05d}.txt").write_text(f"a {WORDS[i % len(WORDS)]} picture number {i}")
    build_shards(ShardsConfig(src=src, out=out, samples_per_shard=1000, workers=1, overwrite=True), progress=None)
    shutil.rmtree(src)
    return out


COMPILE_MODES = {"off": "off", "on": "towers", "towers": "towers", "step": "step"}  # --compile -> train.compile


def config_sets(size: str, preset: str, precision: str, compile_mode: str, ckpt_on: bool,
                patch_dropout: float = 0.0) -> list[str]:
    """--set overrides for one row: the size's towers, the benchmark's data options and the row's switches."""
    from vltrain.config_load import load_config

    spec = SIZES[size]
    sets = [f"model.text_model={spec['text']}", f"model.image_model={spec['image']}", f"data.image_size={spec['px']}",
            "data.val_frac=0", "data.workers=0", f"train.precision={precision}", *spec["extra"]]
    preset_model = load_config(preset).model
    if preset_model.fusion_layers and spec["fusion"]:
        sets += [f"model.fusion_layers={spec['fusion']}", "model.fusion_from=split"]
    if preset_model.queue_size:
        sets.append(f"model.queue_size={spec['queue']}")
    if preset == "albef":
        sets.append("loss.distill_warmup_steps=0")  # distillation from the first step, as after ALBEF's first epoch
    # train.compile: "on" is the towers mode (what the first GPU checks ran), "step" the whole step
    sets += [f"train.compile={COMPILE_MODES[compile_mode]}"] * (compile_mode != "off")
    sets += ["train.grad_checkpointing=true"] * ckpt_on
    sets += [f"model.patch_dropout={patch_dropout}"] * (patch_dropout > 0)
    return sets


def build(size: str, preset: str, batch: int, device: torch.device, shards: Path, out: Path, sets: list[str]):
    """The pieces `vltrain.session.setup` builds for the row, and one CPU batch of random pixels and captions."""
    from vltrain.config_load import load_config
    from vltrain.session import setup

    cfg = load_config(preset, sets=sets, shards=[str(shards)], out=str(out), batch_size=batch, device=str(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "starts from random weights": that is the point here
        s = setup(cfg, overwrite=True, quiet=True)
    s.close()  # the pieces alone: the batch is made here
    tok = s.data.tokenizer
    g = torch.Generator().manual_seed(0)
    caps = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(batch)]
    enc = tok(caps, padding="max_length", truncation=True, max_length=s.cfg.data.max_len, return_tensors="pt")
    px = SIZES[size]["px"]
    images = torch.randn(batch, 3, px, px, generator=g)
    if s.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    b = {"images": images, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "captions": caps}
    if device.type == "cuda":
        b = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in b.items()}
    return s, b


def one_step(s, cpu_batch: dict, gen: torch.Generator, mark=None) -> None:
    """One training step as the trainer takes it; `mark()` (a synchronise and a clock reading) after each part."""
    from vltrain.model import autocast
    from vltrain.optim import apply_gradients

    cfg = s.cfg
    b = {k: v.to(s.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in cpu_batch.items()}
    mark and mark()
    with autocast(s.device, s.precision):
        losses = s.step_fn(b, cfg.loss, gen, s.data.tokenizer, cfg.loss.distill_alpha)
    mark and mark()
    feats = losses.pop("queue_feats")
    s.optimizer.zero_grad(set_to_none=True)
    losses["total"].backward()
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(s.params, cfg.optim.grad_clip)
    mark and mark()
    apply_gradients(s.model, s.optimizer, s.params, 0.0, feats)  # clipped above: the optimiser part alone
    mark and mark()


def timed_step(s, cpu_batch: dict, gen: torch.Generator) -> dict:
    """One training step in four synchronised parts: seconds per part."""
    t = []

    def mark():
        sync(s.device)
        t.append(time.perf_counter())

    mark()
    one_step(s, cpu_batch, gen, mark)
    return {p: t[i + 1] - t[i] for i, p in enumerate(PARTS)}


def timed_run(step, device: torch.device, steps: int) -> float:
    """Seconds per `step()` over `steps` calls with no synchronisation between them: CUDA events around the run on a
    GPU (the queue drained before the first and after the last), the wall clock on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def count_flops(run) -> float:
    """FLOPs of the matmuls and convolutions that `run()` executes, its backward included when it calls one
    (torch's FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        run()
    return float(counter.get_total_flops())


def step_flops(s, cpu_batch: dict, gen: torch.Generator) -> float:
    """One step's forward and backward FLOPs, as each pass runs (see the module's docstring)."""
    from vltrain.model import autocast

    b = {k: v.to(s.device) if torch.is_tensor(v) else v for k, v in cpu_batch.items()}

    def run():
        with autocast(s.device, s.precision):
            losses = s.step_fn(b, s.cfg.loss, gen, s.data.tokenizer, s.cfg.loss.distill_alpha)
        s.optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        s.optimizer.zero_grad(set_to_none=True)  # counted, not applied

    return count_flops(run)


def free(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled graphs (and the modules their guards hold) of the last row
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(args, key: dict, device: torch.device, shards: Path, out: Path, steps: int, warmup: int,
            flops_cache: dict | None, n_runs: int | None = None, timed_steps: int | None = None) -> dict:
    """One row: {**key, status, samples_per_s, step_ms, PART_ms, peak_mem_gib, tflops, mfu, params_m}."""
    from vltrain.config import ConfigError

    row = {**key, "status": "ok"}
    free(device)
    s = None
    try:
        sets = config_sets(key["size"], key["preset"], args.precision, key["compile"], key["ckpt"] == "on",
                           key.get("patch_dropout", 0.0))
        s, cpu_batch = build(key["size"], key["preset"], key["batch"], device, shards, out, sets)
        gen = torch.Generator(device=device).manual_seed(0)
        for _ in range(warmup):
            one_step(s, cpu_batch, gen)
        runs = [timed_run(lambda: one_step(s, cpu_batch, gen), device, timed_steps or args.timed_steps)
                for _ in range(n_runs or args.runs)]
        parts = [timed_step(s, cpu_batch, gen) for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        fkey = (key["size"], key["preset"], key["batch"], key.get("patch_dropout", 0.0))  # dropping costs less
        if flops_cache is not None and fkey not in flops_cache and key["compile"] == "off":
            flops_cache[fkey] = step_flops(s, cpu_batch, gen)
        flops = (flops_cache or {}).get(fkey)
        params = sum(p.numel() for p in s.model.parameters() if p.requires_grad)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "out of memory"
    except ConfigError as e:  # e.g. a key this checkout does not have yet
        row["status"] = f"error: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001  one failing row must not cost a short GPU slot its other rows
        row["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    if row["status"] != "ok":
        del s
        free(device)
        return row
    sec = statistics.median(runs)
    spec = args.spec or args.peak  # no vendor figure (a CPU, an unknown card): the measured peak
    row.update(samples_per_s=round(key["batch"] / sec, 2), step_ms=round(sec * 1e3, 2),
               **{f"{p}_ms": round(statistics.median(x[p] for x in parts) * 1e3, 2) for p in PARTS},
               sync_step_ms=round(statistics.median(sum(x.values()) for x in parts) * 1e3, 2),
               peak_mem_gib=None if peak is None else round(peak, 3), params_m=round(params / 1e6, 2),
               gflop_per_sample=None if flops is None else float(f"{flops / key['batch'] / 1e9:.4g}"),
               tflops=None if flops is None else float(f"{flops / sec / 1e12:.4g}"),
               mfu=None if flops is None else float(f"{flops / sec / (spec * 1e12):.4g}"),
               mfu_measured=None if flops is None else float(f"{flops / sec / (args.peak * 1e12):.4g}"))
    del s
    free(device)
    return row


def max_batch(args, key: dict, device: torch.device, shards: Path, out: Path) -> dict:
    """The largest batch of 32, 64, ... (up to --max-batch-limit) that steps, with its throughput and memory."""
    row = {**key, "kind": "max_batch", "max_batch": 0, "stopped": "limit"}
    start = time.perf_counter()
    batch = 32
    while batch <= args.max_batch_limit:
        if time.perf_counter() - start > args.max_batch_seconds:
            row["stopped"] = "time"
            break
        r = measure(args, {**key, "batch": batch}, device, shards, out, steps=1, warmup=1, flops_cache=None,
                    n_runs=1, timed_steps=2)
        if r["status"] != "ok":
            row["stopped"] = r["status"]
            break
        row.update(max_batch=batch, samples_per_s=r["samples_per_s"], peak_mem_gib=r["peak_mem_gib"])
        batch *= 2
    row.pop("batch", None)
    return row


def table(rows: list[dict]) -> str:
    """A markdown table of the rows."""
    lines = ["| size | preset | batch | ckpt | compile | samples/s | ms/step | synchronised parts, ms (data / fwd / bwd / "
             "opt) | peak GiB | GFLOP/sample | TFLOP/s | MFU (vendor peak) | MFU (measured peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shown = lambda r: r["preset"] + (f" (patch_dropout {r['patch_dropout']})"  # noqa: E731
                                     if r.get("patch_dropout") else "")
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    na = lambda v: "n/a" if v is None else v  # noqa: E731
    for r in rows:
        if r.get("kind") == "max_batch":
            lines.append(f"| {r['size']} | {shown(r)} | max {r['max_batch']} ({r['stopped']}) | {r['ckpt']} | off | "
                         f"{r.get('samples_per_s', '–')} | | | {r.get('peak_mem_gib', '–')} | | | | |")
        elif r["status"] != "ok":
            lines.append(f"| {r['size']} | {shown(r)} | {r['batch']} | {r['ckpt']} | {r['compile']} | "
                         f"{r['status']} | | | | | | | |")
        else:
            parts = " / ".join(f"{r[p + '_ms']:.1f}" for p in PARTS)
            mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
            lines.append(f"| {r['size']} | {shown(r)} | {r['batch']} | {r['ckpt']} | {r['compile']} | "
                         f"{r['samples_per_s']:.1f} | {r['step_ms']:.1f} | {r['sync_step_ms']:.1f} ({parts}) | {mem} | "
                         f"{na(r['gflop_per_sample'])} | {na(r['tflops'])} | {pct(r['mfu'])} | "
                         f"{pct(r['mfu_measured'])} |")
    return "\n".join(lines)


def csv(value: str, allowed=None) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if allowed is not None and v not in allowed]
    if bad or not items:
        raise SystemExit(f"error: {value!r}: use a comma-separated list of {', '.join(allowed)}")
    return items


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small,base", help="comma-separated: tiny, small, base")
    ap.add_argument("--presets", default="clip,albef,grit,softmask")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--compile", default="off",
                    help="comma-separated train.compile modes: off, towers (or on), step (the whole step)")
    ap.add_argument("--ckpt", default="off", help="off, on or off,on (train.grad_checkpointing)")
    ap.add_argument("--patch-dropout", default="0",
                    help="comma-separated model.patch_dropout values in [0, 1) (FLIP; a ViT tower: size base)")
    ap.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--steps", type=int, default=10, help="synchronised steps timed in parts")
    ap.add_argument("--timed-steps", type=int, default=30, help="unsynchronised steps per headline run")
    ap.add_argument("--runs", type=int, default=3, help="headline runs (their median is the row's step time)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-batch", action="store_true", help="also find the largest batch per (size, preset, ckpt)")
    ap.add_argument("--max-batch-limit", type=int, default=1024)
    ap.add_argument("--max-batch-seconds", type=float, default=120.0, help="time bound of each search")
    ap.add_argument("--json", type=Path, default=None, help="append a header and the rows as JSON lines")
    ap.add_argument("--table", action="store_true", help="print a markdown table at the end")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="keep the generated shards here for later calls (default: a temporary folder)")
    args = ap.parse_args(argv)
    args.sizes = csv(args.size, SIZES)
    args.preset_list = csv(args.presets, ("clip", "albef", "albef-base", "grit", "softmask", "fistful"))
    args.batch_list = [int(b) for b in csv(args.batches)]
    for name in ("steps", "timed_steps", "runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    args.compile_list = csv(args.compile, tuple(COMPILE_MODES))
    args.ckpt_list = csv(args.ckpt, ("off", "on"))
    try:
        args.drop_list = [float(v) for v in csv(args.patch_dropout)]
    except ValueError:
        args.drop_list = [-1.0]
    if not all(0 <= p < 1 for p in args.drop_list):
        raise SystemExit(f"error: --patch-dropout {args.patch_dropout}: give values in [0, 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(load_line("start"), flush=True)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run this on a GPU machine, or pass --device cpu)")
        print(load_line("end"))
        return 0
    device = torch.device("cpu" if args.device == "cpu" else "cuda")
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    args.peak = matmul_peak(device)
    spec = next((v for k, v in SPEC_BF16_TFLOPS.items() if k in name), None) if device.type == "cuda" else None
    args.spec = spec
    header = {"kind": "header", "device": name, "torch": torch.__version__, "precision": args.precision,
              "peak_tflops_measured": float(f"{args.peak:.4g}"),
              "peak_dtype": "bf16" if device.type == "cuda" else "fp32",
              "peak_tflops_spec": spec, "mfu_against": "vendor" if spec else "measured", "steps": args.steps,
              "timed_steps": args.timed_steps, "runs": args.runs, "warmup": args.warmup,
              "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2 ** 30, 1)
              if device.type == "cuda" else None}
    print(f"{name}, torch {torch.__version__}, {args.precision}; measured matmul peak {args.peak:.4g} TFLOP/s "
          f"({header['peak_dtype']}; spec {spec or '?'})", flush=True)
    rows = [header]
    emit = open(args.json, "a") if args.json else contextlib.nullcontext()  # noqa: SIM115
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    data_dir = args.data_dir or tmp
    try:
        with emit as sink:
            def report(row: dict) -> None:
                rows.append(row)
                print(json.dumps(row), flush=True)
                if sink:
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()

            if sink:
                sink.write(json.dumps(header) + "\n")
            queue = max(SIZES[s]["queue"] for s in args.sizes)
            biggest = max(args.batch_list + ([args.max_batch_limit] if args.max_batch else []))
            # enough samples that a preset's queue is not clamped to the training split, and GRIT's sampler fits
            shards = tiny_shards(data_dir, max(queue, 2 * biggest))
            flops_cache = {}
            for size in args.sizes:
                for preset in args.preset_list:
                    base = {"kind": "row", "size": size, "preset": preset, "precision": args.precision}
                    for drop in args.drop_list:
                        dropped = {**base, "patch_dropout": drop} if drop else base
                        for batch in args.batch_list:
                            for ckpt in args.ckpt_list:
                                for comp in args.compile_list:
                                    key = {**dropped, "batch": batch, "ckpt": ckpt, "compile": comp}
                                    report(measure(args, key, device, shards, tmp / "out", args.steps, args.warmup,
                                                   flops_cache))
                    for ckpt in args.ckpt_list if args.max_batch else []:
                        report(max_batch(args, {**base, "ckpt": ckpt, "compile": "off"}, device, shards,
                                         tmp / "out"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.table:
        print(table(rows[1:]))
    print(load_line("end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

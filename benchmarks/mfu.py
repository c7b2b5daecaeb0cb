"""Model FLOPs utilisation of the trainer's step on cached tokens, against the matmul peak measured in the same run.

Peak: the median FLOP/s of --peak-reps square matmuls of --peak-size (2 n^3 FLOPs each; default 2048 on a CPU and
   8192 on CUDA, where smaller ones stay below the card's peak) in float32, and in bfloat16 where the device runs it
   natively (CUDA; a CPU that reports AVX512_BF16 or AMX). The peak is what this machine's BLAS reaches on one large
   matmul with every thread, so no step of smaller matmuls can reach 100% of it.
Step: for each preset of --presets and batch of --batches, the trainer's own step on batches drawn the way `vltrain
   run` draws them from the `vlprep features` dataset --data (its sampler, bucketing and collate: the pieces
   `vltrain.session.setup` builds, data.val_frac 0.05), the --text-model (default the packaged MiniLM; random:minilm
   is its shape with random weights, for a machine that holds the package's tokenizer alone), the process's
   allocator set as train() sets it (keep_freed_memory on a CPU): the batch moved to the device, the loss step
   (`TrainStep` under the run's precision, vltrain.model.autocast), then `optimizer_step` (backward, gradient
   clipping, fused AdamW, momentum update and enqueue). Nothing else of the loop (logging, checks, the GRIT
   collect) is timed. One untimed step, then --steps timed steps over the drawn batches; medians.
FLOPs: `torch.utils.flop_counter.FlopCounterMode` around one forward and backward of the same step (the optimiser
   has no matmuls). Total FLOPs: counted on each drawn batch as it is (captions padded to the longest in the batch).
   Useful FLOPs: the same step with the padding left out, computed as the mean over the batch's captions of F(L_i),
   where F(L) is the count of the step with every caption of the batch at L tokens and L_i is caption i's own
   length. F is a quadratic in L (linear layers grow with L, self-attention with L^2): it is fitted exactly to the
   counts at L = 8, 16 and 32 and checked at L = 24 (the fit error is printed). The masked-LM head runs on the
   masked positions only, a random ~15% of the real tokens, so F carries a little draw noise (under 1% here).
MFU: useful FLOPs per second of step / the peak of the dtype the step runs in. The padding share is 1 - useful /
   total. Samples/s: the batch / the median step time.
Extras (--extras): train.compile (the image and text encoders compiled in place, as the trainer does) on clip fp32
   batch 32, its median step against the eager one above and the compiling first step; and the frozen image
   tower's forward on pixels (packaged EfficientNet-Lite0, batch 32 at 224 px, no gradient), contiguous against
   channels_last; and (phases) clip's step at each batch in each precision, part by part (forward, backward,
   gradient clipping, AdamW; medians, timed apart), with the bf16 / fp32 ratio each part can reach.

Data: --data, a `vlprep features` dataset (default: the demo's demo-out/openclipart/bow-feat when it exists; else
   --images openclipart PNGs from /usr/share/openclipart/png with their file names as captions, or synthetic images,
   made into shards and features first, untimed, as benchmarks/features.py makes them; short captions there mean
   less padding than the demo's).

The load average is printed at the start and the end; the script always exits 0 and ends with a table.

    .venv/bin/python benchmarks/mfu.py [--data DIR] [--presets clip,albef,grit,softmask] [--batches 32,128]
        [--precisions fp32,bf16] [--steps 6] [--device auto|cpu|cuda] [--text-model minilm|random:minilm]
"""

import argparse
import contextlib
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo-out" / "openclipart" / "bow-feat"
FIT_LENGTHS = (8, 16, 32)
CHECK_LENGTH = 24
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, device: torch.device, n: int, reps: int) -> float:
    """Median FLOP/s of `reps` (n, n) @ (n, n) matmuls in `dtype` after two untimed ones."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(dtype)
    b = torch.randn(n, n, generator=g, device=device).to(dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def make_data(tmp: Path, n: int) -> tuple[Path, str]:
    """A `vlprep features` dataset of n images (benchmarks/features.py's images), made untimed."""
    from features import make_shards
    from vlprep.features import FeaturesConfig, features

    pixels, origin = make_shards(tmp, n)
    with contextlib.redirect_stderr(io.StringIO()):
        features(FeaturesConfig(src=pixels, out=tmp / "feat", device="cpu"))
    return tmp / "feat", origin


class Setup:
    """One (preset, batch, precision): the pieces `vltrain.session.setup` builds for the run (the resolved config,
    model with train()'s speed options, step function, optimiser) and the batches its feed draws (on the device)."""

    def __init__(self, data: Path, preset: str, batch: int, precision: str, device: torch.device, n_batches: int,
                 out: Path, compile: bool = False, text_model: str = "minilm"):
        from vltrain.config_load import load_config
        from vltrain.data.collate import to_device
        from vltrain.session import setup

        sets = [f"model.text_model={text_model}", "data.workers=0", f"train.precision={precision}",
                f"train.compile={str(compile).lower()}"]
        cfg = load_config(preset=preset, sets=sets, shards=[str(data)], out=str(out), steps=1000, batch_size=batch,
                          device=device.type)
        s = setup(cfg, overwrite=True, quiet=True)
        self.cfg, self.model, self.step_fn, self.device = s.cfg, s.model, s.step_fn, s.device
        self.tokenizer, self.generator, self.precision = s.data.tokenizer, s.generator, s.precision
        self.optimizer, self.params = s.optimizer, s.params
        self.batches = []
        try:
            while len(self.batches) < n_batches:
                b, fault = s.feed.next(s.state)
                if fault is not None:
                    raise fault
                s.state.consumed += 1
                self.batches.append(to_device(b, device))
        finally:
            s.close()

    def forward(self, batch: dict) -> dict:
        from vltrain.model import autocast

        with autocast(self.device, self.precision):
            return self.step_fn(batch, self.cfg.loss, self.generator, self.tokenizer, self.cfg.loss.distill_alpha)

    def step(self, batch: dict) -> None:
        from vltrain.optim import optimizer_step

        losses = self.forward(batch)
        feats = losses.pop("queue_feats")
        optimizer_step(self.model, self.optimizer, self.params, losses["total"], self.cfg.optim.grad_clip, feats)

    def count(self, batch: dict) -> float:
        """FLOPs of one forward and backward of the step on `batch`."""
        counter = FlopCounterMode(display=False)
        with counter:
            losses = self.forward(batch)
            losses["total"].backward()
        self.optimizer.zero_grad(set_to_none=True)
        return float(counter.get_total_flops())

    def at_length(self, batch: dict, n: int) -> dict:
        """`batch` with every caption exactly n tokens long (token values do not change the FLOPs)."""
        ids = batch["input_ids"]
        reps = -(-n // ids.shape[1])
        out = dict(batch)
        out["input_ids"] = ids.repeat(1, reps)[:, :n].contiguous()
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out


def measure(s: Setup, steps: int) -> dict:
    """Median step time; total and useful FLOPs per step (means over the drawn batches)."""
    s.step(s.batches[0])  # untimed
    times = []
    for i in range(steps):
        b = s.batches[(i + 1) % len(s.batches)]
        sync(s.device)
        t0 = time.perf_counter()
        s.step(b)
        sync(s.device)
        times.append(time.perf_counter() - t0)
    total = statistics.mean(s.count(b) for b in s.batches)
    f = {n: s.count(s.at_length(s.batches[0], n)) for n in (*FIT_LENGTHS, CHECK_LENGTH)}
    x = torch.tensor(FIT_LENGTHS, dtype=torch.float64)
    coef = torch.linalg.solve(torch.stack([torch.ones_like(x), x, x * x], 1),
                              torch.tensor([f[n] for n in FIT_LENGTHS], dtype=torch.float64))

    def fit(n):
        return float(coef[0] + coef[1] * n + coef[2] * n * n)

    fit_error = abs(fit(CHECK_LENGTH) - f[CHECK_LENGTH]) / f[CHECK_LENGTH]
    lengths = [m.sum(1).tolist() for m in (b["attention_mask"] for b in s.batches)]
    useful = statistics.mean(statistics.mean(fit(n) for n in ls) for ls in lengths)
    padded = statistics.mean(b["input_ids"].shape[1] for b in s.batches)
    mean_len = statistics.mean(statistics.mean(ls) for ls in lengths)
    return {"time": statistics.median(times), "total": total, "useful": useful, "fit_error": fit_error,
            "padded_to": padded, "mean_len": mean_len}


def phases(s: Setup, steps: int) -> dict:
    """Median ms of each part of the step, timed apart (a sync before each clock read): the loss step's forward,
    the backward, gradient clipping, the AdamW step (the calls of `optimizer_step`, one at a time). The parts that
    bf16 cannot speed up show here: clipping and AdamW read and write float32 gradients, weights and state."""
    parts = {"forward": [], "backward": [], "clip": [], "adamw": []}
    for i in range(steps + 1):
        b = s.batches[i % len(s.batches)]
        clock = [time.perf_counter()]
        losses = s.forward(b)
        sync(s.device)
        clock.append(time.perf_counter())
        losses.pop("queue_feats")
        s.optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        sync(s.device)
        clock.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(s.params, s.cfg.optim.grad_clip)
        sync(s.device)
        clock.append(time.perf_counter())
        s.optimizer.step()
        sync(s.device)
        clock.append(time.perf_counter())
        if i:  # the first is untimed
            for k, a, b2 in zip(parts, clock, clock[1:]):
                parts[k].append(1e3 * (b2 - a))
    return {k: statistics.median(v) for k, v in parts.items()}


def channels_last_ratio(device: torch.device, reps: int) -> float:
    """Median time of the frozen packaged EfficientNet-Lite0 forward (no gradient, eval mode: the pixel path with
    model.freeze_image) on a batch of 32 at 224 px, contiguous over channels_last (weights and input alike);
    alternating rounds after one untimed call of each."""
    from vltrain.config_load import load_config
    from vltrain.model import build_model

    cfg = load_config(preset="clip", sets=["model.text_model=tiny", "model.freeze_image=true"])
    model = build_model(cfg.model).to(device).eval()
    x = torch.randn(32, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(device)
    times = {"contiguous": [], "channels_last": []}
    with torch.no_grad():
        for i in range(reps + 1):
            for fmt in times:
                layout = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
                model.image_encoder.to(memory_format=layout)
                xx = x.contiguous(memory_format=layout)
                sync(device)
                t0 = time.perf_counter()
                model.encode_image(xx)
                sync(device)
                if i:
                    times[fmt].append(time.perf_counter() - t0)
    a = statistics.median(times["contiguous"])
    b = statistics.median(times["channels_last"])
    print(f"  frozen image tower, batch 32 at 224: contiguous {1e3 * a:.0f} ms, channels_last {1e3 * b:.0f} ms "
          f"({a / b:.2f}x)", flush=True)
    return a / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None, help="a `vlprep features` dataset (default: the demo's bow-feat "
                    "when it exists, else one made from --images images)")
    ap.add_argument("--images", type=int, default=1120)
    ap.add_argument("--presets", default="clip,albef,grit,softmask")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--precisions", default="fp32,bf16", help="bf16 is skipped where the device lacks it")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row")
    ap.add_argument("--draw", type=int, default=4, help="batches drawn per row (FLOPs are their mean)")
    ap.add_argument("--peak-size", type=int, default=None, help="default: 2048 on a CPU, 8192 on CUDA")
    ap.add_argument("--peak-reps", type=int, default=10)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--text-model", default="minilm", help="model.text_model: minilm, or random:minilm (its shape, "
                    "random weights: no weights file needed)")
    ap.add_argument("--extras", default="compile,channels_last,phases", help="also time train.compile on clip batch "
                    "32 (compile), the frozen image tower's forward on pixels contiguous against channels_last "
                    "(channels_last), and clip's step part by part in each precision (phases); '' for none")
    args = ap.parse_args()

    from vltrain.model import bf16_supported

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device auto or cpu")
        return
    args.peak_size = args.peak_size or (8192 if device.type == "cuda" else 2048)
    print(common.load_line("start"), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-mfu-"))
    try:
        data = args.data
        origin = "--data"
        if data is None and DEMO.is_dir():
            data = DEMO
            origin = "the demo's bow-feat"
        elif data is None:
            data, origin = make_data(tmp, args.images)
        precisions = [p for p in args.precisions.split(",") if p == "fp32" or bf16_supported(device)]
        peaks = {p: matmul_peak(DTYPES[p], device, args.peak_size, args.peak_reps) for p in precisions}
        print(f"  device {device}, torch threads {torch.get_num_threads()}; data {data} ({origin}); peak "
              + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in peaks.items())
              + f" ({args.peak_size}^2 matmuls, median of {args.peak_reps})", flush=True)
        header = (f"  {'preset':<9}{'batch':>6} {'dtype':>5} {'step ms':>8} {'samples/s':>10} {'GFLOP':>7} "
                  f"{'useful':>7} {'pad %':>6} {'len':>5} {'padded':>7} {'MFU %':>6} {'useful MFU %':>13} {'fit':>6}")
        print(header, flush=True)
        rows = []
        for preset in args.presets.split(","):
            for batch in map(int, args.batches.split(",")):
                for p in precisions:
                    s = Setup(data, preset, batch, p, device, args.draw, tmp / "out",
                              text_model=args.text_model)
                    m = measure(s, args.steps)
                    del s
                    mfu, useful_mfu = (m[k] / m["time"] / peaks[p] for k in ("total", "useful"))
                    rows.append({"preset": preset, "batch": batch, "precision": p, **m, "mfu": mfu,
                                 "useful_mfu": useful_mfu, "samples_s": batch / m["time"]})
                    print(f"  {preset:<9}{batch:>6} {p:>5} {1e3 * m['time']:>8.1f} {batch / m['time']:>10.1f} "
                          f"{m['total'] / 1e9:>7.1f} {m['useful'] / 1e9:>7.1f} "
                          f"{100 * (1 - m['useful'] / m['total']):>6.1f} {m['mean_len']:>5.1f} {m['padded_to']:>7.1f} "
                          f"{100 * mfu:>6.1f} {100 * useful_mfu:>13.1f} {100 * m['fit_error']:>5.2f}%", flush=True)
        print("  (GFLOP: per step, forward + backward, as counted; useful: without the padding; len: mean caption "
              "tokens; padded: the batches' padded length; MFU against the peak of the step's dtype; fit: the "
              "quadratic's error at L = 24)")
        by = {(r["preset"], r["batch"], r["precision"]): r for r in rows}
        out = []
        if ("clip", 32, "fp32") in by:
            out.append(common.value_row("clip fp32 batch 32: useful MFU", 100 * by["clip", 32, "fp32"]["useful_mfu"],
                                        50.0, "% of the fp32 peak"))
        if ("clip", 32, "fp32") in by and ("clip", 128, "fp32") in by:
            out.append(common.value_row("clip fp32: samples/s batch 128 / batch 32",
                                        by["clip", 128, "fp32"]["samples_s"] / by["clip", 32, "fp32"]["samples_s"],
                                        1.0, "ratio"))
        for preset in ("albef", "grit", "softmask"):
            for batch in map(int, args.batches.split(",")):
                if (preset, batch, "fp32") in by:
                    out.append(common.value_row(f"{preset} fp32 batch {batch}: useful MFU",
                                                100 * by[preset, batch, "fp32"]["useful_mfu"], 35.0,
                                                "% of the fp32 peak"))
        for batch in map(int, args.batches.split(",")):
            if ("clip", batch, "bf16") in by:
                out.append(common.value_row(f"clip batch {batch}: bf16 / fp32 samples/s",
                                            by["clip", batch, "bf16"]["samples_s"]
                                            / by["clip", batch, "fp32"]["samples_s"], 1.6, "ratio"))
        extras = [e for e in args.extras.split(",") if e]
        if "compile" in extras and ("clip", 32, "fp32") in by:
            s = Setup(data, "clip", 32, "fp32", device, args.draw, tmp / "out", compile=True,
                      text_model=args.text_model)
            t0 = time.perf_counter()
            s.step(s.batches[0])
            first = time.perf_counter() - t0
            m = measure(s, args.steps)
            ratio = by["clip", 32, "fp32"]["time"] / m["time"]
            print(f"  train.compile, clip fp32 batch 32: step {1e3 * m['time']:.1f} ms against "
                  f"{1e3 * by['clip', 32, 'fp32']['time']:.1f} ms eager ({ratio:.2f}x); the first step (compiling) "
                  f"{first:.1f} s", flush=True)
            out.append(common.value_row("train.compile: eager / compiled step time (clip fp32 32)", ratio, None,
                                        "ratio", note=f"compile {first:.0f} s"))
        if "phases" in extras:
            for batch in map(int, args.batches.split(",")):
                got = {}
                for p in precisions:
                    got[p] = phases(Setup(data, "clip", batch, p, device, args.draw, tmp / "out",
                                          text_model=args.text_model), 2 * args.steps)
                    print(f"  clip batch {batch} {p}, ms per part: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                          got[p].items()), flush=True)
                if "bf16" in got:
                    fp32 = sum(got["fp32"].values())
                    fixed = got["bf16"]["clip"] + got["bf16"]["adamw"]
                    at3 = fixed + (got["fp32"]["forward"] + got["fp32"]["backward"]) / 3
                    print(f"  clip batch {batch}: fp32 / bf16 per part "
                          + ", ".join(f"{k} {got['fp32'][k] / got['bf16'][k]:.2f}x" for k in got["fp32"])
                          + f"; bf16's ceiling with clipping and AdamW as they are: {fp32 / fixed:.1f}x with a free "
                          f"forward and backward, {fp32 / at3:.2f}x with both 3x faster", flush=True)
        if "channels_last" in extras:
            ratio = channels_last_ratio(device, args.steps)
            out.append(common.value_row("frozen EfficientNet-Lite0 forward, batch 32 at 224: contiguous / "
                                        "channels_last time", ratio, None, "ratio"))
        print(common.load_line("end"), flush=True)
        common.print_table(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

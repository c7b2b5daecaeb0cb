"""A training sample's decode + transform in a loader worker: PIL's full JPEG decode against libjpeg-turbo's through
simplejpeg (`decode_view`, what the trainer does now) and against the draft decode, float32 views (ToDtype +
Normalize in the worker, as before) against uint8 views (normalised on the device by to_device).

The data: --images photograph-like JPEGs (a smooth colour field plus grain, q90) of each --sizes, in memory. Each
side decodes every image and applies vltrain's train_transform (augment --augment, crop to --crop px, min scale
--min-scale, --interpolation), the same seed per image on every side:
- full-float: vlprep.dataset.decode_rgb (PIL, full size), then the transform ending in ToDtype(float32) + Normalize
  (the former worker path, the yardstick).
- full-uint8: the PIL full decode, the uint8 transform (the normalisation left to the device).
- draft-uint8: decode_rgb with the transform's .draft (JPEG DCT scaling at the largest safe 1/k), uint8 transform.
- draft-float: the draft decode with the float ending, to separate the two changes.
- turbo-uint8: vltrain.data.samples.decode_view with the .draft, uint8 transform: the trainer's worker path. A JPEG
  that needs no draft (1/1) is decoded by libjpeg-turbo through simplejpeg into a (3, H, W) uint8 view; one the
  draft shrinks (at 224 px and scale 0.5: 1280x960 at 1/2, 2048x1536 at 1/4) goes to PIL's draft decode, so there
  this side is draft-uint8 plus decode_view's header read.
The sides run in alternating order --rounds times in one process, torch on one thread (a loader worker's); the
median CPU ms per sample of each side decides (the process's CPU time: steadier than the wall clock on a shared
machine; the wall-clock median is printed beside it), and the ratios to full-float and to full-uint8 are printed
with the bytes each view takes through the worker queue and the host-to-device copy, and the load average at start
and end. The table goes to --json (default benchmarks/results/decode.json).

    .venv/bin/python benchmarks/decode.py [--sizes 500x375,640x480,1280x960,2048x1536] [--images 10] [--rounds 5]
"""

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from vlprep.dataset import decode_rgb
from vltrain.data.samples import decode_view, train_transform

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
RESULTS = Path(__file__).resolve().parent / "results" / "decode.json"


def photo(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    field = np.stack([128 + 90 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c + seed) for c in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)).save(buf, "JPEG",
                                                                                                  quality=90)
    return buf.getvalue()


def sides(crop: int, min_scale: float, augment: str, interpolation: str) -> dict:
    """{name: (decode(data, draft), draft or None, transform)} of the five sides (module docstring)."""
    tf = train_transform(crop, MEAN, STD, min_scale, augment, interpolation)
    to_float = v2.Compose(list(tf.transforms) + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    return {"full-float": (decode_rgb, None, to_float), "full-uint8": (decode_rgb, None, tf),
            "draft-uint8": (decode_rgb, tf.draft, tf), "draft-float": (decode_rgb, tf.draft, to_float),
            "turbo-uint8": (decode_view, tf.draft, tf)}


def per_sample_ms(images: list[bytes], decode, draft, tf) -> tuple[float, float, int]:
    """(wall ms per sample, CPU ms per sample over the images, bytes of one view)."""
    t, c = time.perf_counter(), time.process_time()
    for i, data in enumerate(images):
        torch.manual_seed(i)
        x = tf(decode(data, draft))
    n = len(images)
    return (time.perf_counter() - t) * 1e3 / n, (time.process_time() - c) * 1e3 / n, x.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="500x375,640x480,1280x960,2048x1536")
    ap.add_argument("--images", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--min-scale", type=float, default=0.5)
    ap.add_argument("--augment", default="none", choices=["none", "albef", "softmask"])
    ap.add_argument("--interpolation", default="bilinear", choices=["bilinear", "bicubic"],
                    help="the crop's resize: bilinear (the clip preset's EfficientNet), bicubic (a CLIP tower's)")
    ap.add_argument("--json", type=Path, default=RESULTS, help="where the table goes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in load_start)} (1, 5, 15 min; {os.cpu_count()} cores); "
          f"crop {args.crop}, min scale {args.min_scale}, augment {args.augment}, {args.interpolation}, "
          f"{args.images} images per size, median of {args.rounds} rounds")
    fns = sides(args.crop, args.min_scale, args.augment, args.interpolation)
    rows = []
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        images = [photo(w, h, s) for s in range(args.images)]
        draft = fns["draft-uint8"][1](w, h)
        for name, side in fns.items():  # untimed pass: imports, kernels, caches
            per_sample_ms(images[:2], *side)
        wall = {name: [] for name in fns}
        cpu = {name: [] for name in fns}
        nbytes = {}
        for r in range(args.rounds):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                ms, cpu_ms, nbytes[name] = per_sample_ms(images, *fns[name])
                wall[name].append(ms)
                cpu[name].append(cpu_ms)
        med = {name: statistics.median(cpu[name]) for name in fns}
        print(f"{w}x{h} (draft 1/{draft}; JPEG {statistics.median(map(len, images)) / 1024:.0f} KiB median), "
              "CPU ms per sample:")
        for name in fns:
            print(f"  {name:12s} {med[name]:7.2f} ms/sample (wall {statistics.median(wall[name]):7.2f})  "
                  f"x{med['full-float'] / med[name]:5.2f} vs full-float  x{med['full-uint8'] / med[name]:5.2f} "
                  f"vs full-uint8  {nbytes[name] / 1024:6.1f} KiB/view")
        rows.append({"size": f"{w}x{h}", "draft": draft, "cpu_ms": med,
                     "wall_ms": {name: statistics.median(wall[name]) for name in fns},
                     "view_bytes": nbytes, "rounds_cpu_ms": cpu})
    load_end = os.getloadavg()
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in load_end)}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                     "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                     "cpus": os.cpu_count(), "load_start": load_start, "load_end": load_end,
                                     "rows": rows}, indent=1) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()

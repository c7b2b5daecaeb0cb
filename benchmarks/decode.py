"""A training sample's decode + transform in a loader worker: full JPEG decode against the draft decode, float32
views (ToDtype + Normalize in the worker, as before) against uint8 views (normalised on the device by to_device).

The data: --images photograph-like JPEGs (a smooth colour field plus grain, q90) of each --sizes, in memory. Each
side decodes every image with vlprep.dataset.decode_rgb and applies vltrain's train_transform (augment --augment,
crop to --crop px, min scale --min-scale), the same seed per image on every side:
- full-float: a full decode, then the transform ending in ToDtype(float32) + Normalize (the former worker path).
- full-uint8: a full decode, the uint8 transform (the normalisation left to the device).
- draft-uint8: decode_rgb with the transform's .draft (JPEG DCT scaling at the largest safe 1/k), uint8 transform.
- draft-float: the draft decode with the float ending, to separate the two changes.
The sides run in alternating order --rounds times in one process, torch on one thread (a loader worker's); the
median ms per sample of each side decides, and the ratios to full-float are printed with the bytes each view takes
through the worker queue and the host-to-device copy, and the load average at start and end.

    .venv/bin/python benchmarks/decode.py [--sizes 640x480,1280x960,2048x1536] [--images 20] [--rounds 5]
"""

import argparse
import io
import os
import statistics
import time

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from vlprep.dataset import decode_rgb
from vltrain.data.samples import train_transform

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def photo(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    field = np.stack([128 + 90 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c + seed) for c in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)).save(buf, "JPEG",
                                                                                                  quality=90)
    return buf.getvalue()


def sides(crop: int, min_scale: float, augment: str) -> dict:
    tf = train_transform(crop, MEAN, STD, min_scale, augment)
    to_float = v2.Compose(list(tf.transforms) + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    return {"full-float": (None, to_float), "full-uint8": (None, tf), "draft-uint8": (tf.draft, tf),
            "draft-float": (tf.draft, to_float)}


def per_sample_ms(images: list[bytes], draft, tf) -> tuple[float, int]:
    """(ms per sample over the images, bytes of one view)."""
    t = time.perf_counter()
    for i, data in enumerate(images):
        torch.manual_seed(i)
        x = tf(decode_rgb(data, draft))
    return (time.perf_counter() - t) * 1e3 / len(images), x.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="640x480,1280x960,2048x1536")
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--min-scale", type=float, default=0.5)
    ap.add_argument("--augment", default="none", choices=["none", "albef", "softmask"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; crop {args.crop}, min scale {args.min_scale}, "
          f"augment {args.augment}, {args.images} images per size, median of {args.rounds} rounds")
    fns = sides(args.crop, args.min_scale, args.augment)
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        images = [photo(w, h, s) for s in range(args.images)]
        draft = fns["draft-uint8"][0](w, h)
        for name, (d, tf) in fns.items():  # untimed pass: imports, kernels, caches
            per_sample_ms(images[:2], d, tf)
        times = {name: [] for name in fns}
        nbytes = {}
        for r in range(args.rounds):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                ms, nbytes[name] = per_sample_ms(images, *fns[name])
                times[name].append(ms)
        base = statistics.median(times["full-float"])
        print(f"{w}x{h} (draft 1/{draft}):")
        for name in fns:
            med = statistics.median(times[name])
            print(f"  {name:12s} {med:7.2f} ms/sample  x{base / med:5.2f} vs full-float  "
                  f"{nbytes[name] / 1024:6.1f} KiB/view")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

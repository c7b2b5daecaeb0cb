"""softmask's colour recipe on one loader worker's thread: torchvision's ColorJitter and GaussianBlur against
vltrain.data.colour's (the trainer's), each op alone and the recipe as train_transform applies it, in CPU ms per
call; and how far apart their outputs are in grey levels.

The data: --images uint8 (3, S, S) views at --size px, each the centre of a photograph-like image (a smooth colour
field in four octaves plus grain, benchmarks/loader.py's `photo`). Sides, each timed on every view:
- hue: torchvision's adjust_hue against `adjust_hue_uint8`, at hue factors drawn in [-0.1, 0.1] (ColorJitter's);
- jitter: v2.ColorJitter(0.4, 0.4, 0.4, 0.1) against vltrain.data.colour.ColorJitter, the same seed per view;
- blur: v2.GaussianBlur(k, sigma=(0.1, 2.0)) against vltrain.data.colour.GaussianBlur (k = 2 round(0.05 S) + 1, 23
  at 224 px), the same seed per view;
- recipe: RandomApply(jitter, p=0.8), RandomGrayscale(p=0.2), RandomApply(blur, p=0.5), the same seed per view.
Rounds alternate the order of the two sides; torch on one thread (a loader worker's); the median CPU ms
per call over --rounds rounds decides (process CPU time, steadier than the wall clock on a shared machine), and the
ratio torchvision / vltrain is printed. Then, for blur and recipe: the largest difference between the two sides'
outputs in grey levels and the fraction of values that differ.

    .venv/bin/python benchmarks/colour.py [--size 224] [--images 20] [--rounds 5]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
import common  # noqa: E402


def views(n: int, size: int) -> list:
    """n uint8 (3, size, size) tv_tensors.Image views cut from photograph-like images."""
    import torch
    from torchvision import tv_tensors

    from loader import photo

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        a = np.asarray(photo(rng, size + 40, size + 30))[15:15 + size, 20:20 + size]
        out.append(tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))))
    return out


def sides(size: int) -> dict:
    """{op: (torchvision's callable, vltrain's callable)}, each called as fn(view, i) with the view's seed i."""
    import torch
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    from vltrain.data import colour

    kernel = 2 * max(1, round(0.05 * size)) + 1

    def seeded(tf):
        def fn(x, i):
            torch.manual_seed(i)
            return tf(x)
        return fn

    def recipe(jitter, blur):
        return v2.Compose([v2.RandomApply([jitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                           v2.RandomApply([blur(kernel, sigma=(0.1, 2.0))], p=0.5)])

    hues = np.random.default_rng(1).uniform(-0.1, 0.1, 10_000)
    return {"hue": (lambda x, i: F.adjust_hue(x, float(hues[i])),
                    lambda x, i: colour.adjust_hue_uint8(x.as_subclass(torch.Tensor), float(hues[i]))),
            "jitter": (seeded(v2.ColorJitter(0.4, 0.4, 0.4, 0.1)), seeded(colour.ColorJitter(0.4, 0.4, 0.4, 0.1))),
            "blur": (seeded(v2.GaussianBlur(kernel, sigma=(0.1, 2.0))),
                     seeded(colour.GaussianBlur(kernel, sigma=(0.1, 2.0)))),
            "recipe": (seeded(recipe(v2.ColorJitter, v2.GaussianBlur)),
                       seeded(recipe(colour.ColorJitter, colour.GaussianBlur)))}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a loader worker's (OpenCV's filter and colour conversions run on the calling thread)
    print(common.load_line("start"), flush=True)
    xs = views(args.images, args.size)
    rows = []
    for op, (ref, ours) in sides(args.size).items():
        cpu = common.cpu_ms_per_call({"torchvision": ref, "vltrain": ours}, xs, args.rounds)
        diffs = [(ours(x, i).int() - ref(x, i).int()).abs() for i, x in enumerate(xs)]
        row = {"op": op, "torchvision_ms": common.median(cpu["torchvision"]),
               "vltrain_ms": common.median(cpu["vltrain"]),
               "max_diff": max(int(d.max()) for d in diffs),
               "frac_diff": sum(int((d > 0).sum()) for d in diffs) / sum(d.numel() for d in diffs)}
        row["ratio"] = row["torchvision_ms"] / row["vltrain_ms"]
        rows.append(row)
    print(f"\n{args.images} views of {args.size} px, {args.rounds} rounds, CPU ms per call (median), one thread")
    print(f"{'op':<7} {'torchvision':>11} {'vltrain':>8} {'ratio':>7} | max diff, fraction differing")
    for r in rows:
        print(f"{r['op']:<7} {r['torchvision_ms']:>11.2f} {r['vltrain_ms']:>8.2f} {r['ratio']:>6.1f}x | "
              f"{r['max_diff']}, {r['frac_diff']:.2e}")
    print(common.load_line("end"))
    return rows


if __name__ == "__main__":
    main()

"""albef's RandAugment on one loader worker's thread: torchvision's v2.RandAugment against vltrain.data.randaug's
(the trainer's), each geometric op alone and RandAugment(2, 7) as train_transform applies it, in CPU ms per call;
and whether their outputs are equal.

The data: --images uint8 (3, S, S) views at --size px, each the centre of a photograph-like image
(benchmarks/loader.py's `photo`). Sides, each timed on every view:
- ShearX, ShearY, TranslateX, TranslateY, Rotate: the op at albef's magnitude (7 of 31 bins), the sign alternating
  from view to view, through each transform's `_apply_image_or_video_transform` (torchvision's op dispatch);
  vltrain's source maps are built before the timing (one per op and sign: what a loader worker pays once);
- randaugment: RandAugment(num_ops=2, magnitude=7) called on the view, the same seed per view on both sides.
Rounds alternate the order of the two sides; torch on one thread (a loader worker's); the median CPU ms per call
over --rounds rounds, and the ratio torchvision / vltrain. Then the first call of a geometric op at a new
(op, sign, size), the map built: its CPU ms against torchvision's. The last column: the fraction of bytes that
differ between the two sides' outputs (0 is byte for byte).

    .venv/bin/python benchmarks/randaug.py [--size 224] [--images 20] [--rounds 5]
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
import common  # noqa: E402
from colour import views  # noqa: E402

GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


def sides(size: int) -> dict:
    """{op: (torchvision's callable, vltrain's callable)}, each called as fn(view, i) with the view's index i."""
    import torch
    from torchvision.transforms import v2

    from vltrain.data.randaug import RandAugment

    ref, ours = v2.RandAugment(num_ops=2, magnitude=7), RandAugment(num_ops=2, magnitude=7)
    space = ref._AUGMENTATION_SPACE

    def op(tf, name):
        at7 = float(space[name][0](31, size, size)[7])

        def fn(x, i):
            return tf._apply_image_or_video_transform(x, name, at7 if i % 2 else -at7, "nearest", tf._fill)
        return fn

    def seeded(tf):
        def fn(x, i):
            torch.manual_seed(i)
            return tf(x)
        return fn

    out = {name: (op(ref, name), op(ours, name)) for name in GEOMETRIC}
    out["randaugment"] = (seeded(ref), seeded(ours))
    return out


def first_call(size: int, rounds: int) -> tuple[float, float]:
    """CPU ms (torchvision's, vltrain's) of a geometric op on a fresh transform, the source map built in the call:
    medians over the five ops, both signs, `rounds` times."""
    from torchvision.transforms import v2

    from vltrain.data.randaug import RandAugment

    x = views(1, size)[0]
    cpu = {"torchvision": [], "vltrain": []}
    for _ in range(rounds):
        for name in GEOMETRIC:
            for sign in (1, -1):
                for side, tf in (("torchvision", v2.RandAugment()), ("vltrain", RandAugment())):
                    m = sign * float(tf._AUGMENTATION_SPACE[name][0](31, size, size)[7])
                    t = time.process_time()
                    tf._apply_image_or_video_transform(x, name, m, "nearest", tf._fill)
                    cpu[side].append((time.process_time() - t) * 1e3)
    return common.median(cpu["torchvision"]), common.median(cpu["vltrain"])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a loader worker's
    print(common.load_line("start"), flush=True)
    xs = views(args.images, args.size)
    rows = []
    for op, (ref, ours) in sides(args.size).items():
        for i, x in enumerate(xs[:2]):
            ours(x, i)  # the maps, once (randaugment: whichever its first draws need; the rest fill in round 1)
        cpu = common.cpu_ms_per_call({"torchvision": ref, "vltrain": ours}, xs, args.rounds)
        differ = sum(int((ours(x, i) != ref(x, i)).sum()) for i, x in enumerate(xs))
        row = {"op": op, "torchvision_ms": common.median(cpu["torchvision"]),
               "vltrain_ms": common.median(cpu["vltrain"]), "frac_diff": differ / sum(x.numel() for x in xs)}
        row["ratio"] = row["torchvision_ms"] / row["vltrain_ms"]
        rows.append(row)
    tv_first, ours_first = first_call(args.size, args.rounds)
    print(f"\n{args.images} views of {args.size} px, {args.rounds} rounds, CPU ms per call (median), one thread")
    print(f"{'op':<11} {'torchvision':>11} {'vltrain':>8} {'ratio':>7} | fraction of bytes differing")
    for r in rows:
        print(f"{r['op']:<11} {r['torchvision_ms']:>11.2f} {r['vltrain_ms']:>8.2f} {r['ratio']:>6.1f}x | "
              f"{r['frac_diff']:.2e}")
    print(f"first call of a geometric op (the map built): torchvision {tv_first:.2f} ms, vltrain {ours_first:.2f} ms")
    print(common.load_line("end"))
    return rows


if __name__ == "__main__":
    main()

"""Benchmark `vlprep shards` against bare baselines measured in the same run (DESIGN.md section 9).

A: pass-through `build_shards` vs a plain `tarfile` copy of the same image + caption files.
B: `build_shards --resize 256` vs a bare PIL open / load / resize / save-to-memory loop (no tar).
Runs are interleaved (baseline, vlprep, baseline, ...) so drift hits both sides alike; medians decide.

    .venv/bin/python benchmarks/shards.py [--images 2000] [--repeats 5] [--workers 1] [--src DIR]
"""

import argparse
import io
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vlprep.shards import ShardsConfig, build_shards

DEFAULT_SRC = Path("/usr/share/openclipart/png")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
PER_SHARD = 1000
RESIZE = 256
TARGETS = {"A pass-through": 1.5, f"B resize {RESIZE}": 1.3}


# --- the input folder ---------------------------------------------------------------------------


def pick_images(src: Path, n: int) -> tuple[list[Path], int]:
    """First n images of src in sorted path order that PIL opens below its bomb limit -> (paths, excluded)."""
    picked, excluded = [], 0
    for p in sorted(q for q in src.rglob("*") if q.suffix.lower() in IMAGE_SUFFIXES and q.is_file()):
        try:
            with Image.open(p) as im:
                ok = im.size[0] * im.size[1] <= Image.MAX_IMAGE_PIXELS
        except Exception:
            ok = False
        # vlprep skips a bomb while the bare loops would crash or spend seconds on one 169-Mpixel file.
        excluded += not ok
        if ok:
            picked.append(p)
            if len(picked) == n:
                break
    return picked, excluded


def copy_images(paths: list[Path], n: int, dest: Path) -> None:
    """n images (cycling through paths if there are fewer) + same-named .txt captions into dest."""
    for i in range(n):
        p = paths[i % len(paths)]
        shutil.copyfile(p, dest / f"{i:06d}{p.suffix.lower()}")
        words = " ".join([p.parent.name, *p.stem.replace("-", "_").split("_")]).strip()
        (dest / f"{i:06d}.txt").write_text(f"a clipart of {words}\n", encoding="utf-8")


def synthesize_images(n: int, dest: Path, seed: int = 0) -> None:
    """n photo-like JPEGs (smooth colour fields plus grain) of varied sizes, some below RESIZE."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = (int(x) for x in rng.integers(160, 1280, size=2))
        coarse = Image.fromarray(rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
        arr = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 8, size=(h, w, 3)).astype(np.int16)
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(dest / f"{i:06d}.jpg", quality=90)
        (dest / f"{i:06d}.txt").write_text(f"a synthetic photo number {i}\n", encoding="utf-8")


def warm(folder: Path) -> int:
    """Read every file once so no run pays for cold page cache; returns total bytes."""
    return sum(len(p.read_bytes()) for p in sorted(folder.iterdir()))


# --- baselines and the candidate ----------------------------------------------------------------


def tar_copy(images: list[Path], out: Path) -> None:
    """Baseline A: image + caption files into plain tars of PER_SHARD samples, nothing else."""
    for s in range(0, len(images), PER_SHARD):
        with tarfile.open(out / f"plain-{s // PER_SHARD:06d}.tar", "w") as tf:
            for img in images[s: s + PER_SHARD]:
                for p in (img, img.with_suffix(".txt")):
                    data = p.read_bytes()
                    info = tarfile.TarInfo(p.name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def pil_resize(images: list[Path]) -> None:
    """Baseline B: decode, shrink the shorter side to RESIZE if larger, re-encode in memory, same format."""
    for p in images:
        with Image.open(p) as im:
            fmt = im.format
            im.load()
            w, h = im.size
            if min(w, h) > RESIZE:
                s = RESIZE / min(w, h)
                im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC,
                               reducing_gap=3.0)
            buf = io.BytesIO()
            im.save(buf, format=fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))


def vlprep(folder: Path, out: Path, resize: int | None, workers: int, expected: int) -> None:
    cfg = ShardsConfig(src=folder, out=out, samples_per_shard=PER_SHARD, resize=resize, workers=workers,
                       progress=False)
    report = build_shards(cfg, progress=None)
    # A skipped sample would make vlprep look faster than the baseline for the wrong reason.
    if report["written"] != expected:
        sys.exit(f"vlprep wrote {report['written']} of {expected} samples: {report['skipped']}")


# --- timing ---------------------------------------------------------------------------------------


def interleave(name: str, baseline, candidate, repeats: int, scratch: Path) -> dict:
    """Alternate baseline and candidate runs, each into a fresh output folder removed after timing."""
    times = {"baseline": [], "vlprep": []}
    for r in range(repeats):
        for side, fn in (("baseline", baseline), ("vlprep", candidate)):
            out = scratch / f"{side}-{r}"
            out.mkdir()
            t0 = time.perf_counter()
            fn(out)
            times[side].append(time.perf_counter() - t0)
            shutil.rmtree(out)
        print(f"  {name} repeat {r + 1}/{repeats}: baseline {times['baseline'][-1]:.3f} s, "
              f"vlprep {times['vlprep'][-1]:.3f} s", flush=True)
    base, cand = statistics.median(times["baseline"]), statistics.median(times["vlprep"])
    row = {"name": name, "base": base, "cand": cand, "ratio": cand / base, "target": TARGETS[name],
           "base_min": min(times["baseline"]), "cand_min": min(times["vlprep"])}
    print(f"  {name}: median baseline {base:.3f} s, vlprep {cand:.3f} s, ratio {row['ratio']:.2f}x "
          f"(target <= {row['target']}x); min baseline {row['base_min']:.3f} s, vlprep {row['cand_min']:.3f} s, "
          f"ratio of mins {row['cand_min'] / row['base_min']:.2f}x", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side (default 5)")
    ap.add_argument("--workers", type=int, default=1, help="vlprep --workers (the baselines use one process)")
    ap.add_argument("--src", type=Path, default=None,
                    help=f"image folder to copy from (default {DEFAULT_SRC}; synthetic JPEGs when it is missing)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="vlprep-bench-") as tmp:
        tmp = Path(tmp)
        folder, scratch = tmp / "src", tmp / "runs"
        folder.mkdir()
        scratch.mkdir()
        src = args.src or DEFAULT_SRC
        if src.is_dir():
            paths, excluded = pick_images(src, args.images)
            if not paths:
                sys.exit(f"no images under {src}")
            copy_images(paths, args.images, folder)
            what = (f"{len(paths)} distinct files from {src} (first in sorted order"
                    f"{f'; {excluded} over the PIL pixel limit left out' if excluded else ''})")
        else:
            if args.src:
                sys.exit(f"--src {src} is not a folder")
            synthesize_images(args.images, folder)
            what = f"synthetic JPEGs ({src} not found)"
        images = sorted(p for p in folder.iterdir() if p.suffix != ".txt")
        nbytes = warm(folder)
        big = sum(min(Image.open(p).size) > RESIZE for p in images)
        print(f"input: {len(images)} images + captions, {nbytes / 1e6:.1f} MB, {what}")
        print(f"       {big} of {len(images)} have a shorter side > {RESIZE} (re-encoded by B; the rest pass through vlprep)")
        print(f"vlprep workers={args.workers}, samples_per_shard={PER_SHARD}, repeats={args.repeats}, "
              f"python {sys.version.split()[0]}, Pillow {Image.__version__}\n", flush=True)

        n = len(images)
        rows = [
            interleave("A pass-through", lambda out: tar_copy(images, out),
                       lambda out: vlprep(folder, out / "ds", None, args.workers, n), args.repeats, scratch),
            interleave(f"B resize {RESIZE}", lambda out: pil_resize(images),
                       lambda out: vlprep(folder, out / "ds", RESIZE, args.workers, n), args.repeats, scratch),
        ]

    print(f"\n{'benchmark':<16} {'baseline med s':>14} {'vlprep med s':>12} {'ratio':>6} {'target':>7}  result")
    for r in rows:
        ok = "PASS" if r["ratio"] <= r["target"] else "FAIL"
        print(f"{r['name']:<16} {r['base']:>14.3f} {r['cand']:>12.3f} {r['ratio']:>5.2f}x {'<= ' + str(r['target']) + 'x':>7}  {ok}")


if __name__ == "__main__":
    main()

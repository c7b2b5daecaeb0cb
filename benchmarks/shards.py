"""Benchmark `vlprep shards` against bare baselines measured in the same run (DESIGN.md section 9).

A: pass-through `build_shards` vs a plain `tarfile` copy of the same image + caption files
   (A': the copy also writes the per-sample .json member that vlprep writes).
B: `build_shards --resize 256` vs a bare PIL open / load / resize / save-to-memory loop over every image, no tar
   (B': the loop only reads the images vlprep passes through, those with a shorter side <= 256).
Runs are interleaved (baseline, vlprep, baseline, ...) so drift hits both sides alike; medians decide.
Each timed run writes into a fresh empty folder, created before and removed after the clock.

What each side does, exactly:
- A baseline (`tar_copy`), as a user would write it: os.listdir the folder, sort the names, and for
  every 1000 images open a `tarfile.open(..., "w")` (tarfile's defaults) and, per image, read the image
  file and its .txt file and `addfile` each with a `TarInfo` that has only its name and size set.
  A' also json.dumps a two-key dict per sample and adds it as a third member. No checks of any kind.
- A vlprep (`build_shards(ShardsConfig(src, out, samples_per_shard=1000, workers=1))`):
  everything a user's run does, nothing skipped: detect the source type, walk the folder (sorted),
  claim the output folder (run marker, resume check), per planned shard a fingerprint (stat of every
  image) and a finished-shard check, per sample read the image and caption, clean and check the
  caption, open the image header with PIL (format, size) and check its end-of-image marker, build the
  .json metadata; write a ustar tar (mtime 0, 3 members per sample) and a Parquet sidecar under .tmp
  names and rename them; then sizes.json, index.json, meta.json and report.json.
- B baseline (`pil_resize`): per image PIL open, load, resize the shorter side to 256 (bicubic,
  reducing_gap 3) when larger, save to memory in the same format; no files written. vlprep: the
  same `build_shards` call with resize=256 (images already small enough pass through untouched).

    .venv/bin/python benchmarks/shards.py [--images 2000] [--repeats 5] [--workers 1] [--src DIR]
"""

import argparse
import io
import json
import os
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


def tar_copy(folder: Path, out: Path, with_json: bool = False) -> None:
    """Baseline A: list the folder, then image + caption files into plain tars of PER_SHARD samples."""
    # with_json (A') adds the per-sample .json member of docs/FORMAT.md: as many tar members as vlprep.
    names = sorted(n for n in os.listdir(folder) if not n.endswith(".txt"))
    for s in range(0, len(names), PER_SHARD):
        with tarfile.open(out / f"plain-{s // PER_SHARD:06d}.tar", "w") as tf:
            for name in names[s: s + PER_SHARD]:
                stem = name.rsplit(".", 1)[0]
                members = []
                if with_json:
                    members.append((stem + ".json", json.dumps({"uid": stem, "source": folder.name}).encode()))
                for member in (name, stem + ".txt"):
                    with open(folder / member, "rb") as f:
                        members.append((member, f.read()))
                for member, data in members:
                    info = tarfile.TarInfo(member)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def pil_resize(images: list[Path], every: bool = True) -> None:
    """Baseline B: decode, shrink the shorter side to RESIZE if larger, re-encode in memory, same format."""
    # every=False (B') only reads an image that needs no shrinking, as vlprep passes it through.
    for p in images:
        with Image.open(p) as im:
            fmt, (w, h) = im.format, im.size
            if not every and min(w, h) <= RESIZE:
                p.read_bytes()
                continue
            im.load()
            if min(w, h) > RESIZE:
                s = RESIZE / min(w, h)
                im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC,
                               reducing_gap=3.0)
            buf = io.BytesIO()
            im.save(buf, format=fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))


def vlprep(folder: Path, out: Path, resize: int | None, workers: int, expected: int) -> None:
    cfg = ShardsConfig(src=folder, out=out, samples_per_shard=PER_SHARD, resize=resize, workers=workers)
    report = build_shards(cfg, progress=None)
    # A skipped sample would make vlprep look faster than the baseline for the wrong reason.
    if report["written"] != expected:
        sys.exit(f"vlprep wrote {report['written']} of {expected} samples: {report['skipped']}")


# --- timing ---------------------------------------------------------------------------------------


def interleave(baselines: dict, candidate, repeats: int, scratch: Path) -> dict[str, list[float]]:
    """Alternate each baseline and the candidate, each run into a fresh output folder removed after timing."""
    sides = {**baselines, "vlprep": candidate}
    times = {side: [] for side in sides}
    for side, fn in sides.items():  # untimed: the first build_shards call pays ~0.4 s of lazy imports
        out = scratch / "warmup"
        out.mkdir()
        fn(out)
        shutil.rmtree(out)
    for r in range(repeats):
        for side, fn in sides.items():
            out = scratch / f"{side}-{r}".replace(" ", "_")
            out.mkdir()
            t0 = time.perf_counter()
            fn(out)
            times[side].append(time.perf_counter() - t0)
            shutil.rmtree(out)
        print(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
    return times


def row(name: str, base: list[float], cand: list[float], target: float) -> dict:
    r = {"name": name, "base": statistics.median(base), "cand": statistics.median(cand), "target": target,
         "base_min": min(base), "cand_min": min(cand)}
    r["ratio"] = r["cand"] / r["base"]
    print(f"  {name}: median baseline {r['base']:.3f} s, vlprep {r['cand']:.3f} s, ratio {r['ratio']:.2f}x "
          f"(target <= {target}x); min baseline {r['base_min']:.3f} s, vlprep {r['cand_min']:.3f} s, "
          f"ratio of mins {r['cand_min'] / r['base_min']:.2f}x", flush=True)
    return r


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
        big = 0
        for p in images:
            with Image.open(p) as im:
                big += min(im.size) > RESIZE
        print(f"input: {len(images)} images + captions, {nbytes / 1e6:.1f} MB, {what}")
        print(f"       {big} of {len(images)} have a shorter side > {RESIZE} (vlprep --resize re-encodes only those)")
        print(f"vlprep workers={args.workers}, samples_per_shard={PER_SHARD}, repeats={args.repeats}, "
              f"python {sys.version.split()[0]}, Pillow {Image.__version__}\n", flush=True)

        n = len(images)
        print("A: pass-through, baselines = plain tarfile copy of the image + .txt files "
              "(A': plus a .json member per sample, as vlprep writes)")
        t = interleave({"tar copy": lambda out: tar_copy(folder, out),
                        "tar copy + json": lambda out: tar_copy(folder, out, with_json=True)},
                       lambda out: vlprep(folder, out / "ds", None, args.workers, n), args.repeats, scratch)
        rows = [row("A pass-through", t["tar copy"], t["vlprep"], 1.5),
                row("A' pass-through", t["tar copy + json"], t["vlprep"], 1.5)]
        print(f"\nB: --resize {RESIZE}, baselines = bare PIL loops, no tar (B: re-encode every image; "
              f"B': only those vlprep re-encodes)")
        t = interleave({"PIL all": lambda out: pil_resize(images),
                        "PIL same work": lambda out: pil_resize(images, every=False)},
                       lambda out: vlprep(folder, out / "ds", RESIZE, args.workers, n), args.repeats, scratch)
        rows += [row(f"B resize {RESIZE}", t["PIL all"], t["vlprep"], 1.3),
                 row(f"B' resize {RESIZE}", t["PIL same work"], t["vlprep"], 1.3)]

    print(f"\n{'benchmark':<16} {'baseline med s':>14} {'vlprep med s':>12} {'ratio':>6} {'target':>7}  result")
    for r in rows:
        ok = "PASS" if r["ratio"] <= r["target"] else "FAIL"
        print(f"{r['name']:<16} {r['base']:>14.3f} {r['cand']:>12.3f} {r['ratio']:>5.2f}x "
              f"{'<= ' + str(r['target']) + 'x':>7}  {ok}")
    print("A' and B' are informational like-for-like ratios; A and B are the baselines of the brief.")
    print(f"A': the tar copy also writes the .json member every sample has (3 tar members, not 2). "
          f"B': the PIL loop only reads\nthe {n - big} images with a shorter side <= {RESIZE}, "
          "which vlprep passes through, instead of decoding and re-encoding them.")

if __name__ == "__main__":
    main()

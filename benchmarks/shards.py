"""Benchmark `vlprep shards` against plain baselines measured in the same run.

A, pass-through: `build_shards` vs the same reads and the same three members per sample written by a plain loop
   with the fastest writer we have (`ShardTarWriter`); target <= 1.5x. Informational: the old baseline (tarfile
   `addfile`, ~37 us per member more) and the limit (the same bytes with no per-sample Python work).
B, `--resize 256`: `build_shards --resize 256` vs the same plain loop that shrinks, with PIL, the images whose
   shorter side is > 256 and copies the others; target <= 1.3x. Informational: the old baseline (PIL decodes and
   re-encodes every image, writes nothing).

What each side does, exactly (each timed call writes into a fresh empty folder, made before and removed after
the clock; rounds alternate the order of the sides; medians of wall and CPU time decide):
- `plain` (A baseline, since 2026-11-25): the tars vlprep writes, byte for byte (checked before the clock), from
  plain code. os.listdir the folder, sort the non-.txt names, and for every 1000 of them open a file (1 MiB buffer)
  with a `ShardTarWriter`, and per image: read the image file and its .txt file (plain string paths); check the
  image as vlprep's default pass-through does (a PNG: every chunk's length up to IEND and every CRC but IDAT's, by
  a plain loop of its own; anything else: Pillow's header read and the end-of-image check) and take its width
  and height (a PNG's from IHDR); decode the caption as UTF-8 and collapse its whitespace; encode
  {"height", "source", "uid", "width"} with one `JSONEncoder(ensure_ascii=False, sort_keys=True)`; add the three
  members (json, image, txt) under vlprep's keys. No sidecar, no fingerprints, no resume, no index files, no
  report: those are vlprep's own extras. The check is in the baseline because it is part of the stage's contract
  (docs/FORMAT.md: a pass-through run skips a truncated or damaged image): without it a loop would keep samples
  that vlprep skips, so it would not do the same work.
- `fast writer` (A, informational; the baseline until 2026-11-25): the same loop without the check, the caption
  cleaning and the width and height: each txt file's bytes as read, json.dumps {"uid": stem, "source": folder
  name}, the image's own name, so it wrote other bytes than vlprep.
- `tarfile addfile` (A, informational; the former baseline): the same loop through
  `tarfile.open(..., "w")` (its defaults) and `addfile` with a TarInfo holding only the name and size.
- `limit` (A, informational): the same bytes as `fast writer` with no per-sample Python work beyond one
  open + read per file: member headers, json payloads and paddings are built before the clock; per shard the
  files are read in a list comprehension, slotted into the prepared list by slice assignment, and the shard is
  one `b"".join` and one write. The gap to it is what Python per sample costs.
- `vlprep` (A): `build_shards(ShardsConfig(src, out, samples_per_shard=1000, workers=W))`, everything a user's
  run does, nothing skipped: detect the source type, walk the folder (sorted), claim the output folder (lock,
  run marker, resume check), per planned shard a fingerprint (stat of every image) and a finished-shard check,
  per sample read the image and caption, clean and check the caption, check the image (format and size from its
  header, the end-of-image check: every PNG chunk's length up to IEND and every CRC but IDAT's, JPEG EOI, WebP RIFF
  length), build the .json metadata;
  write a ustar tar (3 members per sample) and the Parquet sidecar under .tmp names and rename them; then
  sizes.json, index.json, meta.json, report.json (with the duplicate-uid scan of the uids the shards wrote).
- `fast writer resize` (B baseline): `fast writer`, except that each image is opened with PIL first; one whose
  shorter side is > 256 is loaded, resized to 256 (bicubic, reducing_gap 3, JPEG draft mode as vlprep uses) and
  saved to memory in its format, the others are copied as read.
- `PIL all` (B, informational; the former baseline): per image PIL open, load, resize when larger,
  save to memory in the same format, for every image; no files written.
- `vlprep resize` (B): the `vlprep` call with resize=256.

    .venv/bin/python benchmarks/shards.py [--images 2000] [--repeats 5] [--workers 1] [--src DIR] [--isolate]
                                          [--skip a,b]
"""

import argparse
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from vlprep.tario import ShardTarWriter  # noqa: E402
from vlprep.imagecheck import PNG_MAGIC  # noqa: E402
from vlprep.shards import ShardsConfig, build_shards  # noqa: E402

DEFAULT_SRC = Path("/usr/share/openclipart/png")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
PER_SHARD = 1000
RESIZE = 256
TARGET_A = 1.5
TARGET_B = 1.3


# --- the input folder ---------------------------------------------------------------------------


def pick_images(src: Path, n: int) -> tuple[list[Path], int]:
    """First n images of src in sorted path order that PIL opens below its bomb limit -> (paths, excluded)."""
    picked = []
    excluded = 0
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


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def shrink(data: bytes) -> bytes:
    """B baseline: the image re-encoded with its shorter side at RESIZE when it is larger, else as it is."""
    im = Image.open(io.BytesIO(data))
    fmt, (w, h) = im.format, im.size
    if min(w, h) <= RESIZE:
        return data
    if fmt == "JPEG":
        im.draft("RGB", (max(1, w * RESIZE // min(w, h)), max(1, h * RESIZE // min(w, h))))
    im.load()
    w, h = im.size
    if min(w, h) > RESIZE:
        s = RESIZE / min(w, h)
        im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC, reducing_gap=3.0)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"quality": 95} if fmt in ("JPEG", "WEBP") else {}))
    return buf.getvalue()


_CHUNK = struct.Struct(">I4s")


def checked_size(data: bytes) -> tuple[str, int, int] | None:
    """(ext, width, height) of an image that passes vlprep's default pass-through check, else None.

    A PNG by a plain walk of its chunks: each length inside the file, each CRC but IDAT's, up to IEND; its size
    from IHDR. Other formats: Pillow's header read, then the end-of-image check (JPEG EOI, WebP RIFF length)."""
    if data.startswith(PNG_MAGIC):
        n = len(data)
        pos = 8
        view = memoryview(data)
        crc32 = zlib.crc32
        unpack = _CHUNK.unpack_from
        while pos + 12 <= n:
            length, cid = unpack(data, pos)
            end = pos + 12 + length
            if end > n or (cid != b"IDAT" and crc32(view[pos + 4:end - 4]) != int.from_bytes(data[end - 4:end])):
                return None
            if cid == b"IEND":
                return ("png", *struct.unpack_from(">II", data, 16))
            pos = end
        return None
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (w, h) = im.format, im.size
    except Exception:
        return None
    if fmt == "JPEG":
        return ("jpg", w, h) if data.rstrip(b"\0")[-2:] == b"\xff\xd9" else None
    if fmt == "WEBP":
        return ("webp", w, h) if int.from_bytes(data[4:8], "little") + 8 <= len(data) else None
    return None


def plain(folder: Path, out: Path) -> None:
    """A baseline: vlprep's tars from a plain loop (list, sort, read, check, clean, encode, write 3 members)."""
    base = str(folder) + "/"
    source = folder.name
    names = sorted(n for n in os.listdir(folder) if not n.endswith(".txt"))
    encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True).encode
    for s in range(0, len(names), PER_SHARD):
        with open(out / f"shard-{s // PER_SHARD:06d}.tar", "wb", buffering=1 << 20) as f, ShardTarWriter(f) as tw:
            for i, name in enumerate(names[s: s + PER_SHARD], s):
                stem = name.rsplit(".", 1)[0]
                image = _read(base + name)
                txt = _read(base + stem + ".txt")
                head = checked_size(image)
                caption = " ".join(txt.decode("utf-8").split())
                if head is None or not caption:
                    continue  # vlprep skips it (and counts it)
                key = f"shard_{i:09d}."
                tw.add(key + "json", encode({"height": head[2], "source": source, "uid": stem,
                                             "width": head[1]}).encode())
                tw.add(key + head[0], image)
                tw.add(key + "txt", caption.encode())


def check_plain(folder: Path, tmp: Path, workers: int) -> None:
    """Before the clock: the baseline's tars are vlprep's, byte for byte (else it would not do the same work)."""
    a = tmp / "check-plain"
    b = tmp / "check-vlprep"
    a.mkdir()
    plain(folder, a)
    build_shards(ShardsConfig(src=folder, out=b, samples_per_shard=PER_SHARD, workers=workers))
    for tar in sorted(b.glob("*.tar")):
        if (a / tar.name).read_bytes() != tar.read_bytes():
            sys.exit(f"the plain baseline wrote other bytes than vlprep for {tar.name}")
    shutil.rmtree(a)
    shutil.rmtree(b)


def fast_writer(folder: Path, out: Path, resize: bool = False) -> None:
    """A, informational (the baseline until 2026-11-25), and B with resize: list, sort, then per image read image +
    caption and write 3 members."""
    base = str(folder) + "/"
    source = folder.name
    names = sorted(n for n in os.listdir(folder) if not n.endswith(".txt"))
    for s in range(0, len(names), PER_SHARD):
        with open(out / f"plain-{s // PER_SHARD:06d}.tar", "wb", buffering=1 << 20) as f, ShardTarWriter(f) as tw:
            for name in names[s: s + PER_SHARD]:
                stem = name.rsplit(".", 1)[0]
                image = _read(base + name)
                txt = _read(base + stem + ".txt")
                if resize:
                    image = shrink(image)
                tw.add(stem + ".json", json.dumps({"uid": stem, "source": source}).encode())
                tw.add(name, image)
                tw.add(stem + ".txt", txt)


def tar_addfile(folder: Path, out: Path) -> None:
    """A, informational: the same loop through tarfile.addfile (tarfile's defaults)."""
    base = str(folder) + "/"
    source = folder.name
    names = sorted(n for n in os.listdir(folder) if not n.endswith(".txt"))
    for s in range(0, len(names), PER_SHARD):
        with tarfile.open(out / f"plain-{s // PER_SHARD:06d}.tar", "w") as tf:
            for name in names[s: s + PER_SHARD]:
                stem = name.rsplit(".", 1)[0]
                image = _read(base + name)
                txt = _read(base + stem + ".txt")
                meta = json.dumps({"uid": stem, "source": source}).encode()
                for member, data in ((stem + ".json", meta), (name, image), (stem + ".txt", txt)):
                    info = tarfile.TarInfo(member)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def limit_plan(folder: Path) -> list[tuple[str, list[str], list[str], list[bytes]]]:
    """Before the clock: per shard (name, image paths, caption paths, the member list with the files' slots empty)."""
    base = str(folder) + "/"
    source = folder.name
    names = sorted(n for n in os.listdir(folder) if not n.endswith(".txt"))
    tw = ShardTarWriter(None)
    plan = []
    for s in range(0, len(names), PER_SHARD):
        chunk = names[s: s + PER_SHARD]
        parts = []
        offset = 0
        for name in chunk:
            stem = name.rsplit(".", 1)[0]
            meta = json.dumps({"uid": stem, "source": source}).encode()
            for member, size, data in ((stem + ".json", len(meta), meta),
                                       (name, os.path.getsize(base + name), b""),
                                       (stem + ".txt", os.path.getsize(base + stem + ".txt"), b"")):
                parts += [tw.header(member, size), data, bytes(-size % 512)]
                offset += 512 + size + (-size % 512)
        parts.append(bytes(1024 + (-(offset + 1024) % tarfile.RECORDSIZE)))
        plan.append((f"plain-{s // PER_SHARD:06d}.tar", [base + n for n in chunk],
                     [base + n.rsplit(".", 1)[0] + ".txt" for n in chunk], parts))
    return plan


def limit(plan, out: Path) -> None:
    """A, informational: per shard read every file, one join, one write (9 parts per sample + the end)."""
    for shard, images, captions, parts in plan:
        parts = list(parts)
        parts[4:-1:9] = [_read(p) for p in images]
        parts[7:-1:9] = [_read(p) for p in captions]
        with open(out / shard, "wb") as f:
            f.write(b"".join(parts))


def pil_all(images: list[str]) -> None:
    """B, informational: decode, shrink the shorter side to RESIZE if larger, re-encode in memory, every image."""
    for p in images:
        with Image.open(p) as im:
            fmt, (w, h) = im.format, im.size
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


def make_sides(folder: Path, workers: int) -> dict[str, dict[str, common.Side]]:
    """Both parts' sides over the input folder (only reads it; set-up work here is not timed)."""
    images = sorted(str(p) for p in folder.iterdir() if p.suffix != ".txt")
    n = len(images)
    plan = limit_plan(folder)
    return {
        "a": {"plain": lambda out: plain(folder, out),
              "vlprep": lambda out: vlprep(folder, out / "ds", None, workers, n),
              "fast writer": lambda out: fast_writer(folder, out),
              "tarfile addfile": lambda out: tar_addfile(folder, out),
              "limit": lambda out: limit(plan, out)},
        "b": {"fast writer resize": lambda out: fast_writer(folder, out, resize=True),
              "vlprep resize": lambda out: vlprep(folder, out / "ds", RESIZE, workers, n),
              "PIL all": lambda out: pil_all(images)},
    }


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000, help="number of images (default 2000)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side (default 5)")
    ap.add_argument("--workers", type=int, default=1, help="vlprep --workers (the baselines use one process)")
    ap.add_argument("--src", type=Path, default=None,
                    help=f"image folder to copy from (default {DEFAULT_SRC}; synthetic JPEGs when it is missing)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a, b")
    common.add_options(ap)
    args = ap.parse_args()
    if args.side is not None:  # a child of --isolate: the set-up folder exists, time one call
        sides = make_sides(args.side_dir / "src", args.workers)
        common.run_child(args, {k: v for part in sides.values() for k, v in part.items()})
    skip = {s.strip().lower() for s in args.skip.split(",") if s.strip()}

    print(common.load_line("start"), flush=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vlprep-bench-") as tmp:
        tmp = Path(tmp)
        folder = tmp / "src"
        folder.mkdir()
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
              f"{'isolated (a fresh process per timed call)' if args.isolate else 'in one process'}, "
              f"python {sys.version.split()[0]}, Pillow {Image.__version__}\n", flush=True)
        sides = make_sides(folder, args.workers)
        rows = []
        if "a" not in skip:
            print("A: pass-through; baseline = the same reads, checks and members (vlprep's bytes) through "
                  "ShardTarWriter")
            check_plain(folder, tmp, args.workers)
            t = common.time_sides(sides["a"], args.repeats, tmp, args.isolate, label="A ")
            rows += [common.ratio_row("A pass-through", t["plain"], t["vlprep"], TARGET_A),
                     common.ratio_row("A vs fast writer", t["fast writer"], t["vlprep"], None,
                                      note="baseline until 2026-11-25: no check, other bytes"),
                     common.ratio_row("A plain vs fast writer", t["fast writer"], t["plain"], None,
                                      note="what the check and vlprep's bytes cost"),
                     common.ratio_row("A vs tarfile addfile", t["tarfile addfile"], t["vlprep"], None,
                                      note="old baseline"),
                     common.ratio_row("A vs limit", t["limit"], t["vlprep"], None, note="no per-sample Python"),
                     common.ratio_row("A fast writer vs limit", t["limit"], t["fast writer"], None,
                                      note="the baseline's own gap")]
            print()
        if "b" not in skip:
            print(f"B: --resize {RESIZE}; baseline = the same loop shrinking with PIL only images larger than {RESIZE}")
            t = common.time_sides(sides["b"], args.repeats, tmp, args.isolate, label="B ")
            rows += [common.ratio_row(f"B resize {RESIZE}", t["fast writer resize"], t["vlprep resize"], TARGET_B),
                     common.ratio_row("B vs PIL all", t["PIL all"], t["vlprep resize"], None,
                                      note="old baseline: re-encodes all, no tar")]
            print()
    common.print_table(rows, candidate="vlprep")
    print(f"(total {time.perf_counter() - t_start:.0f} s)")
    print(common.load_line("end"))


if __name__ == "__main__":
    main()

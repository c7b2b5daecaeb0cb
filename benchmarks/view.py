"""View: `vlprep view` of a synthetic 10K / 100K / 1M-sample dataset, timed as a user runs it, against plain code
doing the same work, with PASS/FAIL for "1M under 10 s" and for the ratio.

The data (seeded, made once per N under --data-dir and kept; a dataset whose sizes.json counts N samples is reused):
a Parquet source of N (image, caption) rows, cut by `vlprep shards -n 1000 --workers 2` into shards of 1,000
samples (1,000 shards at 1M); the source is deleted once the shards are written. Images: a pool of 1,000 distinct
32-64 px JPEG and PNG images of about 1 KB (random colour blocks), sample i taking image i mod 1,000; captions: 8-20
words, Zipf-distributed over a 20,000-word made-up vocabulary. (The pool is scale.py's `image_pool`; the captions
are drawn a row group at a time, without scale.py's nouns.)

Every side is a fresh Python process started by this script, timed from outside (wall seconds from start to exit,
Python start-up and imports included; CPU seconds and peak RSS from os.wait4's rusage), each with a new OUT folder:
- view: `python -m vlprep.cli view DS --out OUT --samples S --seed SEED`, the command a user runs: it opens DS
  (sizes.json, a stat of every shard), draws S samples (stratified over the shards, seeded), scans each drawn shard's
  member headers up to its last drawn sample (checksums and member names checked) and reads the drawn samples' txt,
  json and image members, writes a JPEG thumbnail of each (longer side 256 px at most, quality 85, named by a blake2b
  hash of the key), reads meta.json, report.json and the lineage, copies the dataset's PNG figures (these datasets
  have none), and writes OUT/index.html (the page template, its CSS and JS, and every record as JSON).
- headers and tarfile, the two baselines: this script with a hidden option (imports: the standard library, numpy,
  PIL). Each reads sizes.json, computes the same draw (vlprep.view's `allocate` and `draw`, which docs/API.md does not
  list, copied below with the same numpy generator calls), reads each drawn shard's members up to its last drawn
  sample and the drawn samples' txt, json and image members, writes the same thumbnails (same size, format, quality,
  names and RGB conversion: byte-identical files, checked), reads meta.json and report.json, copies the same PNG
  figures, and writes OUT/records.json (the same records: key, shard, position, thumbnail, captions, the sample's
  json; with meta.json and report.json) and a minimal OUT/index.html (one <img> and the html.escape'd key and
  caption per sample). No page template, no lineage chain, no CSS or JS, no checks of the members' names.
  `headers` walks the tar itself: a 512-byte header read, its name and size parsed, a seek past the data (no
  checksum check), the fastest plain reader here and the verdict's baseline; `tarfile` iterates `tarfile.open(path)`
  and reads members with `extractfile` (the standard library's way; its ratio is shown for information).
Every round, the keys in the view's page are compared with each baseline's records.json, and the thumbnails byte for
byte.

Rounds alternate the order (view, headers, tarfile; then reversed; ...) after one untimed round of every side (so
all find the shards' headers in the page cache; that round's times are printed as "1st run"). The machine is shared
with other jobs (training runs): quote the load average printed at the start and the end; CPU seconds are the
steadier figure when the load is above the 2 cores.

    .venv/bin/python benchmarks/view.py [--sizes 10k,100k,1m] [--repeats 3] [--samples 200] [--seed 0]
                                        [--data-dir DIR] [--json FILE]
"""

import argparse
import hashlib
import html
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 20_000
SECONDS_TARGET = 10.0  # the view of a 1M-sample dataset, wall seconds
RATIO_TARGET = 1.5  # view / baseline, median wall seconds
TARGET_N = 1_000_000
THUMB = 256  # vlprep view's thumbnail: longer side in pixels, JPEG quality 85
QUALITY = 85
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # the member extensions the view reads as images, besides txt and json
DATA_RE = ('<script type="application/json" id="vlprep-data">', "</script>")


def parse_size(s: str) -> int:
    s = s.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "km" else s) * scale)


def size_name(n: int) -> str:
    return f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


# --- the data ---------------------------------------------------------------------------------------------------


def make_source(n: int, path: Path, group: int, seed: int = 0) -> None:
    """A Parquet file of n (image, caption) rows in row groups of `group`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scale import image_pool  # the sibling script's pool (imported here: numpy only, for the data)

    rng = np.random.default_rng(seed)
    pool = image_pool(rng)
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "be", "do", "fa", "gu", "pe", "so"]
    words = np.array(["".join(rng.choice(syll, size=int(rng.integers(2, 4)))) + str(i % 7) for i in range(VOCAB)])
    schema = pa.schema([("image", pa.binary()), ("caption", pa.string())])
    with pq.ParquetWriter(path, schema) as table:
        for start in range(0, n, group):
            m = min(group, n - start)
            lengths = rng.integers(8, 21, size=m)
            toks = words[np.minimum(rng.zipf(1.2, size=int(lengths.sum())), VOCAB) - 1]
            caps = ["a " + " ".join(t) for t in np.split(toks, np.cumsum(lengths)[:-1])]
            images = [pool[i % len(pool)] for i in range(start, start + m)]
            table.write_table(pa.table({"image": images, "caption": caps}, schema=schema), row_group_size=group)


def dataset(n: int, data_dir: Path, group: int) -> Path:
    """The finished n-sample dataset under data_dir, made once (kept while its sizes.json counts n samples)."""
    folder = data_dir / f"{size_name(n)}-{group}"
    ds = folder / "ds"
    sizes = ds / "sizes.json"
    if sizes.exists() and sum(json.loads(sizes.read_text()).values()) == n:
        return ds
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # the source is made in a child process too: this process stays small (see run_side)
    source = [sys.executable, str(Path(__file__).resolve()), "--make-source", str(n), str(folder / "source.parquet"),
              "--shard-size", str(group)]
    shards = [sys.executable, "-m", "vlprep.cli", "shards", str(folder / "source.parquet"), str(ds), "-n", str(group),
              "--workers", "2"]
    for cmd in (source, shards):
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode != 0:
            raise SystemExit(f"error: {cmd[1]} {cmd[2]} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    (folder / "source.parquet").unlink()
    return ds


# --- the baseline (run in its own process) ----------------------------------------------------------------------
# The draw is copied from vlprep.view rather than imported: importing vlprep would charge the baseline vlprep's own
# start-up (typer, rich, pyarrow), the very cost the comparison measures. The run checks both draw the same keys.


def allocate(sizes: list[int], n: int, rng) -> list[int]:
    """vlprep.view's allocation: n split over the shards by largest remainder, ties broken by rng (copied)."""
    total = sum(sizes)
    if n >= total:
        return list(sizes)
    base = [n * s // total for s in sizes]
    rest = [n * s % total for s in sizes]
    tie = rng.permutation(len(sizes))
    order = sorted(range(len(sizes)), key=lambda i: (-rest[i], tie[i]))
    for i in order[: n - sum(base)]:
        base[i] += 1
    return base


def draw(sizes: dict[str, int], n: int, seed: int) -> dict[str, list[int]]:
    """vlprep.view's draw: {shard: sorted positions}, the same numpy generator calls in the same order (copied)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = allocate(list(sizes.values()), n, rng)
    picks = {}
    for shard, k in zip(sizes, counts):
        if k:
            picks[shard] = sorted(int(i) for i in rng.choice(sizes[shard], size=k, replace=False))
    return picks


def thumbnail(data: bytes, path: Path) -> dict | None:
    """The view's thumbnail: longer side at most THUMB, transparency on white, JPEG at QUALITY; None if undecodable."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.thumbnail((THUMB, THUMB))
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                rgb = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                rgb = im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    rgb.save(path, format="JPEG", quality=QUALITY)
    return {"src": f"thumbs/{path.name}", "w": rgb.size[0], "h": rgb.size[1]}


def tarfile_members(path: Path):
    """(name, read) of each member of a tar, read with `tarfile` (read() gives the member's bytes)."""
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            yield m.name, lambda m=m: tar.extractfile(m).read()


def header_members(path: Path):
    """(name, read) of each regular member of a ustar tar, by a walk over its 512-byte headers: a header read, its
    name and size parsed, a seek past the data (4 KiB buffer, as the view's local reads)."""
    with open(path, "rb", buffering=4096) as f:
        pos = 0
        while True:
            f.seek(pos)
            hdr = f.read(512)
            if len(hdr) < 512 or hdr == bytes(512):
                return
            size = int(hdr[124:136].rstrip(b"\0 ") or b"0", 8)
            data = pos + 512
            pos = data + (size + 511) // 512 * 512
            if hdr[156:157] not in (b"0", b"\0"):
                continue  # not a regular file (a directory, a pax header)
            name = hdr[:100].split(b"\0", 1)[0]
            prefix = hdr[345:500].split(b"\0", 1)[0]
            yield (prefix + b"/" + name if prefix else name).decode(), lambda at=data, n=size: read_at(f, at, n)


def read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


READERS = {"tarfile": tarfile_members, "headers": header_members}


def read_shard(members, positions: list[int]):
    """(position, key, {ext: bytes}) of the drawn samples among a tar's members, iterated up to the last drawn one."""
    want = set(positions)
    index = -1
    key = None
    got: dict = {}
    for name, read in members:
        stem, _, ext = name.rpartition("/")[2].partition(".")
        if stem != key:
            if index in want:
                yield index, key, got
            index += 1
            key = stem
            got = {}
            if index > positions[-1]:
                members.close()
                return
        if index in want and ext in ("txt", "json", *IMAGE_EXTS):
            got[ext] = read()
    if index in want:
        yield index, key, got


def baseline(ds: Path, out: Path, samples: int, seed: int, reader: str) -> None:
    """A baseline side: the same draw, reads, thumbnails, records, small files and figures as the view; the tars
    read through READERS[reader]."""
    sizes = json.loads((ds / "sizes.json").read_text())
    (out / "thumbs").mkdir(parents=True)
    records = []
    for shard, positions in draw(sizes, samples, seed).items():
        for index, key, members in read_shard(READERS[reader](ds / shard), positions):
            image = next((members[e] for e in IMAGE_EXTS if e in members), None)
            name = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest() + ".jpg"
            thumb = thumbnail(image, out / "thumbs" / name) if image is not None else None
            meta = json.loads(members["json"]) if "json" in members else {}
            captions = meta.get("captions") or [members.get("txt", b"").decode("utf-8", "replace")]
            records.append({"key": key, "shard": shard, "index": index, "thumb": thumb, "captions": captions,
                            "json": meta})
    small = {name: json.loads((ds / name).read_text()) for name in ("meta.json", "report.json") if (ds / name).exists()}
    (out / "figures").mkdir()
    for fig in sorted(ds.glob("*.png")) + [ds / "stats" / "stats.png"]:
        if fig.is_file():
            shutil.copyfile(fig, out / "figures" / fig.name)
    (out / "records.json").write_text(json.dumps({"info": small, "samples": records}))
    cards = "".join(f'<div><img src="{r["thumb"]["src"] if r["thumb"] else ""}"><b>{html.escape(r["key"])}</b> '
                    f'{html.escape(r["captions"][0] if r["captions"] else "")}</div>\n' for r in records)
    (out / "index.html").write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(str(ds))}</title>\n"
                                    f"{cards}", encoding="utf-8")


# --- timing -----------------------------------------------------------------------------------------------------


def run_side(cmd: list[str]) -> dict:
    """Run cmd in a fresh process: wall and CPU seconds, peak RSS in bytes (os.wait4's ru_maxrss).

    Linux counts into a child's ru_maxrss the resident set of the parent it was forked from, so this process's own
    peak is a floor under the sides' figures: it imports the standard library alone (no numpy, no pyarrow), and
    `own_peak` is printed for comparison."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... exited {proc.returncode}:\n{err[-3000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024}


def own_peak() -> int:
    """This process's peak RSS in bytes since its exec (VmHWM; its ru_maxrss would count its own parent's too)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def page_keys(out: Path) -> list[str]:
    """The keys of the samples in a view's index.html, from its JSON block."""
    text = (out / "index.html").read_text(encoding="utf-8")
    block = text.split(DATA_RE[0], 1)[1].split(DATA_RE[1], 1)[0]
    return [s["key"] for s in json.loads(block)["samples"]]


def thumbs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "thumbs").iterdir())}


SIDES = ("view", "headers", "tarfile")
BASELINES = ("headers", "tarfile")


def commands(ds: Path, out: Path, args) -> dict[str, list[str]]:
    opts = ["--samples", str(args.samples), "--seed", str(args.seed)]
    me = [sys.executable, str(Path(__file__).resolve()), "--baseline-run", str(ds), str(out), *opts]
    return {"view": [sys.executable, "-m", "vlprep.cli", "view", str(ds), "--out", str(out), *opts],
            **{b: [*me, "--reader", b] for b in BASELINES}}


def time_size(ds: Path, scratch: Path, args) -> dict:
    """Every side at one size: the untimed first round, then `repeats` alternating rounds, each output checked."""
    got = {n: {"wall": [], "cpu": [], "rss": []} for n in SIDES}
    first = {}
    same_keys = True
    same_thumbs = True
    for r in range(-1, args.repeats):
        outs = {}
        for n in (SIDES if r % 2 == 0 else SIDES[::-1]):
            outs[n] = scratch / f"{n}-{r + 1}"
            shutil.rmtree(outs[n], ignore_errors=True)
            m = run_side(commands(ds, outs[n], args)[n])
            if r < 0:
                first[n] = m
            else:
                for k, v in m.items():
                    got[n][k].append(v)
        keys = page_keys(outs["view"])
        view_thumbs = thumbs(outs["view"])
        same_keys &= len(keys) == min(args.samples, args.n)
        for b in BASELINES:
            same_keys &= keys == [s["key"] for s in json.loads((outs[b] / "records.json").read_text())["samples"]]
            same_thumbs &= view_thumbs == thumbs(outs[b])
        for out in outs.values():
            shutil.rmtree(out)
        label = "first run (untimed)" if r < 0 else f"round {r + 1}/{args.repeats}"
        m = first if r < 0 else {n: {k: v[-1] for k, v in got[n].items()} for n in SIDES}
        print(f"  {label}: " + ", ".join(f"{n} {m[n]['wall']:.3f} s ({m[n]['rss'] / 2**20:.0f} MB)" for n in SIDES),
              flush=True)
    return {**got, "first": first, "same_keys": same_keys, "same_thumbs": same_thumbs, "drawn": len(keys)}


def rows_for(results: dict[int, dict]) -> list[dict]:
    """Per size the verdict against the header walk (the faster plain reader), tarfile's ratio for information,
    and at 1M the view's median wall seconds against SECONDS_TARGET."""
    rows = []
    for n, r in results.items():
        note = "" if r["same_keys"] and r["same_thumbs"] else "OUTPUTS DIFFER"
        rows.append(common.ratio_row(f"view / headers {size_name(n)}", r["headers"], r["view"], RATIO_TARGET,
                                     note=note))
        rows.append(common.ratio_row(f"view / tarfile {size_name(n)}", r["tarfile"], r["view"], None, note=note))
        if n == TARGET_N:
            rows.append(common.value_row(f"view {size_name(n)} wall", common.median(r["view"]["wall"]),
                                         SECONDS_TARGET, "s, median", higher_is_better=False))
    return rows


def print_sizes(results: dict[int, dict]) -> None:
    """Per size: each side's median wall and CPU seconds and peak RSS, its first (untimed) run, the output checks."""
    print(f"\n{'N':>6} {'shards':>6} {'side':>8} {'wall s':>8} {'cpu s':>8} {'peak MB':>8} {'1st run s':>9}  "
          "same keys, thumbs")
    for n, r in results.items():
        for side in SIDES:
            med = {k: common.median(r[side][k]) for k in ("wall", "cpu", "rss")}
            print(f"{size_name(n):>6} {r['shards']:>6} {side:>8} {med['wall']:>8.3f} {med['cpu']:>8.3f} "
                  f"{med['rss'] / 2**20:>8.0f} {r['first'][side]['wall']:>9.3f}"
                  + (f"  {r['same_keys']}, {r['same_thumbs']}" if side == "view" else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10k,100k,1m", help="comma-separated N (10k, 100k, 1m, ...)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per size (medians are reported)")
    ap.add_argument("--samples", type=int, default=200, help="the view's --samples")
    ap.add_argument("--seed", type=int, default=0, help="the view's --seed")
    ap.add_argument("--shard-size", type=int, default=1000, help="samples per shard of the synthetic datasets")
    ap.add_argument("--data-dir", type=Path, default=Path("/tmp/vlprep-view-bench"),
                    help="where the datasets are made (kept and reused) and the outputs written")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    ap.add_argument("--baseline-run", nargs=2, type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--make-source", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reader", choices=BASELINES, default="headers", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_run:
        baseline(*args.baseline_run, args.samples, args.seed, args.reader)
        return
    if args.make_source:
        make_source(int(args.make_source[0]), Path(args.make_source[1]), args.shard_size)
        return
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    load_start = common.load_line("start")
    print(load_start)
    results: dict[int, dict] = {}
    for n in sizes:
        t0 = time.perf_counter()
        ds = dataset(n, args.data_dir, args.shard_size)
        shards = len(json.loads((ds / "sizes.json").read_text()))
        print(f"\n== N = {n:,} in {shards:,} shards (data ready in {time.perf_counter() - t0:.0f} s)", flush=True)
        args.n = n
        scratch = args.data_dir / "out"
        scratch.mkdir(parents=True, exist_ok=True)
        results[n] = {**time_size(ds, scratch, args), "shards": shards}
    print_sizes(results)
    own = own_peak()
    print(f"this script's own peak RSS {own / 2**20:.0f} MB: a floor under the sides' peaks (see run_side)")
    rows = rows_for(results)
    common.print_table(rows, candidate="view")
    load_end = common.load_line("end")
    print(load_end)
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "samples": args.samples, "seed": args.seed,
                                         "repeats": args.repeats, "shard_size": args.shard_size,
                                         "load": [load_start, load_end], "own_peak": own,
                                         "results": {str(n): r for n, r in results.items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Benchmark `vlprep bow` against baselines measured in the same run (DESIGN.md section 9).

A: `deform` alone (default cascade) over synthetic captions in one process: captions/s, and the
   time ratio against the bare tokenizer `vlprep.text.tokenize` on the same captions.
B: `bow(BowConfig(src, out, workers=1))` on image shards vs a plain `tarfile` read-and-rewrite of
   the same tars, interleaved (baseline, workers=1, workers=2, baseline, ...); medians decide.
   Each timed run writes into a fresh empty folder, created before and removed after the clock.
   - baseline (`tar_rewrite`), as a user would write it: for each input tar (sorted), open it with
     `tarfile.open(path, "r:")` and a new tar with `tarfile.open(path, "w")` (tarfile's defaults), and
     for every member `extractfile(m).read()` then `addfile(m, BytesIO(data))`: all 3 members of all
     samples copied as they are, nothing parsed, no sidecar, no report.
   - vlprep: the whole stage with the default ops (shuffle,rmstop,basevocab,rmtop:1000,keep:4), base
     fraction 0.1: read every Parquet sidecar for the base statistics, hash the sidecars for the resume
     fingerprints, claim the output folder; per shard read the sidecar and every tar member (with the
     member-name safety checks), decode txt + json, deform the non-base captions, drop empty ones,
     re-encode json, write the kept samples as a ustar tar plus the edited Parquet sidecar under .tmp
     names and rename them; then sizes.json / index.json / meta.json, the 'after' statistics from the
     new sidecars, bow_report.png (matplotlib, Agg) and report.json.
C: peak RSS of `bow` on a dataset of --mem-captions samples (tiny shared PNG), each run in a fresh
   subprocess so nothing else is counted; a tenth of the dataset is run too, to show the growth.

    .venv/bin/python benchmarks/bow.py [--quick] [--captions 1000000] [--shards 20] [--per-shard 500]
                                       [--repeats 3] [--mem-captions 3000000] [--skip a,b,c] [--src DIR]
"""

import argparse
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from vlprep.bow import DEFAULT_OPS, BowConfig, BowContext, bow, deform, parse_ops, SampleRng
from vlprep.dataset import sidecar_name
from vlprep.text import stop_words, tokenize

DEFAULT_SRC = Path("/usr/share/openclipart/png")
VOCAB = 20_000
ZIPF_S = 1.0          # rank-frequency exponent of the synthetic captions
HEAD_STOP = ["a", "the", "of", "in", "and", "with", "on", "an", "at", "is", "for", "to", "are", "his", "her",
             "from", "by", "up", "while", "it", "this", "some", "their", "has", "its", "over", "into", "out"]
PUNCT = [",", ".", "-", "'", "(", ")", "!", "?", ":", ";", "&", "/"]
TARGET_RATE = 100_000  # A: deform captions/s, at least
TARGET_RATIO = 1.3     # B: bow / tar rewrite, at most
TARGET_RSS = 1 << 30   # C: peak RSS, at most
MEM_PER_SHARD = 1000   # C: samples per shard (vlprep shards' default)
ROUGH_SAMPLE_BYTES = 3 * 1024  # C: 3 tar members of one 512-byte block + header each


# --- synthetic captions ---------------------------------------------------------------------------


def make_vocab(size: int = VOCAB, seed: int = 0) -> list[str]:
    """`size` tokens in frequency-rank order: NLTK stop words near the top, punctuation and numbers spread in."""
    rng = np.random.default_rng(seed)
    special = set(stop_words()) | set(PUNCT)
    numbers = sorted({str(n) for n in rng.integers(0, 2030, 120)} | {str(n) for n in range(13)})
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    syll = [c + v for c in cons for v in vows] + [c + v + "n" for c in cons for v in vows]
    content, seen = [], special | set(numbers)
    n_content = size - len(seen)
    while len(content) < n_content:
        w = "".join(syll[i] for i in rng.integers(0, len(syll), int(rng.integers(1, 4))))
        if w not in seen:
            seen.add(w)
            content.append(w)
    # Where each non-content token sits in the ranking, roughly as in English captions: the commonest
    # stop words lead ("a", "the", "of"), the others fill the first few hundred ranks, numbers the body.
    head = [w for w in HEAD_STOP if w in special]
    placed = [(1.2 * i, w) for i, w in enumerate(head)] + [(3.5, ","), (9.5, ".")]
    placed += [(float(rng.uniform(40, 800)), w) for w in sorted(stop_words() - set(head))]
    placed += [(float(rng.exponential(300)), p) for p in PUNCT if p not in (",", ".")]
    placed += [(float(rng.uniform(30, 5000)), n) for n in numbers]
    ranked = list(content)
    for pos, w in sorted(placed, reverse=True):
        ranked.insert(min(int(pos), len(ranked)), w)
    return ranked[:size]


class CaptionMaker:
    """8-15 tokens per caption drawn Zipf-like from the vocabulary; punctuation glued to the previous word."""

    def __init__(self, vocab: list[str], s: float = ZIPF_S):
        p = 1.0 / np.arange(1, len(vocab) + 1) ** s
        self.cdf = np.cumsum(p / p.sum())
        self.cdf[-1] = 1.0
        self.shown = np.array([("\0" + w) if w in PUNCT else w for w in vocab], dtype=object)

    def __call__(self, n: int, rng: np.random.Generator) -> list[str]:
        lengths = rng.integers(8, 16, n)
        ranks = np.searchsorted(self.cdf, rng.random(int(lengths.sum())), side="right")
        toks = self.shown[ranks]
        out, at = [], 0
        for k in lengths.tolist():
            c = " ".join(toks[at: at + k]).replace(" \0", "").lstrip("\0")
            out.append(c[:1].upper() + c[1:])
            at += k
        return out


def key_of(i: int) -> str:
    return f"shard_{i:09d}"  # what `vlprep shards` names sample i


def synthetic_context(vocab: list[str], seed: int = 0) -> BowContext:
    """Base vocabulary of 60% of the tokens (the 2,000 most frequent plus a random share of the rest), top-1000."""
    rng = np.random.default_rng(seed + 1)
    head, tail = vocab[:2000], vocab[2000:]
    want = int(0.6 * len(vocab)) - len(head)
    picked = rng.choice(len(tail), size=max(0, want), replace=False)
    return BowContext(base_vocab=frozenset(head + [tail[i] for i in picked]), top=frozenset(vocab[:1000]))


# --- A: the deformation function alone --------------------------------------------------------------


def bench_deform(n: int, chunk: int) -> dict:
    vocab = make_vocab()
    ctx = synthetic_context(vocab)
    cascade = parse_ops(DEFAULT_OPS)
    t0 = time.perf_counter()
    captions = CaptionMaker(vocab)(n, np.random.default_rng(0))
    keys = [key_of(i) for i in range(n)]
    toks = [len(tokenize(c)) for c in captions[:100_000]]
    print(f"  {n:,} captions made in {time.perf_counter() - t0:.1f} s (not timed); e.g. {captions[0]!r} / "
          f"{captions[1]!r}")
    print(f"  tokens per caption: mean {statistics.mean(toks):.1f}, min {min(toks)}, max {max(toks)}; "
          f"base vocab {len(ctx.base_vocab):,} of {len(vocab):,} tokens, top set {len(ctx.top):,}")
    seed = 0
    t_tok, t_def = [], []
    for lo in range(0, n, chunk):
        cs, ks = captions[lo: lo + chunk], keys[lo: lo + chunk]
        t0 = time.perf_counter()
        for c in cs:
            tokenize(c)
        t1 = time.perf_counter()
        for c, k in zip(cs, ks):
            deform(c, cascade, ctx, SampleRng(seed, k))
        t2 = time.perf_counter()
        t_tok.append((t1 - t0) / len(cs))
        t_def.append((t2 - t1) / len(cs))
    sample = captions[:chunk]
    empty = sum(not deform(c, cascade, ctx, SampleRng(seed, k)) for c, k in zip(sample, keys))
    print(f"  {len(t_def)} chunks of {chunk:,}: deform {', '.join(f'{1 / t:,.0f}' for t in t_def)} captions/s")
    print(f"  e.g. {sample[0]!r} -> {deform(sample[0], cascade, ctx, SampleRng(seed, keys[0]))!r}; "
          f"{100 * empty / len(sample):.1f}% come out empty")

    # Where the time goes: the cascade cut after each step (informational).
    prefix, last = [], statistics.median(t_tok)
    parts = [f"tokenize {1e6 * last:.2f}"]
    for step in cascade:
        prefix.append(step)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            for c, k in zip(sample, keys):
                deform(c, prefix, ctx, SampleRng(seed, k))
            ts.append((time.perf_counter() - t0) / len(sample))
        cur = min(ts)
        parts.append(f"+{step.label} {1e6 * (cur - last):.2f}")
        last = cur
    print(f"  per caption, us (cumulative cascade, incl. sample_rng and join): {', '.join(parts)}")

    rate, base_rate = 1 / statistics.median(t_def), 1 / statistics.median(t_tok)
    ratio = statistics.median(t_def) / statistics.median(t_tok)
    ok = rate >= TARGET_RATE
    print(f"  deform: median {rate:,.0f} captions/s ({1e6 / rate:.2f} us each); tokenize: median "
          f"{base_rate:,.0f} captions/s ({1e6 / base_rate:.2f} us); deform/tokenize time {ratio:.2f}x")
    print(f"  target >= {TARGET_RATE:,} captions/s: {'PASS' if ok else 'FAIL'}", flush=True)
    return {"name": "A deform, 1 core", "value": f"{rate:,.0f} captions/s",
            "baseline": f"tokenize {base_rate:,.0f}/s ({ratio:.2f}x)", "target": f">= {TARGET_RATE:,}/s", "ok": ok}


# --- B: end to end on image shards --------------------------------------------------------------------


def pick_images(src: Path, n: int) -> list[Path]:
    """Up to n PNGs of 5-20 KB from src, in sorted path order."""
    out = []
    for p in sorted(src.rglob("*.png")):
        if 5_000 <= p.stat().st_size <= 20_000:
            out.append(p)
            if len(out) == n:
                break
    return out


def synth_png(i: int, rng: np.random.Generator) -> bytes:
    """A clipart-like PNG of roughly 5-20 KB: flat colour blocks with a little noise."""
    w, h = (int(x) for x in rng.integers(96, 200, 2))
    arr = np.asarray(Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((w, h), Image.NEAREST))
    arr = arr.copy()
    noise = rng.random((h, w)) < 0.05
    arr[noise] = rng.integers(0, 256, (int(noise.sum()), 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_image_dataset(folder: Path, ds: Path, n: int, per_shard: int, src: Path | None) -> str:
    from vlprep.shards import ShardsConfig, build_shards

    folder.mkdir()
    captions = CaptionMaker(make_vocab())(n, np.random.default_rng(1))
    src = src or DEFAULT_SRC
    paths = pick_images(src, n) if src.is_dir() else []
    rng = np.random.default_rng(2)
    for i, caption in enumerate(captions):
        dest = folder / f"{i:06d}.png"
        if paths:
            shutil.copyfile(paths[i % len(paths)], dest)
        else:
            dest.write_bytes(synth_png(i, rng))
        (folder / f"{i:06d}.txt").write_text(caption + "\n", encoding="utf-8")
    report = build_shards(ShardsConfig(src=folder, out=ds, samples_per_shard=per_shard, workers=1))
    if report["written"] != n:
        sys.exit(f"build_shards wrote {report['written']} of {n} samples: {report['skipped']}")
    return f"{len(paths)} distinct openclipart PNGs of 5-20 KB from {src}" if paths else "synthetic PNGs"


def tar_rewrite(src: Path, out: Path) -> None:
    """Baseline: read every member of every input tar and write them all into new tars, no parsing."""
    for shard in sorted(src.glob("*.tar")):
        with tarfile.open(shard, "r:") as tin, tarfile.open(out / shard.name, "w") as tout:
            for m in tin:
                data = tin.extractfile(m).read()
                tout.addfile(m, io.BytesIO(data))


def cpu_seconds() -> float:
    """User + system time of this process and its reaped children (bow's worker pool)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run_bow(src: Path, out: Path, workers: int, n: int) -> dict:
    r = bow(BowConfig(src=src, out=out, workers=workers))
    if r["written"] + r["dropped_empty"] != n:
        sys.exit(f"bow accounted for {r['written'] + r['dropped_empty']} of {n} samples")
    return r


def bench_end_to_end(tmp: Path, shards: int, per_shard: int, repeats: int, src: Path | None) -> list[dict]:
    n = shards * per_shard
    folder, ds, scratch = tmp / "images", tmp / "ds", tmp / "runs"
    scratch.mkdir()
    t0 = time.perf_counter()
    what = make_image_dataset(folder, ds, n, per_shard, src)
    shutil.rmtree(folder)
    tar_bytes = sum(p.stat().st_size for p in ds.glob("*.tar"))
    print(f"  input: {shards} shards x {per_shard} samples = {n:,}, {tar_bytes / 1e6:.1f} MB of tars, {what}; "
          f"built in {time.perf_counter() - t0:.1f} s (not timed)")
    sides = {"tar rewrite": lambda out: tar_rewrite(ds, out),
             "bow w=1": lambda out: run_bow(ds, out, 1, n),
             "bow w=2": lambda out: run_bow(ds, out, 2, n)}
    # One untimed round first: page cache, and the one-off imports (matplotlib for the plots).
    for side, fn in sides.items():
        out = scratch / f"warm-{side.replace(' ', '_').replace('=', '')}"
        out.mkdir()
        r = fn(out)
        if side == "bow w=1":
            print(f"  bow report: written {r['written']:,}, dropped_empty {r['dropped_empty']:,}, deformed fraction "
                  f"{r['deformed_fraction']}, base {r['base_samples']:,}, avg words {r['avg_words_before']} -> "
                  f"{r['avg_words_after']} (bow writes only the kept samples; the baseline rewrites all {n:,})")
        shutil.rmtree(out)
    times = {side: [] for side in sides}
    cpus = {side: [] for side in sides}
    for rep in range(repeats):
        for side, fn in sides.items():
            out = scratch / f"{side.replace(' ', '_').replace('=', '')}-{rep}"
            out.mkdir()
            c0, t0 = cpu_seconds(), time.perf_counter()
            fn(out)
            times[side].append(time.perf_counter() - t0)
            cpus[side].append(cpu_seconds() - c0)
            shutil.rmtree(out)
        print(f"  repeat {rep + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.3f} s (cpu {cpus[k][-1]:.2f} s)"
                                                          for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    mcpu = {k: statistics.median(v) for k, v in cpus.items()}
    r1, r2 = med["bow w=1"] / med["tar rewrite"], med["bow w=2"] / med["tar rewrite"]
    ok = r1 <= TARGET_RATIO
    print(f"  median: tar rewrite {med['tar rewrite']:.3f} s, bow w=1 {med['bow w=1']:.3f} s "
          f"({n / med['bow w=1']:,.0f} samples/s), bow w=2 {med['bow w=2']:.3f} s; cpu time ratio bow w=1 / tar "
          f"{mcpu['bow w=1'] / mcpu['tar rewrite']:.2f}x (all processes; w=2 used {mcpu['bow w=2']:.2f} cpu s in "
          f"{med['bow w=2']:.2f} s wall)")
    print(f"  ratio bow w=1 / tar rewrite {r1:.2f}x (target <= {TARGET_RATIO}x): {'PASS' if ok else 'FAIL'}; "
          f"w=2 / tar rewrite {r2:.2f}x (informational)", flush=True)
    return [{"name": "B bow w=1 / tar", "value": f"{r1:.2f}x ({med['bow w=1']:.2f} s)",
             "baseline": f"tar rewrite {med['tar rewrite']:.2f} s", "target": f"<= {TARGET_RATIO}x", "ok": ok},
            {"name": "B bow w=2 / tar", "value": f"{r2:.2f}x ({med['bow w=2']:.2f} s)",
             "baseline": f"tar rewrite {med['tar rewrite']:.2f} s", "target": "(info)", "ok": None}]


# --- C: peak memory ----------------------------------------------------------------------------------


def tiny_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)).save(buf, format="PNG")
    return buf.getvalue()


_maker: CaptionMaker | None = None  # per build worker: the vocabulary is made once, not per shard


def _init_mem_writer() -> None:
    global _maker
    _maker = CaptionMaker(make_vocab())


def _write_mem_shard(root: str, index: int, first: int, count: int) -> int:
    """One shard of the memory dataset, laid out as `vlprep shards` would write it."""
    from vlprep.dataset import shard_name, write_shard
    from vlprep.shards import SIDECAR_SCHEMA

    png = tiny_png()
    captions = _maker(count, np.random.default_rng(1000 + index))
    samples, rows = [], []
    for i, caption in enumerate(captions):
        key = key_of(first + i)
        uid = f"img/{first + i:09d}"
        samples.append({"__key__": key, "png": png, "txt": caption,
                        "json": {"uid": uid, "source": "synthetic", "width": 8, "height": 8}})
        rows.append({"key": key, "uid": uid, "caption": caption, "source": "synthetic", "image_ext": "png",
                     "width": 8, "height": 8, "image_bytes": len(png)})
    shard = shard_name("shard", index)
    write_shard(Path(root), shard, samples, rows, schema=SIDECAR_SCHEMA, stats={"in": count, "written": count})
    return count


def build_mem_dataset(root: Path, n: int, per_shard: int, workers: int) -> None:
    """Child process: n samples in shards of per_shard, through write_shard + finish_dataset."""
    from vlprep.dataset import finish_dataset, shard_name

    root.mkdir(parents=True, exist_ok=True)
    jobs = [(str(root), i, lo, min(per_shard, n - lo)) for i, lo in enumerate(range(0, n, per_shard))]
    with ProcessPoolExecutor(workers, initializer=_init_mem_writer) as pool:
        list(pool.map(_write_mem_shard, *zip(*jobs), chunksize=8))
    sizes = {shard_name("shard", i): c for _, i, _, c in jobs}
    finish_dataset(root, sizes, {"stage": "shards", "input": "synthetic", "counts": {"in": n, "written": n}})


# Peak RSS is the child's VmHWM (the high-water mark of its own address space). ru_maxrss is printed
# too but is not used: Linux carries the parent's peak RSS across fork + exec into the child's
# ru_maxrss, so a child of this (large) benchmark process would report at least our own peak.
CHILD_HEAD = """
import json, resource, sys, time
def vm(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
"""

BOW_CHILD = CHILD_HEAD + """
from vlprep.bow import BowConfig, bow
after_import = vm("VmRSS")
t0 = time.perf_counter()
r = bow(BowConfig(src=sys.argv[1], out=sys.argv[2], workers=int(sys.argv[3])))
print(json.dumps({"hwm_kb": vm("VmHWM"), "import_kb": after_import, "end_kb": vm("VmRSS"),
                  "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "elapsed": time.perf_counter() - t0, "written": r["written"], "dropped": r["dropped_empty"],
                  "vocab_before": r["vocab_before"], "base_vocab": r["base_vocab_size"]}))
"""

IMPORT_CHILD = CHILD_HEAD + """
import vlprep.bow
print(json.dumps({"hwm_kb": vm("VmHWM"), "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def child_json(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"child {' '.join(args[:2])} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def subset(ds: Path, dest: Path, shards: int) -> int:
    """A dataset of the first `shards` shards of ds, by symlinks; returns its sample count."""
    sizes = json.loads((ds / "sizes.json").read_text())
    keep = dict(list(sizes.items())[:shards])
    dest.mkdir()
    for name in keep:
        for f in (name, sidecar_name(name)):
            (dest / f).symlink_to(ds / f)
    (dest / "sizes.json").write_text(json.dumps(keep))
    return sum(keep.values())


def mib(kb: int) -> str:
    return f"{kb / 1024:,.0f} MiB"


def bench_memory(tmp_parent: Path | None, n: int, workers: int, build_workers: int) -> dict:
    need = int(2.3 * n * ROUGH_SAMPLE_BYTES)
    with tempfile.TemporaryDirectory(prefix="vlprep-bow-mem-", dir=tmp_parent) as tmp:
        tmp = Path(tmp)
        free = shutil.disk_usage(tmp).free
        if free < need:
            print(f"  SKIPPED: needs ~{need / 1e9:.1f} GB free in {tmp.parent}, has {free / 1e9:.1f} GB "
                  "(use --tmp or a smaller --mem-captions)")
            return {"name": f"C peak RSS {n / 1e6:g}M", "value": "skipped", "baseline": "", "target": "<= 1 GiB",
                    "ok": None}
        base = child_json(["-c", IMPORT_CHILD])
        print(f"  baseline: a python that only imports vlprep.bow peaks at {mib(base['hwm_kb'])} "
              f"(numpy, pyarrow, Pillow; no torch since vlprep stopped importing webdataset); its ru_maxrss reads {mib(base['ru_maxrss_kb'])}, which includes "
              "this benchmark process's peak (see CHILD_HEAD)")
        ds = tmp / "ds"
        t0 = time.perf_counter()
        child_json([__file__, "--build-mem-child", str(ds), str(n), str(MEM_PER_SHARD), str(build_workers)])
        t_build = time.perf_counter() - t0
        tar_bytes = sum(p.stat().st_size for p in ds.glob("*.tar"))
        print(f"  built {n:,} samples in {-(-n // MEM_PER_SHARD):,} shards ({tar_bytes / 1e9:.2f} GB of tars) in "
              f"{t_build:.0f} s (not timed against anything)", flush=True)
        small = subset(ds, tmp / "ds-tenth", max(1, -(-n // MEM_PER_SHARD) // 10))
        runs = {}
        for name, src, count in ((f"{small:,}", tmp / "ds-tenth", small), (f"{n:,}", ds, n)):
            out = tmp / f"out-{count}"
            r = child_json(["-c", BOW_CHILD, str(src), str(out), str(workers)])
            runs[count] = r
            child = f", largest worker {mib(r['children_kb'])}" if workers > 1 else ""
            print(f"  bow workers={workers} on {name} samples: {r['elapsed']:.0f} s ({count / r['elapsed']:,.0f} "
                  f"samples/s), RSS after imports {mib(r['import_kb'])}, peak {mib(r['hwm_kb'])}{child}, "
                  f"at the end {mib(r['end_kb'])} (ru_maxrss {mib(r['ru_maxrss_kb'])}); written {r['written']:,}, "
                  f"dropped {r['dropped']:,}, vocabulary {r['vocab_before']:,}", flush=True)
            shutil.rmtree(out)
    big, tenth = runs[n], runs[small]
    peak = max(big["hwm_kb"], big["children_kb"] if workers > 1 else 0)
    ok = peak * 1024 <= TARGET_RSS
    print(f"  peak RSS at {n:,} samples: {mib(peak)} (import alone {mib(base['hwm_kb'])}; {small:,} samples "
          f"{mib(tenth['hwm_kb'])}); growth over the import: {mib(big['hwm_kb'] - big['import_kb'])} at {n:,}, "
          f"{mib(tenth['hwm_kb'] - tenth['import_kb'])} at {small:,}")
    print(f"  target <= 1 GiB: {'PASS' if ok else 'FAIL'}")
    print(f"  time for C: build {t_build:.0f} s + bow on {small:,} {tenth['elapsed']:.0f} s + bow on {n:,} "
          f"{big['elapsed']:.0f} s", flush=True)
    return {"name": f"C peak RSS {n / 1e6:g}M", "value": mib(peak), "baseline": f"import {mib(base['hwm_kb'])}",
            "target": "<= 1 GiB", "ok": ok}


# --- main --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller run: 200k captions, 10x200 samples, 2 repeats, 300k for memory")
    ap.add_argument("--captions", type=int, default=None, help="A: number of captions (default 1,000,000)")
    ap.add_argument("--shards", type=int, default=None, help="B: number of input shards (default 20)")
    ap.add_argument("--per-shard", type=int, default=None, help="B: samples per shard (default 500)")
    ap.add_argument("--repeats", type=int, default=None, help="B: timed runs per side (default 3)")
    ap.add_argument("--mem-captions", type=int, default=None, help="C: dataset size (default 3,000,000)")
    ap.add_argument("--mem-workers", type=int, default=1, help="C: bow --workers (default 1)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a, b, c")
    ap.add_argument("--src", type=Path, default=None, help=f"B: PNG folder (default {DEFAULT_SRC}, else synthetic)")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for C's dataset (default: the system temp dir)")
    ap.add_argument("--build-mem-child", nargs=4, metavar=("DIR", "N", "PER_SHARD", "WORKERS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_mem_child:
        d, n, per, w = args.build_mem_child
        build_mem_dataset(Path(d), int(n), int(per), int(w))
        print(json.dumps({"ok": True}))
        return
    q = args.quick
    n_a = args.captions or (200_000 if q else 1_000_000)
    shards = args.shards or (10 if q else 20)
    per_shard = args.per_shard or (200 if q else 500)
    repeats = args.repeats or (2 if q else 3)
    n_c = args.mem_captions or (300_000 if q else 3_000_000)
    skip = {s.strip().lower() for s in args.skip.split(",") if s.strip()}

    print(f"vlprep bow benchmark: python {sys.version.split()[0]}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}, ops {DEFAULT_OPS!r}", flush=True)
    if os.getloadavg()[0] > 0.5:
        print("  (other processes are using the CPU: wall times are noisy and workers=2 may find no free core)")
    print()
    rows = []
    t_start = time.perf_counter()
    if "a" not in skip:
        print(f"A: deform alone, one process, {n_a:,} synthetic captions ({VOCAB:,}-token vocabulary, Zipf s={ZIPF_S})")
        rows.append(bench_deform(n_a, min(100_000, max(1, n_a // 5))))
        print()
    if "b" not in skip:
        print(f"B: end to end, bow (base_frac 0.1, default ops) vs a plain tarfile read-and-rewrite, "
              f"{repeats} interleaved repeats after one untimed round")
        with tempfile.TemporaryDirectory(prefix="vlprep-bow-bench-") as tmp:
            rows += bench_end_to_end(Path(tmp), shards, per_shard, repeats, args.src)
        print()
    if "c" not in skip:
        print(f"C: peak memory of bow on {n_c:,} samples, fresh subprocesses")
        rows.append(bench_memory(args.tmp, n_c, args.mem_workers, min(2, os.cpu_count() or 1)))
        print()

    print(f"{'measurement':<22} {'value':<26} {'baseline':<30} {'target':<14} result")
    for r in rows:
        res = "info" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        print(f"{r['name']:<22} {r['value']:<26} {r['baseline']:<30} {r['target']:<14} {res}")
    print(f"(total {time.perf_counter() - t_start:.0f} s; load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()

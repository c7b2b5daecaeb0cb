"""Benchmark `vlprep bow` against baselines measured in the same run.

A: the per-caption deform of the stage (`Deformer`, default cascade) over synthetic captions in one process, CPU
   time: captions/s per core, target >= 150,000. Informational: the reference `deform()` with `SampleRng` (what the
   stage formerly called), the bare tokenizer, the shuffle alone, and the cascade cut after each step.
B: end to end on image shards, `bow(BowConfig(src, out, workers=1))` against plain code that computes and writes
   the same tar bytes with the fastest reader, deformer and writer we have; target <= 1.3x. Each timed call writes
   into a fresh empty folder, made before and removed after the clock; rounds alternate the order of the sides;
   medians of wall and CPU time decide. What each side does, exactly:
   - `plain bow` (baseline): the work bow's tars need, nothing else. Per sidecar (sorted) its key and caption
     columns (`pq.ParquetFile.read`); for each base key (`base_test`, the stage's base test) the caption's tokens
     go into the base vocabulary and, after rmstop, into the document frequencies that give rmtop's 1000 words
     (`top_tokens`): the statistics the cascade needs. Then per input tar (sorted) `TarReader` reads every member
     (the reads bow does), the members of one key are gathered, and per sample: txt decoded, json parsed (every
     one, as bow does: a bad json member stops bow even in a sample it drops), the caption deformed by the stage's
     own `Deformer` (its speed is part A) unless the key is a base key, an empty result dropped, json.caption_raw
     and json.bow set, and the json (one `JSONEncoder(ensure_ascii=False, sort_keys=True)`), image and txt members
     written through a `ShardTarWriter` (1 MiB buffer). Its tars are checked before the clock to be bow's, byte
     for byte. No sidecar, no index files, no 'before' / 'after' statistics, no report: those are bow's own
     extras. (Until 2026-11-25 the baseline was `fast writer`, below, which writes bow's output bytes computed
     before the clock, so it skipped the deforming and the statistics that any honest run of the same work does.)
   - `fast writer` (informational; the baseline until 2026-11-25): for each input tar (sorted),
     `vlprep.tario.TarReader(path)` and, for every member, `read(offset, size)`: the reads bow's reader
     (`iter_tar`) does, through the same header parser; the members of the samples bow keeps go through a
     `ShardTarWriter` (1 MiB buffer), with the txt and json payloads bow writes for them (taken from one untimed
     bow run before the clock, so the same bytes go to disk and the samples bow drops are not written). No
     parsing, no deforming, no sidecar, no report.
   - `bow w=1`: the whole stage with the default ops (shuffle,rmstop,basevocab,rmtop:1000,keep:4), base fraction
     0.1: read every Parquet sidecar for the base statistics, hash the sidecars for the resume fingerprints, claim
     the output folder; per shard read the sidecar and every tar member (with the member-name safety checks),
     decode txt + json, deform the non-base captions, drop empty ones, re-encode json, write the kept samples as
     a ustar tar plus the edited Parquet sidecar under .tmp names and rename them; then sizes.json / index.json /
     meta.json, the 'after' statistics of the kept captions, bow_report.png (matplotlib, Agg) and report.json.
   - `bow w=2` (informational): the same with a pool of 2 worker processes.
   - `fast writer, tarfile reads` (informational; the baseline until bow's reader stopped using tarfile): the
     same, with the members read through `tarfile.open(path, "r:")` and `extractfile(m).read()`.
   - `tarfile addfile` (informational; the baseline before that): every member of every sample (kept or not) read
     through tarfile and written through `tarfile.open(path, "w")` + `addfile`.
   - `limit` (informational): the same output bytes with no per-sample Python: member headers, payloads and
     paddings of the kept samples are prepared before the clock; per shard the input tar is read in one call, the
     image payloads are sliced out of it into their slots, and the output is one `b"".join` and one write.
   - `disk read` (informational): every input tar and sidecar read whole, once, with one `read()` each (the page
     cache is warm, as for every side). Its samples/s is the ceiling for any stage that reads the dataset; bow's
     own samples/s is printed against it.
C: peak RSS of `bow` on a dataset of --mem-captions samples (tiny shared PNG), each run in a fresh
   subprocess so nothing else is counted; a tenth of the dataset is run too, to show the growth.

    .venv/bin/python benchmarks/bow.py [--quick] [--captions 1000000] [--shards 20] [--per-shard 500]
                                       [--repeats 3] [--mem-captions 3000000] [--skip a,b,c] [--src DIR] [--isolate]
"""

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from vlprep.bow import (DEFAULT_OPS, BowConfig, BowContext, Deformer, SampleRng, base_test, bow, deform,  # noqa: E402
                        keyed_shuffle, parse_ops, ranking_prefix, top_tokens)
from vlprep.dataset import sidecar_name  # noqa: E402
from vlprep.tario import ShardTarWriter, TarReader  # noqa: E402
from vlprep.text import stop_words, tokenize  # noqa: E402

DEFAULT_SRC = Path("/usr/share/openclipart/png")
VOCAB = 20_000
ZIPF_S = 1.0          # rank-frequency exponent of the synthetic captions
HEAD_STOP = ["a", "the", "of", "in", "and", "with", "on", "an", "at", "is", "for", "to", "are", "his", "her",
             "from", "by", "up", "while", "it", "this", "some", "their", "has", "its", "over", "into", "out"]
PUNCT = [",", ".", "-", "'", "(", ")", "!", "?", ":", ";", "&", "/"]
TARGET_RATE = 150_000  # A: deform captions/s per core, at least
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
    cons = "bcdfghjklmnprstvwz"
    vows = "aeiou"
    syll = [c + v for c in cons for v in vows] + [c + v + "n" for c in cons for v in vows]
    content = []
    seen = special | set(numbers)
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
        out = []
        at = 0
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
    head = vocab[:2000]
    tail = vocab[2000:]
    want = int(0.6 * len(vocab)) - len(head)
    picked = rng.choice(len(tail), size=max(0, want), replace=False)
    return BowContext(base_vocab=frozenset(head + [tail[i] for i in picked]), top=frozenset(vocab[:1000]))


# --- A: the deformation function alone --------------------------------------------------------------


def cpu_per_item(fn, items: list, repeats: int = 3) -> float:
    """Least CPU seconds per item of `fn` over `items` in `repeats` passes (the result of each call dropped)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn(items)
        best = min(best, time.process_time() - t0)
    return best / len(items)


def bench_deform(n: int, chunk: int) -> list[dict]:
    vocab = make_vocab()
    ctx = synthetic_context(vocab)
    cascade = parse_ops(DEFAULT_OPS)
    t0 = time.perf_counter()
    captions = CaptionMaker(vocab)(n, np.random.default_rng(0))
    keys = [key_of(i) for i in range(n)]
    pairs = list(zip(captions, keys))
    toks = [len(tokenize(c)) for c in captions[:100_000]]
    print(f"  {n:,} captions made in {time.perf_counter() - t0:.1f} s (not timed); e.g. {captions[0]!r} / "
          f"{captions[1]!r}")
    print(f"  tokens per caption: mean {statistics.mean(toks):.1f}, min {min(toks)}, max {max(toks)}; "
          f"base vocab {len(ctx.base_vocab):,} of {len(vocab):,} tokens, top set {len(ctx.top):,}")
    seed = 0

    def stage(cascade_):
        d = Deformer(cascade_, ctx, seed)

        def run(ps):
            for c, k in ps:
                d(c, k)
            d.take_removed()  # the per-shard tally, as bow_shard does
        return run

    def reference(ps):
        for c, k in ps:
            deform(c, cascade, ctx, SampleRng(seed, k), [0] * len(cascade))

    def tok(ps):
        for c, _ in ps:
            tokenize(c)

    token_lists = [tokenize(c) for c in captions[:chunk]]
    prefixes = [f"{seed}:{k}:".encode() for k in keys[:chunk]]

    def shuffle_only(idx):
        for i in idx:
            keyed_shuffle(list(token_lists[i]), prefixes[i])

    def shuffle_ref(idx):
        for i in idx:
            SampleRng(seed, keys[i]).shuffle(list(token_lists[i]))

    # Chunks in turn, each side on the same chunk: the median over chunks decides (CPU time, so another
    # process on the core slows the figure only through shared caches).
    run = stage(cascade)
    t_def = []
    t_ref = []
    t_tok = []
    for lo in range(0, n, chunk):
        part = pairs[lo: lo + chunk]
        t_def.append(cpu_per_item(run, part, 1))
        t_ref.append(cpu_per_item(reference, part, 1))
        t_tok.append(cpu_per_item(tok, part, 1))
    print(f"  {len(t_def)} chunks of {chunk:,}: Deformer {', '.join(f'{1 / t:,.0f}' for t in t_def)} captions/s")
    sample = pairs[:chunk]
    d = Deformer(cascade, ctx, seed)
    empty = sum(not d(c, k) for c, k in sample)
    print(f"  e.g. {sample[0][0]!r} -> {d(*sample[0])!r}; {100 * empty / len(sample):.1f}% come out empty")
    idx = list(range(len(token_lists)))
    sh = cpu_per_item(shuffle_only, idx)
    sh_ref = cpu_per_item(shuffle_ref, idx)
    print(f"  shuffle alone, per caption: keyed_shuffle {1e6 * sh:.2f} us, SampleRng.shuffle {1e6 * sh_ref:.2f} us")

    # Where the time goes: the stage's deform with the cascade cut after each step (informational).
    prefix = []
    last = statistics.median(t_tok)
    parts = [f"tokenize {1e6 * last:.2f}"]
    for step in cascade:
        prefix.append(step)
        cur = cpu_per_item(stage(list(prefix)), sample)
        parts.append(f"+{step.label} {1e6 * (cur - last):.2f}")
        last = cur
    print(f"  per caption, us (cumulative cascade, incl. the key prefix, tally and join; a cut cascade can take "
          f"another path through Deformer, so a step can read negative): {', '.join(parts)}")

    rate, ref_rate, tok_rate = (1 / statistics.median(t) for t in (t_def, t_ref, t_tok))
    print(f"  Deformer: median {rate:,.0f} captions/s ({1e6 / rate:.2f} us each); reference deform() + SampleRng "
          f"{ref_rate:,.0f}/s ({rate / ref_rate:.2f}x slower); tokenize {tok_rate:,.0f}/s", flush=True)
    return [common.value_row("A deform, 1 core", rate, TARGET_RATE, "captions/s CPU"),
            common.value_row("A reference deform()", ref_rate, None, "captions/s CPU", note="formerly"),
            common.value_row("A tokenize alone", tok_rate, None, "captions/s CPU")]


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


def tar_addfile(src: Path, out: Path) -> None:
    """Informational (the former baseline): every member of every tar read and written through addfile."""
    for shard in sorted(src.glob("*.tar")):
        with tarfile.open(shard, "r:") as tin, tarfile.open(out / shard.name, "w") as tout:
            for m in tin:
                data = tin.extractfile(m).read()
                tout.addfile(m, io.BytesIO(data))


def kept_payloads(ref: Path) -> dict[str, dict[str, dict[str, bytes]]]:
    """{shard: {key: {"txt": bytes, "json": bytes}}} of bow's output: what it writes for each sample it keeps."""
    out = {}
    for shard in sorted(ref.glob("*.tar")):
        kept = out.setdefault(shard.name, {})
        with tarfile.open(shard, "r:") as tf:
            for m in tf:
                key, _, ext = m.name.partition(".")
                if ext in ("txt", "json"):
                    kept.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return out


def plain_bow(src: Path, out: Path, seed: int = 0, base_frac: float = 0.1) -> None:
    """Baseline: the statistics the cascade needs, then per tar bow's reads, deformed captions and kept members."""
    cascade = parse_ops(DEFAULT_OPS)
    prefix = ranking_prefix(cascade)
    no_ctx = BowContext()
    vocab = set()
    df = Counter()
    in_base = base_test(seed, base_frac)
    for side in sorted(src.glob("*.parquet")):
        t = pq.ParquetFile(side).read(columns=["key", "caption"])
        for key, caption in zip(t.column(0).to_pylist(), t.column(1).to_pylist()):
            if in_base(key):
                toks = tokenize(caption)
                vocab.update(toks)
                for step in prefix:
                    toks = step.fn(toks, no_ctx, None)
                df.update(set(toks))
    t_top = next(s.arg for s in cascade if s.name == "rmtop")
    deformer = Deformer(cascade, BowContext(frozenset(vocab), frozenset(top_tokens(df, t_top))), seed)
    encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True).encode

    def write(tw: ShardTarWriter, key: str, members: dict[str, bytes]) -> None:
        text = members.pop("txt").decode("utf-8")
        meta = json.loads(members.pop("json"))
        flag = not in_base(key)
        caption = deformer(text, key) if flag else text
        if not caption:
            return
        meta.setdefault("caption_raw", text)
        meta["bow"] = flag
        members["json"], members["txt"] = encode(meta).encode(), caption.encode()
        for ext in sorted(members):
            tw.add(f"{key}.{ext}", members[ext])

    for shard in sorted(src.glob("*.tar")):
        with (TarReader(shard) as tin, open(out / shard.name, "wb", buffering=1 << 20) as f,
              ShardTarWriter(f) as tw):
            key = None
            members = {}
            for name, offset, size in tin:
                k, _, ext = name.partition(".")
                if k != key:
                    if members:
                        write(tw, key, members)
                    key = k
                    members = {}
                members[ext] = tin.read(offset, size)
            if members:
                write(tw, key, members)


def check_plain_bow(src: Path, ref: Path, tmp: Path) -> None:
    """Before the clock: the baseline's tars are bow's, byte for byte (else it would not do the same work)."""
    out = tmp / "plain-check"
    out.mkdir()
    plain_bow(src, out)
    for shard in sorted(ref.glob("*.tar")):
        if (out / shard.name).read_bytes() != shard.read_bytes():
            sys.exit(f"plain bow wrote other bytes than bow for {shard.name}")
    shutil.rmtree(out)


def fast_writer(src: Path, kept: dict, out: Path) -> None:
    """Informational (the baseline until 2026-11-25): bow's reads (TarReader, as iter_tar reads), and its kept
    samples' members (its txt and json bytes, made before the clock) through ShardTarWriter."""
    for shard in sorted(src.glob("*.tar")):
        keep = kept[shard.name]
        with (TarReader(shard) as tin, open(out / shard.name, "wb", buffering=1 << 20) as f,
              ShardTarWriter(f) as tw):
            for name, offset, size in tin:
                data = tin.read(offset, size)
                key, _, ext = name.partition(".")
                new = keep.get(key)
                if new is not None:
                    tw.add(name, new.get(ext, data))


def fast_writer_tarfile(src: Path, kept: dict, out: Path) -> None:
    """Informational (the former baseline): `fast_writer` with the members read through tarfile."""
    for shard in sorted(src.glob("*.tar")):
        keep = kept[shard.name]
        with (tarfile.open(shard, "r:") as tin, open(out / shard.name, "wb", buffering=1 << 20) as f,
              ShardTarWriter(f) as tw):
            for m in tin:
                data = tin.extractfile(m).read()
                key, _, ext = m.name.partition(".")
                new = keep.get(key)
                if new is not None:
                    tw.add(m.name, new.get(ext, data))


def disk_read(src: Path, out: Path) -> None:
    """Informational: every input tar and sidecar read whole, once (the ceiling of any stage reading src)."""
    for path in sorted([*src.glob("*.tar"), *src.glob("*.parquet")]):
        with open(path, "rb") as f:
            f.read()


def limit_plan(src: Path, ref: Path) -> list[tuple[Path, str, list[bytes], list[tuple[int, int]]]]:
    """Before the clock: per shard (input tar, name, the output's parts with the image payloads left empty, where
    each of those payloads sits in the input tar)."""
    plan = []
    for shard in sorted(src.glob("*.tar")):
        where = {}
        with tarfile.open(shard, "r:") as tf:
            for m in tf:
                where[m.name] = (m.offset_data, m.offset_data + m.size)
        raw = (ref / shard.name).read_bytes()
        parts = []
        offs = []
        end = 0
        with tarfile.open(ref / shard.name, "r:") as tf:
            members = list(tf)
        for i, m in enumerate(members):
            stop = members[i + 1].offset if i + 1 < len(members) else m.offset_data + m.size + (-m.size % 512)
            image = not m.name.endswith((".txt", ".json"))
            parts += [raw[m.offset:m.offset_data], b"" if image else raw[m.offset_data:m.offset_data + m.size],
                      raw[m.offset_data + m.size:stop]]
            if image:
                offs.append(where[m.name])
            end = stop
        parts.append(raw[end:])
        plan.append((shard, shard.name, parts, offs))
    return plan


def limit(plan, out: Path) -> None:
    """Informational: per shard one read of the input, the image payloads sliced into place, one join, one write."""
    for shard, name, parts, offs in plan:
        with open(shard, "rb") as f:
            buf = f.read()
        parts = list(parts)
        parts[4:-1:9] = [buf[a:b] for a, b in offs]
        with open(out / name, "wb") as f:
            f.write(b"".join(parts))


def run_bow(src: Path, out: Path, workers: int, n: int) -> dict:
    r = bow(BowConfig(src=src, out=out, workers=workers))
    if r["written"] + r["dropped_empty"] != n:
        sys.exit(f"bow accounted for {r['written'] + r['dropped_empty']} of {n} samples")
    return r


def make_sides(root: Path) -> dict[str, common.Side]:
    """B's sides over root/ds (the input) and root/ref (one untimed bow run: the bytes to write); only reads them."""
    ds = root / "ds"
    ref = root / "ref"
    n = sum(json.loads((ds / "sizes.json").read_text()).values())
    kept = kept_payloads(ref)
    plan = limit_plan(ds, ref)
    return {"plain bow": lambda out: plain_bow(ds, out),
            "bow w=1": lambda out: run_bow(ds, out / "bow", 1, n),
            "fast writer": lambda out: fast_writer(ds, kept, out),
            "bow w=2": lambda out: run_bow(ds, out / "bow", 2, n),
            "fast writer, tarfile reads": lambda out: fast_writer_tarfile(ds, kept, out),
            "tarfile addfile": lambda out: tar_addfile(ds, out),
            "limit": lambda out: limit(plan, out),
            "disk read": lambda out: disk_read(ds, out)}


def bench_end_to_end(tmp: Path, shards: int, per_shard: int, repeats: int, src: Path | None,
                     isolate: bool) -> list[dict]:
    n = shards * per_shard
    folder = tmp / "images"
    ds = tmp / "ds"
    t0 = time.perf_counter()
    what = make_image_dataset(folder, ds, n, per_shard, src)
    shutil.rmtree(folder)
    tar_bytes = sum(p.stat().st_size for p in ds.glob("*.tar"))
    print(f"  input: {shards} shards x {per_shard} samples = {n:,}, {tar_bytes / 1e6:.1f} MB of tars, {what}; "
          f"built in {time.perf_counter() - t0:.1f} s (not timed)")
    r = run_bow(ds, tmp / "ref", 1, n)  # untimed: what the baseline writes, and the page cache warm
    print(f"  bow report: written {r['written']:,}, dropped_empty {r['dropped_empty']:,}, deformed fraction "
          f"{r['deformed_fraction']}, base {r['base_samples']:,}, avg words {r['avg_words_before']} -> "
          f"{r['avg_words_after']} (the baseline computes and writes the same {r['written']:,} kept samples, checked "
          f"byte for byte)")
    check_plain_bow(ds, tmp / "ref", tmp)
    t = common.time_sides(make_sides(tmp), repeats, tmp, isolate, label="B ")
    rows = [common.ratio_row("B bow w=1", t["plain bow"], t["bow w=1"], TARGET_RATIO),
            common.ratio_row("B bow w=2", t["plain bow"], t["bow w=2"], None, note="2 worker processes"),
            common.ratio_row("B bow w=1 vs fast writer", t["fast writer"], t["bow w=1"], None,
                             note="baseline until 2026-11-25: bow's bytes made before the clock"),
            common.ratio_row("B plain bow vs fast writer", t["fast writer"], t["plain bow"], None,
                             note="what deforming and rmtop's statistics cost"),
            common.ratio_row("B bow w=1 vs tarfile reads", t["fast writer, tarfile reads"], t["bow w=1"], None,
                             note="former baseline"),
            common.ratio_row("B bow w=1 vs tarfile addfile", t["tarfile addfile"], t["bow w=1"], None,
                             note="older baseline"),
            common.ratio_row("B bow w=1 vs limit", t["limit"], t["bow w=1"], None, note="no per-sample Python"),
            common.ratio_row("B fast writer vs limit", t["limit"], t["fast writer"], None,
                             note="the baseline's own gap")]
    rate = n / common.median(t["bow w=1"]["wall"])
    ceiling = n / common.median(t["disk read"]["wall"])
    print(f"  bow w=1: {rate:,.0f} samples/s; a plain read of the same tars and sidecars: {ceiling:,.0f} samples/s "
          f"(bow at {100 * rate / ceiling:.1f}% of it)", flush=True)
    rows.append(common.value_row("B bow w=1 samples/s", rate, None, "samples/s",
                                 note=f"disk read limit {ceiling:,.0f} samples/s, page cache warm"))
    return rows


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
    from vlprep.output import Out, shard_name, write_shard
    from vlprep.shards import SIDECAR_SCHEMA

    png = tiny_png()
    captions = _maker(count, np.random.default_rng(1000 + index))
    samples = []
    rows = []
    for i, caption in enumerate(captions):
        key = key_of(first + i)
        uid = f"img/{first + i:09d}"
        samples.append({"__key__": key, "png": png, "txt": caption,
                        "json": {"uid": uid, "source": "synthetic", "width": 8, "height": 8}})
        rows.append({"key": key, "uid": uid, "caption": caption, "source": "synthetic", "image_ext": "png",
                     "width": 8, "height": 8, "image_bytes": len(png)})
    shard = shard_name("shard", index)
    stats = {"in": count, "written": count}
    write_shard(Out(Path(root)), shard, samples, rows, schema=SIDECAR_SCHEMA, stats=stats)
    return count


def build_mem_dataset(root: Path, n: int, per_shard: int, workers: int) -> None:
    """Child process: n samples in shards of per_shard, through write_shard + finish_dataset."""
    from vlprep.output import Out, finish_dataset, shard_name

    root.mkdir(parents=True, exist_ok=True)
    jobs = [(str(root), i, lo, min(per_shard, n - lo)) for i, lo in enumerate(range(0, n, per_shard))]
    with ProcessPoolExecutor(workers, initializer=_init_mem_writer) as pool:
        list(pool.map(_write_mem_shard, *zip(*jobs), chunksize=8))
    sizes = {shard_name("shard", i): c for _, i, _, c in jobs}
    finish_dataset(Out(root), sizes, {"stage": "shards", "input": "synthetic", "counts": {"in": n, "written": n}})


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
            return common.value_row(f"C peak RSS {n / 1e6:g}M", float("nan"), None, "MiB", note="skipped")
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
    big = runs[n]
    tenth = runs[small]
    peak = max(big["hwm_kb"], big["children_kb"] if workers > 1 else 0)
    ok = peak * 1024 <= TARGET_RSS
    print(f"  peak RSS at {n:,} samples: {mib(peak)} (import alone {mib(base['hwm_kb'])}; {small:,} samples "
          f"{mib(tenth['hwm_kb'])}); growth over the import: {mib(big['hwm_kb'] - big['import_kb'])} at {n:,}, "
          f"{mib(tenth['hwm_kb'] - tenth['import_kb'])} at {small:,}")
    print(f"  target <= 1 GiB: {'PASS' if ok else 'FAIL'}")
    print(f"  time for C: build {t_build:.0f} s + bow on {small:,} {tenth['elapsed']:.0f} s + bow on {n:,} "
          f"{big['elapsed']:.0f} s", flush=True)
    return common.value_row(f"C peak RSS {n / 1e6:g}M", peak / 1024, TARGET_RSS / 2**20, "MiB",
                            higher_is_better=False, note=f"import alone {mib(base['hwm_kb'])}")


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
    common.add_options(ap)
    args = ap.parse_args()
    if args.build_mem_child:
        d, n, per, w = args.build_mem_child
        build_mem_dataset(Path(d), int(n), int(per), int(w))
        print(json.dumps({"ok": True}))
        return
    if args.side is not None:  # a child of --isolate: B's set-up folder exists, time one call
        common.run_child(args, make_sides(args.side_dir))
    q = args.quick
    n_a = args.captions or (200_000 if q else 1_000_000)
    shards = args.shards or (10 if q else 20)
    per_shard = args.per_shard or (200 if q else 500)
    repeats = args.repeats or (2 if q else 3)
    n_c = args.mem_captions or (300_000 if q else 3_000_000)
    skip = {s.strip().lower() for s in args.skip.split(",") if s.strip()}

    print(common.load_line("start"))
    print(f"vlprep bow benchmark: python {sys.version.split()[0]}, ops {DEFAULT_OPS!r}", flush=True)
    print()
    rows = []
    t_start = time.perf_counter()
    if "a" not in skip:
        print(f"A: deform alone, one process, {n_a:,} synthetic captions ({VOCAB:,}-token vocabulary, Zipf s={ZIPF_S})")
        rows += bench_deform(n_a, min(100_000, max(1, n_a // 5)))
        print()
    if "b" not in skip:
        print(f"B: end to end, bow (base_frac 0.1, default ops) vs plain code computing and writing the same tars "
              f"(same reads, Deformer, ShardTarWriter), {repeats} rounds of alternating order"
              f"{', each timed call in a fresh process' if args.isolate else ' after one untimed round'}")
        with tempfile.TemporaryDirectory(prefix="vlprep-bow-bench-") as tmp:
            rows += bench_end_to_end(Path(tmp), shards, per_shard, repeats, args.src, args.isolate)
        print()
    if "c" not in skip:
        print(f"C: peak memory of bow on {n_c:,} samples, fresh subprocesses")
        rows.append(bench_memory(args.tmp, n_c, args.mem_workers, min(2, os.cpu_count() or 1)))
        print()
    common.print_table(rows, candidate="bow")
    print(f"(total {time.perf_counter() - t_start:.0f} s)")
    print(common.load_line("end"))


if __name__ == "__main__":
    main()

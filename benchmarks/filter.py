"""Benchmark `vlprep filter`'s vector rules at scale (near duplicates, decontamination) against bare faiss.

The data (made once, untimed): --n synthetic unit vectors of --dim dims (default 1,000,000 x 384), clustered as
pseudolabel.py's part B makes them (--topics centres, noise of norm 0.8: two vectors of one topic are at cosine
about 0.6), with --n // 100 planted near-duplicate triples (two copies of a vector, each moved by noise of norm
0.05: cosine >= 0.997 within a triple), written as a `vlprep embed` output (embeddings.npy float32, keys.parquet);
the dataset's samples are those keys in that order, in shards of --per-shard, each shard's keys in the scan table
`vlprep filter` reads them from (OUT/_scan/SHARD.parquet). An eval set of --eval vectors from the same topics,
--eval // 10 of them near copies (noise of norm 0.05) of training vectors outside the triples, is a second
`vlprep embed` output. So the rule at cosine --threshold (0.95) must drop exactly 2 per triple, and decontamination
exactly one training sample per planted eval copy; the script checks both sides against those counts and each other.

What is timed is the vector part of the stage, through the stage's own code, not `vlprep filter` end to end: a real
dataset of 1M samples would spend most of the stage's time in its scan (every image decoded) and copy passes,
which pass over the shards whatever the rule and have no faiss counterpart (docs/SCALE.md and scale.py measure
such passes). The sides, each timed call a fresh Python process (peak RSS is that process's VmHWM, imports
included, the memory map's resident pages included):
- near-dup, stage: vlprep.filter.Decision with the rule vlprep.filterembed.NearDup(T) over a Source of the
  embed folder, every sample kept by the earlier rules (what Decision.add makes of a scan without sample rules),
  then Decision.finish(): the embed folder opened (keys hashed and sorted, vectors memory-mapped), each shard's
  keys read from its scan table and looked up, FAISS' index built over the kept samples' vectors (flat below
  100,000 vectors, else IVF with nlist 4 sqrt(N), k-means seed 1234 on 64 vectors a list, nprobe 32: vlprep.knn's
  choice), the batched range search and the greedy rule, the drops marked with their details.
- near-dup, bare: the same scan tables' keys mapped to rows by one pyarrow index_in; the rows gathered from the
  memory-mapped embeddings.npy and normalised in place (numpy); the same faiss index type with the same
  parameters built by hand over them; range_search of the same vectors in batches of 4,096 at the same radius
  (one float32 step below T, then `>= T`); the pairs (earlier, later) collected, then the greedy keep/drop pass in
  plain numpy/Python over the later ones in order; the drops marked with their details.
- exclude, stage: the stage's decontamination search (Exclude's vector part: vlprep.filtervec.Vectors of both
  folders, the training keys looked up as Alive does, index_over the eval vectors, range_hits of every training
  vector against it, the best eval match per hit kept as Exclude keeps it); the eval set is embedded beforehand
  (the stage would embed it with --checkpoint: the encoder's cost, not the search's).
- exclude, bare: the keys mapped by index_in, the eval vectors loaded and normalised, faiss' index of the same kind
  (flat for an eval set under 100,000), the training vectors gathered a batch at a time from the memory map,
  normalised, range_search'ed at the same radius, the best match per hit.
Rounds alternate the sides' order (benchmarks/common.py); medians of wall and CPU time decide. Targets: stage /
bare <= 1.2x in wall time and in peak RSS, for each rule. Prints throughput (vectors/s), the load average at start
and end, and a PASS/FAIL table; --json FILE writes the record (each call's figures too, among them the mapped
files' resident pages at the call's end). At 1M on 2 cores one near-dup call takes about 15 minutes (IVF's k-means,
its add, and a million range queries of about 8,500 vectors each), so a 1M run is best given --repeats 1.

    .venv/bin/python benchmarks/filter.py [--n 1000000] [--dim 384] [--eval 10000] [--repeats 3] [--json F]
    .venv/bin/python benchmarks/filter.py --quick   # 20,000 vectors: a smoke test of the script
"""

import argparse
import hashlib
import json
import math
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_options, load_line, median, print_table, ratio_row, run_child_figures,  # noqa: E402
                    time_sides_figures, value_row)

TARGET = 1.2
BATCH = 4096  # queries per range_search call (the stage's QUERY_BATCH too)
FLAT_MAX = 100_000  # vlprep.knn's `auto`: flat below this many vectors, IVF from there on
NPROBE = 32  # vlprep.knn.DEFAULT_NPROBE (checked against it in the set-up)
KMEANS_SEED = 1234
TRAIN_PER_LIST = 64
COPY_NOISE = 0.05  # norm of the noise that makes a near copy: cosine >= 1 / (1 + 0.05^2) with its original


# --- the data ----------------------------------------------------------------------------------------------------


def clustered(rng, n: int, d: int, centres: np.ndarray, noise: float) -> np.ndarray:
    """n unit vectors, each a random centre plus Gaussian noise of norm about `noise`, in chunks."""
    out = np.empty((n, d), dtype=np.float32)
    for lo in range(0, n, 100_000):
        m = min(100_000, n - lo)
        picked = centres[rng.integers(0, len(centres), m)]
        x = picked + rng.standard_normal((m, d), dtype=np.float32) * (noise / d ** 0.5)
        out[lo:lo + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def near_copies(rng, x: np.ndarray) -> np.ndarray:
    """A copy of each row moved by noise of norm COPY_NOISE, renormalised."""
    g = rng.standard_normal(x.shape, dtype=np.float32)
    y = x + COPY_NOISE * g / np.linalg.norm(g, axis=1, keepdims=True)
    return y / np.linalg.norm(y, axis=1, keepdims=True)


def write_embed(folder: Path, keys: list[str], x: np.ndarray) -> None:
    """A `vlprep embed`-format output: embeddings.npy (float32) and keys.parquet (column `key`)."""
    folder.mkdir(parents=True)
    np.save(folder / "embeddings.npy", x)
    pq.write_table(pa.table({"key": pa.array(keys, pa.string())}), folder / "keys.parquet")


def make_data(root: Path, args) -> dict:
    """The training and eval vectors, the scan tables, and what the rules must find (info.json)."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((args.topics, args.dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = clustered(rng, args.n, args.dim, centres, 0.8)
    triples = args.n // 100
    picked = rng.choice(args.n, 3 * triples + args.eval // 10, replace=False)
    groups = picked[:3 * triples].reshape(triples, 3)
    for c in (1, 2):  # members 1 and 2 near copies of member 0, wherever the three fall in dataset order
        x[groups[:, c]] = near_copies(rng, x[groups[:, 0]])
    sources = picked[3 * triples:]  # training vectors outside the triples that eval copies are made of
    ev = clustered(rng, args.eval, args.dim, centres, 0.8)
    ev[:len(sources)] = near_copies(rng, x[sources])
    keys = [f"s{i:09d}" for i in range(args.n)]
    write_embed(root / "emb", keys, x)
    write_embed(root / "eval", [f"e{i:07d}" for i in range(args.eval)], ev)
    shards = []
    for s, lo in enumerate(range(0, args.n, args.per_shard)):
        name = f"bench-{s:06d}.tar"
        (root / "out" / "_scan").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"key": pa.array(keys[lo:lo + args.per_shard], pa.string())}),
                       root / "out" / "_scan" / f"bench-{s:06d}.parquet")
        shards.append([name, len(keys[lo:lo + args.per_shard])])
    info = {"n": args.n, "dim": args.dim, "eval": args.eval, "threshold": args.threshold, "shards": shards,
            "near_dup": 2 * triples, "exclude": len(sources)}
    (root / "info.json").write_text(json.dumps(info))
    return info


# --- shared by both sides ------------------------------------------------------------------------------------------


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def file_mb() -> float:
    """The resident pages of mapped files now (Linux' RssFile: a memory map's pages count in RSS), 0 elsewhere."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("RssFile:")), 0.0)


def result(pairs: list[tuple[int, str, float]]) -> dict:
    """A side's figures: its peak RSS, how many it dropped, and a digest of (position, matched key) per drop."""
    pairs = sorted(pairs)
    text = ";".join(f"{p}:{k}" for p, k, _ in pairs).encode()
    return {"peak_mb": peak_mb(), "file_mb": file_mb(), "dropped": len(pairs),
            "digest": int.from_bytes(hashlib.blake2b(text, digest_size=6).digest(), "little")}


def scan_keys(root: Path, info: dict) -> list[pa.Array]:
    return [pq.ParquetFile(root / "out" / "_scan" / f"{name[:-4]}.parquet").read(columns=["key"]).column(0)
            .combine_chunks() for name, _ in info["shards"]]


def radius(t: float) -> float:
    return float(np.nextafter(np.float32(t), np.float32(-np.inf)))


def unit_rows(x, rows: np.ndarray) -> np.ndarray:
    """x[rows] as float32, each row divided by its norm in place."""
    y = np.asarray(x[rows], dtype=np.float32)
    y /= np.maximum(np.linalg.norm(y, axis=1, keepdims=True), np.float32(1e-12))
    return y


# --- the bare sides ------------------------------------------------------------------------------------------------


def bare_index(x: np.ndarray):
    """The index vlprep.knn would pick for len(x) vectors, built by hand with faiss."""
    import faiss

    n, d = x.shape
    if n < FLAT_MAX:
        index = faiss.IndexFlatIP(d)
    else:
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, max(1, min(int(4 * math.sqrt(n)), n // 39)),
                                   faiss.METRIC_INNER_PRODUCT)
        index.cp.spherical = True
        index.cp.seed = KMEANS_SEED
        index.cp.max_points_per_centroid = TRAIN_PER_LIST
        index.train(x)
        index.nprobe = min(NPROBE, index.nlist)
    index.add(x)
    return index


def bare_rows(root: Path, info: dict, folder: str) -> tuple[np.ndarray, pa.Array, pa.Array]:
    """Each dataset sample's row in the embed folder (one index_in over every shard's keys)."""
    per_shard = scan_keys(root, info)
    keys = pa.concat_arrays(per_shard)
    embed_keys = pq.read_table(root / folder / "keys.parquet", columns=["key"]).column(0).combine_chunks()
    rows = pc.index_in(keys, value_set=embed_keys).to_numpy(zero_copy_only=False)
    return rows.astype(np.int64), keys, embed_keys


def near_bare(root: Path, info: dict) -> dict:
    t = info["threshold"]
    rows, keys, _ = bare_rows(root, info, "emb")
    x = unit_rows(np.load(root / "emb" / "embeddings.npy", mmap_mode="r"), rows)
    index = bare_index(x)
    later, earlier, cos = [], [], []
    for s in range(0, len(x), BATCH):
        lims, dist, ids = index.range_search(x[s:s + BATCH], radius(t))
        q = s + np.repeat(np.arange(len(lims) - 1), np.diff(lims).astype(np.int64))
        ok = (dist >= np.float32(t)) & (ids < q)
        later.append(q[ok])
        earlier.append(ids[ok])
        cos.append(dist[ok])
    later = np.concatenate(later)
    earlier = np.concatenate(earlier)
    cos = np.concatenate(cos)
    order = np.lexsort((earlier, later))
    keep = np.ones(len(x), bool)
    drops = []
    i = 0
    while i < len(order):  # the pairs of one later position, in position order: a drop decides later ones
        j = int(later[order[i]])
        best = -1
        while i < len(order) and later[order[i]] == j:
            e = int(earlier[order[i]])
            if keep[e] and (best < 0 or cos[order[i]] > cos[order[best]]):
                best = i
            i += 1
        if best >= 0:
            keep[j] = False
            drops.append((j, int(earlier[order[best]]), float(cos[order[best]])))
    codes = []
    details = {}
    lo = 0
    for name, size in info["shards"]:
        codes.append(np.where(keep[lo:lo + size], 0, 11).astype(np.uint8))
        lo += size
    for j, e, c in drops:
        other = keys[e].as_py()
        details[j] = {"detail": f"cosine {c:.4f} with {other}", "match_key": other, "cosine": c}
    return result([(j, d["match_key"], d["cosine"]) for j, d in details.items()])


def exclude_bare(root: Path, info: dict) -> dict:
    t = info["threshold"]
    rows, _, _ = bare_rows(root, info, "emb")
    x = np.load(root / "emb" / "embeddings.npy", mmap_mode="r")
    ev = np.load(root / "eval" / "embeddings.npy")
    ev /= np.maximum(np.linalg.norm(ev, axis=1, keepdims=True), np.float32(1e-12))
    eval_keys = pq.read_table(root / "eval" / "keys.parquet", columns=["key"]).column(0).combine_chunks()
    index = bare_index(ev)
    found = {}
    for s in range(0, len(rows), BATCH):
        lims, dist, ids = index.range_search(unit_rows(x, rows[s:s + BATCH]), radius(t))
        q = s + np.repeat(np.arange(len(lims) - 1), np.diff(lims).astype(np.int64))
        ok = dist >= np.float32(t)
        if not ok.any():
            continue
        q = q[ok]
        ids = ids[ok]
        dist = dist[ok]
        order = np.lexsort((-dist, q))  # per query its best match first (the first of equal ones)
        first = np.r_[True, q[order][1:] != q[order][:-1]]
        for k in order[first].tolist():
            found[int(q[k])] = (int(ids[k]), float(dist[k]))
    return result([(j, eval_keys[e].as_py(), c) for j, (e, c) in found.items()])


# --- the stage's sides ---------------------------------------------------------------------------------------------


def near_stage(root: Path, info: dict) -> dict:
    from vlprep.filter import Decision
    from vlprep.filterembed import NearDup
    from vlprep.filtervec import Source
    from vlprep.output import Out

    rule = NearDup(info["threshold"], Source("image", root / "emb", None, None, 1))
    d = Decision(Out(root / "out"), [], [rule])
    for name, size in info["shards"]:  # what Decision.add leaves for a scan with no sample rule: all kept
        d.shards.append(name)
        d.codes.append(np.zeros(size, np.uint8))
    d.finish()
    starts = np.cumsum([0] + [size for _, size in info["shards"]])
    return result([(int(starts[i] + r), v["match_key"], v["cosine"]) for (i, r), v in d.details.items()])


def exclude_stage(root: Path, info: dict) -> dict:
    from vlprep.filtervec import Vectors, index_over, range_hits

    vec = Vectors(root / "emb", "--embeddings")
    rows = np.concatenate([vec.rows(k) for k in scan_keys(root, info)])  # as Alive looks them up
    ev = Vectors(root / "eval", "--exclude")
    index = index_over(ev, np.arange(len(ev.keys)), "auto")
    where = {}
    for owner, ids, dist in range_hits(index, vec, rows, info["threshold"]):  # as Exclude._near reduces them
        for j in np.unique(owner).tolist():
            m = owner == j
            best = np.flatnonzero(m)[np.argmax(dist[m])]
            where.setdefault(j, (0, int(ids[best]), float(dist[best])))
    return result([(j, ev.keys[k].as_py(), c) for j, (_, k, c) in where.items()])


SIDES = {"near": {"bare": near_bare, "stage": near_stage}, "exclude": {"bare": exclude_bare, "stage": exclude_stage}}


def sides_of(part: str, root: Path, only: str | None = None) -> dict:
    """{"PART-bare": fn(out), "PART-stage": fn(out)}; `only` (a child's side): its modules imported before the clock."""
    info = json.loads((root / "info.json").read_text())
    if only is not None:
        import faiss  # noqa: F401  both sides' search

        if only.endswith("-stage"):
            import vlprep.filter  # noqa: F401
            import vlprep.filterembed  # noqa: F401
    return {f"{part}-{name}": (lambda out, fn=fn: fn(root, info)) for name, fn in SIDES[part].items()}


# --- the run -------------------------------------------------------------------------------------------------------


def measure(part: str, root: Path, info: dict, args) -> tuple[list[dict], dict]:
    """Both sides of one rule over the rounds: the closing table's rows and the raw figures."""
    t = time_sides_figures(sides_of(part, root), args.repeats, root, isolate=True, label=f"{part} ")
    bare = t[f"{part}-bare"]
    stage = t[f"{part}-stage"]
    want = info["near_dup" if part == "near" else "exclude"]
    counts = set(bare["dropped"]) | set(stage["dropped"])
    same = len(set(bare["digest"]) | set(stage["digest"])) == 1
    print(f"  {part}: dropped {sorted(counts)} (planted {want:,}); both sides the same drops and matches: {same}",
          flush=True)
    if counts != {want} or not same:
        sys.exit(f"{part}: the sides disagree or miss the planted ones: {t}")
    what = "near-dup" if part == "near" else "exclude"
    rows = [ratio_row(f"{what} {info['n']:,} x {info['dim']}", bare, stage, TARGET,
                      note=f"{info['n'] / median(stage['wall']):,.0f} vs {info['n'] / median(bare['wall']):,.0f} "
                           "vectors/s")]
    mem = median(stage["peak_mb"]) / median(bare["peak_mb"])
    rows.append(value_row(f"{what} peak RSS ratio", mem, TARGET, "x", higher_is_better=False,
                          note=f"{median(stage['peak_mb']):,.0f} vs {median(bare['peak_mb']):,.0f} MB"))
    print(f"  {what} peak RSS: stage {median(stage['peak_mb']):,.0f} MB, bare {median(bare['peak_mb']):,.0f} MB "
          f"({mem:.2f}x)", flush=True)
    return rows, {"planted": want, "agree": same, "dropped": sorted(counts), "sides": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20,000 vectors, an eval set of 2,000, one round")
    ap.add_argument("--n", type=int, default=1_000_000, help="training vectors")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--eval", type=int, default=10_000, help="eval vectors (decontamination)")
    ap.add_argument("--topics", type=int, default=20_000)
    ap.add_argument("--per-shard", type=int, default=10_000, help="samples per shard (scan table)")
    ap.add_argument("--threshold", type=float, default=0.95, help="--near-dup T")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: near, exclude")
    ap.add_argument("--work", type=Path, default=None, help="folder for the data (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None, help="write the record (rows and every round) here")
    add_options(ap)
    args = ap.parse_args()
    if args.quick:
        args.n = min(args.n, 20_000)
        args.eval = min(args.eval, 2_000)
        args.topics = min(args.topics, 400)
        args.per_shard = min(args.per_shard, 2_000)
        args.repeats = 1
    if args.side is not None:  # an isolated child: one timed call of one side
        run_child_figures(args, sides_of(args.side.split("-")[0], args.side_dir, args.side))
    from vlprep.knn import DEFAULT_NPROBE

    assert DEFAULT_NPROBE == NPROBE, "vlprep.knn's nprobe changed: update NPROBE"
    start = load_line("start")
    print(start, flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-filter-", dir=args.work))
    record = {"date": time.strftime("%Y-%m-%d"), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                           for k, v in vars(args).items()}, "load_start": start}
    try:
        t0 = time.perf_counter()
        info = make_data(root, args)
        kind = "flat" if args.n < FLAT_MAX else f"IVF, nlist {max(1, min(int(4 * math.sqrt(args.n)), args.n // 39))}"
        print(f"  data: {args.n:,} x {args.dim} vectors ({args.topics:,} topics), {info['near_dup'] // 2:,} planted "
              f"triples, eval set {args.eval:,} with {info['exclude']:,} near copies, {len(info['shards'])} shards; "
              f"made in {time.perf_counter() - t0:.0f} s (not timed); index for near-dup: {kind}, nprobe "
              f"{NPROBE}; threshold {args.threshold}; faiss threads {__import__('faiss').omp_get_max_threads()}",
              flush=True)
        record["index"] = kind
        rows = []
        for part in ("exclude", "near"):  # the shorter first
            if part in args.skip.split(","):
                continue
            print(f"{part}: {args.repeats} rounds of alternating order, each call a fresh process", flush=True)
            got, raw = measure(part, root, info, args)
            rows += got
            record[part] = raw
    finally:
        shutil.rmtree(root, ignore_errors=True)
    end = load_line("end")
    print("\n" + end)
    record["load_end"] = end
    record["rows"] = rows
    print_table(rows, "stage")
    print("time rows: baseline = bare faiss (same index and parameters) + plain numpy greedy / best match; "
          "candidate = the stage's code (Decision + NearDup; Vectors + index_over + range_hits). peak RSS rows: "
          "stage / bare, VmHWM of each fresh process")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

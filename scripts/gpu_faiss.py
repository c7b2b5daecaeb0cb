"""The GPU check's faiss step: does the `[gpu]` extra's index path (`faiss.get_num_gpus() > 0`) give the CPU's answers?

    python scripts/gpu_faiss.py CHECK_DIR [--device cuda]    # one row into CHECK_DIR/faiss.jsonl, printed too

The row always says whether `import faiss` works, its version, `faiss.get_num_gpus()` and whether the GPU classes
exist. Without a GPU faiss it says "faiss X.Y without GPU support: not run" and the step passes as skipped. With one:
- knn: vlprep.knn's flat and IVF indexes over 3,000 clustered unit vectors (64-d), 500 queries, k 10, searched on the
  CPU and, copied by `knn.to_gpu`, on GPU 0; per query the neighbour sets must be equal except for ties at the k-th
  place: an id one side has and the other lacks must score within `ip_tolerance` of the other side's k-th score (a
  tie, counted), and a shared id's two scores within the tolerance; anything else is a mismatch.
- pseudolabel: `vlprep pseudolabel` (flat, then IVF) from the same small shards with device cpu and with the GPU
  device; the stage's own queries (as the encoder returned them) searched again in its saved index on both sides and
  compared as above; every output shard and sidecar byte-equal, unless those searches tied or scored apart by
  rounding (a file that differs is named either way).
- near-dup: `vlprep filter --near-dup` builds its index on the CPU only (vlprep.filtervec.index_over, whose
  range_search faiss' GPU indexes may lack), so there is no GPU side to compare; the row says whether a GPU flat
  index answers range_search, the call a GPU path would need.
`compare` and the stage runs take both sides' devices as arguments, so tests/test_gpu_faiss.py runs them CPU against
CPU. Exit status 0 when skipped or equal (ties allowed), 1 when a side differs or a run failed.
"""

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The synthetic data: small enough for well under a minute on a CPU too, big enough that IVF has lists to probe
# (ivf_nlist(3000) = 76 lists, nprobe 32).
N_VECTORS, N_QUERIES, DIM, K, CLUSTERS = 3000, 500, 64, 10, 40
N_ALIGNED, N_UNALIGNED = 600, 40
GPU_CLASSES = ("StandardGpuResources", "GpuIndexFlatIP", "GpuIndexIVFFlat", "index_cpu_to_gpu")
WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()


def probe() -> dict:
    """What this Python's faiss is: importable, version, GPUs it sees, whether its GPU classes exist."""
    try:
        import faiss
    except ImportError as e:
        return {"faiss": None, "gpus": 0, "gpu_classes": False, "import_error": str(e).splitlines()[0]}
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    return {"faiss": faiss.__version__, "gpus": int(gpus), "gpu_classes": all(hasattr(faiss, c) for c in GPU_CLASSES)}


def ip_tolerance(d: int, norm_q: float = 1.0, norm_x: float = 1.0) -> float:
    """How far two float32 computations of one d-term inner product can lie apart: each is within gamma_d * sum|q_i
    x_i| <= gamma_d |q| |x| of the exact value (gamma_d = d u / (1 - d u), u = 2^-24 the unit roundoff; Higham,
    Accuracy and Stability of Numerical Algorithms, section 3.1), whatever the order of the sums, so two of them
    within twice that."""
    u = 2.0 ** -24
    return 2 * d * u / (1 - d * u) * norm_q * norm_x


def compare(scores_a, ids_a, scores_b, ids_b, tol: float) -> dict:
    """Two top-k answers (Q, k) for the same queries: per query, equal neighbour sets; else every id one side lacks
    scored within tol of that side's k-th score (a tie at the cut, counted once per query); a shared id's scores
    within tol. Returns counts and the first few mismatching queries."""
    out = {"queries": len(ids_a), "neighbours": 0, "equal_sets": 0, "tie_queries": 0, "ties": 0, "mismatches": 0,
           "max_score_diff": 0.0, "examples": []}
    for q in range(len(ids_a)):
        a = {int(i): float(s) for i, s in zip(ids_a[q], scores_a[q]) if i >= 0}
        b = {int(i): float(s) for i, s in zip(ids_b[q], scores_b[q]) if i >= 0}
        out["neighbours"] += len(a)
        shared = a.keys() & b.keys()
        diff = max((abs(a[i] - b[i]) for i in shared), default=0.0)
        out["max_score_diff"] = max(out["max_score_diff"], diff)
        ok = diff <= tol and len(a) == len(b)
        only_a, only_b = a.keys() - b.keys(), b.keys() - a.keys()
        if only_a or only_b:
            # an id only A has must not beat B's k-th by more than tol, and the other way round
            ok = ok and all(a[i] <= min(b.values()) + tol for i in only_a) and \
                all(b[i] <= min(a.values()) + tol for i in only_b)
            if ok:
                out["tie_queries"] += 1
                out["ties"] += len(only_a)
        else:
            out["equal_sets"] += 1
        if not ok:
            out["mismatches"] += 1
            if len(out["examples"]) < 3:
                out["examples"].append({"query": q, "only_a": sorted(only_a), "only_b": sorted(only_b),
                                        "score_diff": diff})
    return out


def clustered(n: int, d: int, clusters: int, seed: int) -> np.ndarray:
    """n float32 unit vectors (n, d) around `clusters` random centres: neighbours that matter, as captions have."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d))
    x = centres[rng.integers(0, clusters, n)] + 0.35 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def knn_rows(device: str) -> list[dict]:
    """vlprep.knn's flat and IVF answers on the CPU against the same index moved to `device` (cpu: the same index
    again, how the tests run this)."""
    from vlprep import knn

    x = clustered(N_VECTORS, DIM, CLUSTERS, seed=0)
    queries = clustered(N_QUERIES, DIM, CLUSTERS, seed=1)
    tol = ip_tolerance(DIM)
    rows = []
    for kind in ("flat", "ivf"):
        t0 = time.perf_counter()
        index = knn.build_index(x, kind)
        nprobe = knn.set_nprobe(index, knn.DEFAULT_NPROBE)
        cpu = knn.search(index, queries, K)
        other = knn.to_gpu(index, nprobe) if knn.use_gpu(device) else index
        got = knn.search(other, queries, K)
        row = {"index": kind, "gpu": knn.on_gpu(other), "nprobe": nprobe, "tolerance": tol,
               **compare(cpu[0], cpu[1], got[0], got[1], tol)}
        rows.append({**row, "seconds": round(time.perf_counter() - t0, 3)})
    return rows


class HashEncoder:
    """A deterministic encoder object (docs/PSEUDOLABEL.md's interface) with no model: a caption -> a unit vector
    seeded by its hash; an image view -> its 4x4 mean colours through a fixed random projection. Enough to give the
    stage neighbours to find; the same on every machine. `queries` keeps every image vector it returned: the stage's
    own search queries, searched again on both sides afterwards."""

    def __init__(self, dim: int = DIM):
        self.dim = dim
        self.image_size = 16
        self.min_crop_scale = 0.5
        self.name = "hash"
        self.fingerprint = f"hash:{dim}"
        self.device = "cpu"
        self.info = {"hash": True}
        self.proj = np.random.default_rng(7).standard_normal((48, dim))
        self.queries: list[np.ndarray] = []

    def texts(self, captions: list[str]) -> np.ndarray:
        out = [np.random.default_rng(int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest(), "little"))
               .standard_normal(self.dim) for c in captions]
        x = np.stack(out)
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    def images(self, pixels: np.ndarray) -> np.ndarray:
        p = np.asarray(pixels, np.float64)  # (B, S, S, 3) uint8
        b, s = p.shape[0], p.shape[1]
        cells = p.reshape(b, 4, s // 4, 4, s // 4, 3).mean((2, 4)).reshape(b, 48) / 255.0 - 0.5
        x = cells @ self.proj
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        self.queries.append(x)
        return x


def make_world(root: Path) -> tuple[Path, Path]:
    """(ALIGNED, UNALIGNED): seeded random-pixel PNGs with captions of the WORDS, as vlprep shards."""
    from PIL import Image

    from vlprep.shards import ShardsConfig, build_shards

    rng = random.Random(0)
    made = []
    for name, n, per in (("aligned", N_ALIGNED, 200), ("unaligned", N_UNALIGNED, 20)):
        src = root / f"{name}-src"
        src.mkdir(parents=True)
        pixels = np.random.default_rng(len(name))
        for i in range(n):
            Image.fromarray(pixels.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(src / f"{i:05d}.png")
            (src / f"{i:05d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(6)) + f" number {i}")
        build_shards(ShardsConfig(src=src, out=root / name, samples_per_shard=per, workers=1, prefix=name[:2]))
        made.append(root / name)
    return made[0], made[1]


def output_files(out: Path) -> dict[str, bytes]:
    """The stage's data: its shards and sidecars (meta.json and report.json hold timings and the index's device)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".parquet")
            and not p.name.startswith("knn")}


def pseudolabel_rows(root: Path, device: str) -> list[dict]:
    """`vlprep pseudolabel` (flat, then IVF) with device cpu and with `device`: the files that differ, and the stage's
    own queries (the CPU run's, as the encoder returned them) searched again in its saved index on both sides and
    compared: ties there, or scores apart by rounding, are what may make a file differ."""
    from vlprep import knn
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel

    aligned, unaligned = make_world(root / "data")
    enc = HashEncoder()
    rows = []
    for kind in ("flat", "ivf"):
        t0 = time.perf_counter()
        outs = []
        gpu = None
        for n, side in enumerate(("cpu", device)):
            out = root / f"pseudo-{kind}-{n}-{side}"
            enc.queries = []
            # nprobe 4 of ivf_nlist(600) = 15 lists: the IVF search is not the exhaustive one
            report = pseudolabel(PseudolabelConfig(aligned=aligned, unaligned=unaligned, out=out, index=kind, k=5,
                                                   crops=2, nprobe=4, batch_size=8, device=side, workers=1), enc)
            outs.append(output_files(out))
            gpu = report["index"]["gpu"]
            if n == 0:  # the CPU side: its queries, its index
                queries, saved = np.concatenate(enc.queries), out / "knn.faiss"
        a, b = outs
        differ = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
        index = knn.load_index(saved)
        nprobe = knn.set_nprobe(index, 4)
        cpu = knn.search(index, queries, 5)
        got = knn.search(knn.to_gpu(index, nprobe) if knn.use_gpu(device) else index, queries, 5)
        rows.append({"index": kind, "gpu": gpu, "files": len(a), "files_differ": differ,
                     **compare(cpu[0], cpu[1], got[0], got[1], ip_tolerance(DIM)),
                     "seconds": round(time.perf_counter() - t0, 3)})
    return rows


def gpu_range_search() -> str:
    """Whether a GPU flat index answers range_search (what a GPU near-dup index would need)."""
    from vlprep import knn

    x = clustered(100, DIM, 4, seed=2)
    index = knn.build_index(x, "flat")
    try:
        knn.to_gpu(index).range_search(x[:4], 0.9)
    except Exception as e:  # faiss raises RuntimeError from C++ ("not implemented"); its text is the answer
        return "no: " + str(e).strip().splitlines()[-1][:160]
    return "yes"


def faiss_row(work: Path, device: str = "cuda") -> dict:
    """The step's row: the probe, then (with a GPU faiss, or device cpu for a CPU-against-CPU run) the comparisons."""
    t0 = time.perf_counter()
    row = {"kind": "faiss", **probe(), "device": device}
    if row["faiss"] is None:
        return {**row, "status": "skipped", "note": f"faiss not importable ({row['import_error']}): not run",
                "seconds": round(time.perf_counter() - t0, 3)}
    if device != "cpu" and not (row["gpus"] > 0 and row["gpu_classes"]):
        why = "without GPU support" if not row["gpu_classes"] else "sees no GPU"
        return {**row, "status": "skipped", "note": f"faiss {row['faiss']} {why}: not run",
                "seconds": round(time.perf_counter() - t0, 3)}
    row["knn"] = knn_rows(device)
    row["pseudolabel"] = pseudolabel_rows(work, device)
    searches = row["knn"] + row["pseudolabel"]
    row["near_dup"] = ("CPU only in vlprep (filtervec.index_over, range_search): nothing to compare; GPU flat "
                       "range_search: " + (gpu_range_search() if device != "cpu" else "not asked (device cpu)"))
    ties = sum(r["ties"] for r in searches)
    bad = sum(r["mismatches"] for r in searches)
    differ = [f"{r['index']}:{n}" for r in row["pseudolabel"] for n in r["files_differ"]]
    # a file may differ only where the stage's own searches tied at the cut or scored apart by rounding (its
    # neighbour order breaks equal hit counts by score)
    explained = all(r["ties"] or r["max_score_diff"] > 0 for r in row["pseudolabel"] if r["files_differ"])
    row["status"] = "ok" if bad == 0 and explained else "FAILED"
    row["note"] = (f"{sum(r['neighbours'] for r in searches)} neighbours compared (knn and the stage's queries), "
                   f"{ties} tied at the k-th place, {bad} mismatched; pseudolabel "
                   f"{sum(r['files'] for r in row['pseudolabel'])} files, {len(differ)} differ"
                   + (f" ({', '.join(differ[:4])})" if differ else ""))
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="The GPU check's faiss step (one row into CHECK_DIR/faiss.jsonl).")
    ap.add_argument("check", type=Path)
    ap.add_argument("--device", default="cuda", help="the other side's device (cpu: compare the CPU with itself)")
    args = ap.parse_args(argv)
    work = args.check / "faiss-work"
    work.mkdir(parents=True, exist_ok=True)
    try:
        row = faiss_row(work, args.device)
    except Exception as e:  # a failed run is a row that says so, and the report still shows it
        row = {"kind": "faiss", **probe(), "device": args.device, "status": "FAILED",
               "note": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    with open(args.check / "faiss.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print("faiss: " + json.dumps(row))
    return 0 if row["status"] in ("ok", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

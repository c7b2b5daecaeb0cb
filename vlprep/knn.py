"""FAISS inner-product kNN over L2-normalised embeddings for `vlprep pseudolabel`: flat or IVF, GPU when present.

- `flat`: faiss.IndexFlatIP, exact.
- `ivf`: faiss.IndexIVFFlat (inner product) with nlist = ivf_nlist(N) lists, trained by faiss' spherical k-means
  (10 iterations, seed 1234) on at most TRAIN_PER_LIST * nlist vectors that faiss samples; searched with nprobe
  lists (DEFAULT_NPROBE unless given).
- `auto`: flat below FLAT_MAX vectors, IVF from there on (docs/PSEUDOLABEL.md has the measurements behind it).
- GPU: when faiss has GPUs (`faiss.get_num_gpus() > 0`, i.e. faiss-gpu and a CUDA device) and the stage's device
  is not cpu, the index is copied to GPU 0 for the search; the saved file is always the CPU form.
"""

import math
import os
from pathlib import Path

import numpy as np

INDEX_KINDS = ("auto", "flat", "ivf")
# Below this many captions an exact flat search costs a few percent of the image encoder's forward per crop, so
# exactness is free; above it IVF's speed-up pays.
FLAT_MAX = 100_000
DEFAULT_NPROBE = 32
KMEANS_SEED = 1234
TRAIN_PER_LIST = 64  # k-means sample per list (faiss' default 256 makes a 1M-caption index train 4x longer)


def _faiss():
    try:
        import faiss
    except ImportError as e:  # faiss comes from an extra (pyproject.toml says why)
        from vlprep import VlprepError

        raise VlprepError(f"faiss is not installed ({e}): pip install 'vlprep-vltrain[cpu]', or [gpu] on a CUDA "
                          "machine (one of the two, into a fresh venv)") from None
    return faiss


def ivf_nlist(n: int) -> int:
    """IVF list count for n vectors: 4 sqrt(n) (faiss' guideline), at most n // 39 (k-means wants >= 39 per list)."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


def choose_kind(kind: str, n: int) -> str:
    """Resolve 'auto' to 'flat' (n < FLAT_MAX) or 'ivf'."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"index must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
    if kind == "auto":
        return "flat" if n < FLAT_MAX else "ivf"
    return kind


def build_index(x: np.ndarray, kind: str = "auto", nlist: int | None = None):
    """A CPU inner-product index over rows of x (N, d) float32 (rows should be L2-normalised); ids are row numbers."""
    faiss = _faiss()
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    kind = choose_kind(kind, n)
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    else:
        nlist = nlist or ivf_nlist(n)
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.spherical = True  # centroids on the sphere, like the data
        index.cp.seed = KMEANS_SEED
        index.cp.max_points_per_centroid = TRAIN_PER_LIST
        index.train(x)  # faiss' Python wrapper keeps `quantizer` alive with the index
    index.add(x)
    return index


def kind_of(index) -> str:
    """'ivf' or 'flat' for a CPU index (ask before moving it to a GPU: nothing here copies it back)."""
    return "ivf" if _faiss().try_extract_index_ivf(index) is not None else "flat"


def nlist(index) -> int:
    """Number of inverted lists of a CPU IVF index."""
    return _faiss().extract_index_ivf(index).nlist


def on_gpu(index) -> bool:
    return "Gpu" in type(index).__name__


def use_gpu(device: str) -> bool:
    """True when faiss can put the index on a GPU and the user did not ask for the CPU."""
    faiss = _faiss()
    return device != "cpu" and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def set_nprobe(index, nprobe: int) -> int:
    """Set a CPU IVF index's nprobe (clamped to its nlist); returns the value used, 0 for a flat index."""
    if kind_of(index) != "ivf":
        return 0
    nprobe = max(1, min(nprobe, nlist(index)))
    _faiss().ParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    return nprobe


def to_gpu(index, nprobe: int = 0):
    """A copy of a CPU index on GPU 0, with nprobe set again there (the GPU resources live on the returned index)."""
    faiss = _faiss()
    res = faiss.StandardGpuResources()
    gpu = faiss.index_cpu_to_gpu(res, 0, index)
    gpu._res = res
    if nprobe:
        faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", nprobe)
    return gpu


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by inner product: queries (Q, d) -> scores (Q, k) float32, ids (Q, k) int64 (-1 where fewer than k)."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    return index.search(q, k)


def save_index(index, path: Path) -> None:
    """Write the CPU form of the index atomically."""
    faiss = _faiss()
    tmp = path.with_name(path.name + ".tmp")
    faiss.write_index(faiss.index_gpu_to_cpu(index) if on_gpu(index) else index, str(tmp))
    os.replace(tmp, path)


def load_index(path: Path):
    return _faiss().read_index(str(path))

"""FAISS inner-product kNN over L2-normalised embeddings for `vlprep pseudolabel`: flat or IVF, GPU when present.

- `flat`: faiss.IndexFlatIP, exact.
- `ivf`: faiss.IndexIVFFlat (inner product) with nlist = ivf_nlist(N) lists, trained by faiss' spherical k-means
  (10 iterations, seed 1234) on at most TRAIN_PER_LIST * nlist vectors that faiss samples; searched with nprobe
  lists (DEFAULT_NPROBE unless given).
- `auto`: flat below FLAT_MAX vectors, IVF from there on (docs/PSEUDOLABEL.md has the measurements behind it).
- GPU: when faiss has GPUs (`faiss.get_num_gpus() > 0`, i.e. faiss-gpu and a CUDA device) and the stage's device
  is not cpu, the index is copied to GPU 0 for the search; the saved file is always the CPU form.
- The caption table: what a retrieved row id stands for (its key and its caption's word ids, with the vocabulary and
  each word's document frequency), in .npy files that every process memory-maps (`CaptionTable`), so the pages are
  shared and a worker's Python heap holds the vocabulary only.
"""

import json
import math
import os
from collections.abc import Iterable
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


class IndexBuilder:
    """`build_index` over n rows that come in batches (`add`, then `finish`)."""

    def __init__(self, kind: str, n: int, d: int):
        self.kind = choose_kind(kind, n)
        self.n = n
        # a flat index takes each batch as it comes, so no (n, d) array is held; IVF's k-means trains on every row,
        # gathered into one array first
        self.flat = _faiss().IndexFlatIP(d) if self.kind == "flat" else None
        self.rows = None if self.flat is not None else np.empty((n, d), dtype=np.float32)
        self.done = 0

    def add(self, x: np.ndarray) -> None:
        """Append rows of x (B, d)."""
        if self.flat is not None:
            self.flat.add(np.ascontiguousarray(x, dtype=np.float32))
        else:
            self.rows[self.done:self.done + len(x)] = x
        self.done += len(x)

    def finish(self):
        """The index over the n rows added."""
        if self.done != self.n:
            raise ValueError(f"IndexBuilder: {self.done} rows added, {self.n} announced")
        return self.flat if self.flat is not None else build_index(self.rows, self.kind)


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


# --- the caption table ----------------------------------------------------------------------------------------------

# Row j's word ids are WORD_IDS[WORD_OFFSETS[j]:WORD_OFFSETS[j + 1]] (int32, sorted by word), its key the UTF-8 bytes
# KEY_BYTES[KEY_OFFSETS[j]:KEY_OFFSETS[j + 1]]; VOCAB holds the words by id, their document frequencies and the
# fingerprint of the index the table belongs to.
WORD_IDS = "knn_word_ids.npy"
WORD_OFFSETS = "knn_word_offsets.npy"
KEY_BYTES = "knn_key_bytes.npy"
KEY_OFFSETS = "knn_key_offsets.npy"
VOCAB = "knn_vocab.json"
# What a pseudolabel worker opens, in the order a worker on another machine fetches them from a URL OUT: the
# vocabulary (which holds the fingerprint) last, so a matching fingerprint there means every file is whole.
INDEX_FILES = ("knn.faiss", WORD_IDS, WORD_OFFSETS, KEY_BYTES, KEY_OFFSETS, VOCAB)


class NpyAppender:
    """A 1-D .npy file written in pieces, under PATH.tmp until `close` puts the final length in its header."""

    def __init__(self, path: Path, dtype: str):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.dtype = np.dtype(dtype)
        self.n = 0
        self.f = open(self.tmp, "wb")
        self._header()
        self.data_start = self.f.tell()

    def _header(self) -> None:
        # numpy pads the header to 64-byte multiples: 128 bytes for any 1-D length below 10**18, so the final header
        # fits where the first one was written
        np.lib.format.write_array_header_1_0(self.f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                      "fortran_order": False, "shape": (self.n,)})

    def append(self, values) -> None:
        a = np.ascontiguousarray(values, dtype=self.dtype)
        self.f.write(a.tobytes())
        self.n += a.size

    def close(self) -> None:
        self.f.seek(0)
        self._header()
        if self.f.tell() != self.data_start:
            raise RuntimeError(f"{self.path.name}: the .npy header grew past its first size")
        self.f.close()
        os.replace(self.tmp, self.path)


class CaptionTableWriter:
    """Writes the caption table of OUT (`root`) a shard of rows at a time (`with`, or `close`); holds the vocabulary."""

    def __init__(self, root: Path, fingerprint: str):
        self.root = root
        self.fingerprint = fingerprint
        self.ids = {}  # word -> id, in order of first appearance
        self.df = []
        self.files = {name: NpyAppender(root / name, dtype) for name, dtype in
                      ((WORD_IDS, "<i4"), (WORD_OFFSETS, "<i8"), (KEY_BYTES, "|u1"), (KEY_OFFSETS, "<i8"))}
        self.word_end = 0
        self.key_end = 0
        self.files[WORD_OFFSETS].append([0])
        self.files[KEY_OFFSETS].append([0])

    def add(self, keys: list[str], words: Iterable[Iterable[str]]) -> None:
        """Append rows: their keys and each row's set of words."""
        ids = []
        word_ends = []
        for ws in words:
            for w in sorted(ws):
                i = self.ids.setdefault(w, len(self.ids))
                if i == len(self.df):
                    self.df.append(0)
                self.df[i] += 1
                ids.append(i)
            word_ends.append(self.word_end + len(ids))
        encoded = [k.encode() for k in keys]
        self.files[WORD_IDS].append(ids)
        self.files[WORD_OFFSETS].append(word_ends)
        self.files[KEY_BYTES].append(np.frombuffer(b"".join(encoded), dtype=np.uint8))
        self.files[KEY_OFFSETS].append(self.key_end + np.cumsum([len(k) for k in encoded], dtype=np.int64))
        self.word_end += len(ids)
        self.key_end += sum(len(k) for k in encoded)

    def __enter__(self) -> "CaptionTableWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:  # the .tmp files stay for the next run of the stage to remove
            for f in self.files.values():
                f.f.close()

    def close(self) -> None:
        """Finish the arrays, then the vocabulary (with the fingerprint: the table is current once it is there)."""
        for f in self.files.values():
            f.close()
        tmp = self.root / (VOCAB + ".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "words": list(self.ids), "df": self.df}))
        os.replace(tmp, self.root / VOCAB)


def table_fingerprint(root: Path) -> str | None:
    """The fingerprint the caption table in `root` was written for, None when there is none."""
    try:
        return json.loads((root / VOCAB).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


class Keys:
    """The keys of a caption table by row id (`keys[j]`), decoded on demand from the mapped bytes."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = data
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> str:
        return self.data[self.offsets[j]:self.offsets[j + 1]].tobytes().decode()


class CaptionTable:
    """The caption table of OUT (`root`): arrays memory-mapped read-only, the vocabulary (words, df) in memory."""

    def __init__(self, root: Path):
        meta = json.loads((root / VOCAB).read_text())
        self.vocab = meta["words"]
        self.df = np.asarray(meta["df"], dtype=np.int64)
        self.word_ids = np.load(root / WORD_IDS, mmap_mode="r")
        self.word_offsets = np.load(root / WORD_OFFSETS, mmap_mode="r")
        self.keys = Keys(np.load(root / KEY_BYTES, mmap_mode="r"), np.load(root / KEY_OFFSETS, mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.word_offsets) - 1

    def words(self, j: int) -> list[str]:
        """Row j's words, in word order."""
        return [self.vocab[i] for i in self.word_ids[self.word_offsets[j]:self.word_offsets[j + 1]].tolist()]

    def word_counts(self, rows: np.ndarray) -> tuple[dict[str, int], dict[str, int]]:
        """({word: rows holding it}, {word: document frequency}) over rows (c, k); a repeat counts again, -1 not."""
        js = [j for j in rows.ravel().tolist() if j >= 0]
        if not js:
            return {}, {}
        ends = self.word_offsets
        ids, counts = np.unique(np.concatenate([self.word_ids[ends[j]:ends[j + 1]] for j in js]), return_counts=True)
        ids = ids.tolist()
        return ({self.vocab[i]: c for i, c in zip(ids, counts.tolist())},
                {self.vocab[i]: d for i, d in zip(ids, self.df[ids].tolist())})

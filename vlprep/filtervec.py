"""`vlprep filter`'s vectors: `vlprep embed` outputs checked (modality, encoder, dimension, unique keys) and looked
up by key, and the greedy near-duplicate search.

docs/FILTER.md is the contract. Vectors come from `vlprep embed` outputs (embeddings.npy, memory-mapped, and
keys.parquet), given or made under OUT/_embed/ with an encoder object. Per sample the driver holds a 64-bit hash of
each vector's key and its sort order, the row a sample's vector is in (8 bytes each) and a byte of state; the
vectors themselves are in the memory map and in FAISS' index (CPU: FAISS' GPU indexes have no range search).
"""

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlprep import VlprepError, objstore
from vlprep.filterscan import read_scan
from vlprep.urls import redact

QUERY_BATCH = 4096  # range-search queries per FAISS call: bounds the result buffers, whatever N is
KEY_CHUNK = 4096  # keys hashed at a time: the Python strings of one chunk at most
EMBED_DIR = "_embed"


def key_hashes(keys: pa.Array) -> np.ndarray:
    """The 64-bit hash `vlprep shards` keeps per uid (shards.uid_hashes) of each key, a chunk at a time."""
    from vlprep.shards import uid_hashes

    out = np.empty(len(keys), np.uint64)
    for s in range(0, len(keys), KEY_CHUNK):
        part = keys.slice(s, KEY_CHUNK).to_pylist()
        out[s:s + len(part)] = uid_hashes(part)
    return out


def check_embed_output(folder, flag: str) -> None:
    """A one-line error unless `folder` is a `vlprep embed` output (embeddings.npy and keys.parquet)."""
    if not ((Path(folder) / "embeddings.npy").is_file() and (Path(folder) / "keys.parquet").is_file()):
        raise VlprepError(f"{flag} {folder}: not a `vlprep embed` output (needs embeddings.npy and keys.parquet)")


def embed_meta(folder) -> dict:
    """A `vlprep embed` output's meta.json (its options, encoder record and fingerprint); {} when it has none that
    reads as a JSON object (an older or hand-made output)."""
    try:
        data = json.loads((Path(folder) / "meta.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def embeddings_dim(folder, flag: str) -> int:
    """The dimension of a `vlprep embed` output's vectors (from embeddings.npy's header), or a one-line error."""
    try:
        x = np.load(Path(folder) / "embeddings.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise VlprepError(f"{flag} {redact(str(folder))}: embeddings.npy does not read as a .npy array ({e})") from None
    if x.ndim != 2:
        raise VlprepError(f"{flag} {redact(str(folder))}: embeddings.npy has shape {x.shape}, not (N, E)")
    return int(x.shape[1])


def encoder_record(folder, flag: str) -> tuple[object, str | None]:
    """The encoder a `vlprep embed` output's meta.json records (its checkpoint and model) and the checkpoint file's
    fingerprint (None in outputs written before it was recorded), or a one-line error."""
    data = embed_meta(folder)
    record = data.get("encoder")
    if record is None:
        raise VlprepError(f"{flag} {redact(str(folder))}: no meta.json naming its encoder (a `vlprep embed` output "
                          "has one)")
    return record, data.get("encoder_fingerprint")


def same_encoder(folder, flag: str, ref, ref_flag: str) -> None:
    """A one-line error unless two `vlprep embed` outputs' meta.json record one encoder (and, where both have it,
    one checkpoint fingerprint)."""
    have, have_fp = encoder_record(folder, flag)
    want, want_fp = encoder_record(ref, ref_flag)
    # the fingerprint (the checkpoint file's size and mtime) tells a checkpoint retrained in place from itself
    if have != want or None not in (have_fp, want_fp) and have_fp != want_fp:
        name = lambda r: r.get("checkpoint", r) if isinstance(r, dict) else r  # noqa: E731
        if have == want:
            raise VlprepError(f"{flag} {redact(str(folder))} and {ref_flag} {redact(str(ref))} were made by "
                              f"{name(want)} as it was at two times (the file changed in between): embed both with "
                              "it as it is now")
        raise VlprepError(f"{flag} {redact(str(folder))} was made by {name(have)}, {ref_flag} {redact(str(ref))} by "
                          f"{name(want)}: both must come from one checkpoint")


def check_exclude_embeddings(cfg, encoder) -> None:
    """--exclude-embeddings: one per --exclude, with --near-dup and --embeddings made by the same checkpoint."""
    given = cfg.exclude_embeddings
    if not given:
        return
    if len(given) != len(cfg.exclude):
        raise VlprepError(f"--exclude-embeddings is one per --exclude, in the same order: got {len(given)} for "
                          f"{len(cfg.exclude)} --exclude")
    if cfg.near_dup is None or cfg.embeddings is None or encoder is not None:
        raise VlprepError("--exclude-embeddings goes with --near-dup and --embeddings (with --checkpoint the eval "
                          "sets are embedded by it)")
    for folder in given:
        check_embed_output(folder, "--exclude-embeddings")
        same_encoder(folder, "--exclude-embeddings", cfg.embeddings, "--embeddings")


def check_given_vectors(cfg, warn: Callable[[str], None]) -> None:
    """The `vlprep embed` outputs given: each of the modality its option takes, one dimension for all, and the image
    and text vectors of the CLIP score from one encoder. An output whose meta.json records no modality or encoder (an
    older or hand-made one) cannot be checked: a warning says so."""
    given = [(cfg.embeddings, "--embeddings", "image"), (cfg.text_embeddings, "--text-embeddings", "text")]
    given += [(folder, "--exclude-embeddings", "image") for folder in cfg.exclude_embeddings]
    dims = []
    for folder, flag, want in given:
        if folder is None:
            continue
        check_embed_output(folder, flag)
        shown = f"{flag} {redact(str(folder))}"
        have = (embed_meta(folder).get("options") or {}).get("modality")
        if have is None:
            warn(f"{shown}: its meta.json records no modality (an older or hand-made output); its vectors are taken "
                 f"as {want} embeddings unchecked")
        elif have != want:
            raise VlprepError(f"{shown} holds {have} embeddings (its meta.json says so); {flag} takes a `vlprep embed "
                              f"--modality {want}` output")
        dims.append((embeddings_dim(folder, flag), shown))
    for dim, shown in dims[1:]:
        if dim != dims[0][0]:
            raise VlprepError(f"{shown} has {dim}-dimensional vectors, {dims[0][1]} {dims[0][0]}-dimensional: they "
                              "must come from one encoder")
    if cfg.embeddings is None or cfg.text_embeddings is None:
        return
    unrecorded = [f for f, folder in (("--embeddings", cfg.embeddings), ("--text-embeddings", cfg.text_embeddings))
                  if embed_meta(folder).get("encoder") is None]
    if unrecorded:
        warn(f"{' and '.join(unrecorded)}: meta.json records no encoder, so nothing checks that the image and text "
             "vectors come from one checkpoint (a CLIP score of two encoders' vectors means nothing)")
        return
    same_encoder(cfg.text_embeddings, "--text-embeddings", cfg.embeddings, "--embeddings")


class Vectors:
    """A `vlprep embed` output opened for lookups: keys (Arrow), rows memory-mapped, key hashes sorted."""

    def __init__(self, folder: Path, flag: str):
        folder = Path(folder)
        check_embed_output(folder, flag)
        self.flag = f"{flag} {folder}"
        self.keys = pq.read_table(folder / "keys.parquet", columns=["key"]).column(0).combine_chunks()
        self.x = np.load(folder / "embeddings.npy", mmap_mode="r")
        if self.x.ndim != 2 or len(self.x) != len(self.keys):
            raise VlprepError(f"{self.flag}: embeddings.npy has shape {self.x.shape}, keys.parquet "
                              f"{len(self.keys)} rows")
        hashes = key_hashes(self.keys)
        self.order = np.argsort(hashes, kind="stable")
        hashes.sort()  # in place: equal hashes are equal values, so this is hashes[order] without a second array
        self.sorted = hashes
        self._check_unique()
        info = embed_meta(folder)
        self.identity = {"folder": str(folder), "rows": len(self.keys), "dim": int(self.x.shape[1]),
                         "keys_blake2b": hashlib.blake2b((folder / "keys.parquet").read_bytes(),
                                                         digest_size=16).hexdigest(),
                         "encoder": info.get("encoder"), "modality": (info.get("options") or {}).get("modality")}

    def _check_unique(self) -> None:
        """A one-line error naming a key that keys.parquet lists twice (a sample would get another's vector); only
        the rows whose 64-bit hash another row shares are compared in full."""
        same = np.flatnonzero(self.sorted[1:] == self.sorted[:-1])
        if not same.size:
            return
        seen: dict[str, int] = {}
        for r in np.sort(self.order[np.union1d(same, same + 1)]).tolist():
            key = self.keys[r].as_py()
            if key in seen:
                raise VlprepError(f"{self.flag}: key {key!r} is in keys.parquet twice (rows {seen[key]} and {r}); "
                                  "keys are unique, so a `vlprep embed` output has one row per key")
            seen[key] = r

    def rows(self, keys: pa.Array) -> np.ndarray:
        """Each key's row (keys are unique: _check_unique), -1 where it has none; a 64-bit hash match is checked in
        full."""
        if not len(self.sorted):
            return np.full(len(keys), -1, np.int64)
        h = key_hashes(keys)
        pos = np.minimum(np.searchsorted(self.sorted, h), len(self.sorted) - 1)
        rows = np.where(self.sorted[pos] == h, self.order[pos], -1).astype(np.int64)
        found = np.flatnonzero(rows >= 0)
        if found.size:
            same = pc.equal(self.keys.take(pa.array(rows[found])), keys.take(pa.array(found))).to_numpy(False)
            for j in found[~same].tolist():  # two keys with one 64-bit hash: look the key up in full
                rows[j] = pc.index(self.keys, keys[j]).as_py()
        return rows

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows as contiguous float32, L2-normalised (a no-op up to rounding for vlprep embed's own output)."""
        x = np.asarray(self.x[rows], dtype=np.float32)
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        return np.ascontiguousarray(x / np.maximum(norm, np.float32(1e-12)))


class Source:
    """Where a modality's vectors come from: a given folder, or made under OUT/_embed/ by the encoder (once)."""

    def __init__(self, modality: str, folder: Path | None, encoder, src, workers: int, distributor: str = "local"):
        self.modality = modality
        self.folder = folder
        self.encoder = encoder
        self.src = src
        self.workers = workers
        self.distributor = distributor
        self.vectors: Vectors | None = None

    def open(self, out, progress=None) -> Vectors:
        if self.vectors is None:
            folder = self.folder
            flag = "--embeddings" if self.modality == "image" else "--text-embeddings"
            if folder is None:
                folder = embed_under(out, self.src, self.encoder, self.modality, self.modality, self.workers, progress,
                                     self.distributor)
                flag = "--checkpoint"
            self.vectors = Vectors(folder, flag)
        return self.vectors

    def stamp(self) -> list:
        """What the vectors' content follows: a given file's size and mtime, or the encoder (a function of it)."""
        if self.folder is None:
            return ["encoder", self.encoder.fingerprint, self.modality]
        st = os.stat(Path(self.folder) / "embeddings.npy")
        return [st.st_size, st.st_mtime_ns]

    def identity(self) -> dict:
        if self.folder is not None:
            return {"embeddings": redact(str(self.folder))}
        return {"checkpoint": self.encoder.name, "fingerprint": self.encoder.fingerprint}


def embed_under(out, src, encoder, modality: str, name: str, workers: int, progress=None,
                distributor: str = "local") -> Path:
    """`vlprep embed` of SRC into OUT/_embed/NAME with the encoder (a re-run resumes there: nothing encoded twice);
    the local folder that holds its output. For a URL OUT the embed output is OUT/_embed/NAME in object storage (its
    workers may run on other machines; its per-shard parts there are the cache a re-run resumes from), and its
    three files are then downloaded into the driver's staging folder, which the driver alone reads."""
    from vlprep.embed import EmbedConfig, embed

    folder = out.root / EMBED_DIR / name
    folder.parent.mkdir(exist_ok=True)
    target = folder if out.url is None else objstore.join(out.url, f"{EMBED_DIR}/{name}")
    # overwrite: the folder is this stage's cache; other options (another encoder) replace it, equal ones resume
    embed(EmbedConfig(src=src, out=target, modality=modality, workers=workers, distributor=distributor,
                      overwrite=True), encoder, progress=progress)
    if out.url is not None:
        folder.mkdir(exist_ok=True)
        for file in ("embeddings.npy", "keys.parquet", "meta.json"):
            objstore.get_file(objstore.join(target, file), folder / file)
    return folder


class Alive:
    """The samples the earlier rules kept, in dataset order: their vector rows (8 bytes each) and per-shard counts."""

    def __init__(self, d, vec: Vectors):
        self.counts = []
        parts = []
        for i, shard in enumerate(d.shards):
            mask = d.codes[i] == 0
            self.counts.append(int(mask.sum()))
            if not mask.any():
                continue
            keys = read_scan(d.out, shard, ["key"]).column(0).combine_chunks().filter(pa.array(mask))
            rows = vec.rows(keys)
            missing = np.flatnonzero(rows < 0)
            if missing.size:
                raise VlprepError(f"{vec.flag}: no embedding for key {keys[int(missing[0])].as_py()!r} of shard "
                                  f"{shard} (the embeddings must come from `vlprep embed` over SRC)")
            parts.append(rows)
        self.rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def place(self, d, positions: np.ndarray):
        """(shard index, row) of each alive position (sorted), in order."""
        return places(d, self.starts, positions)


def places(d, starts: np.ndarray, positions: np.ndarray):
    """(shard index, row) of each sorted position among the kept samples (shard i's from starts[i]), in order."""
    for i in range(len(d.shards)):
        here = positions[(positions >= starts[i]) & (positions < starts[i + 1])]
        if here.size:
            local = np.flatnonzero(d.codes[i] == 0)
            yield from ((i, int(r)) for r in local[here - starts[i]])


def radius(threshold: float) -> float:
    # FAISS keeps inner products above the radius; one float32 step lower, then `>= threshold` decides exactly
    return float(np.nextafter(np.float32(threshold), np.float32(-np.inf)))


def index_over(vec: Vectors, rows: np.ndarray, kind: str):
    """A CPU inner-product index over the given rows (flat or IVF as vlprep.knn chooses), added a batch at a time."""
    from vlprep.knn import DEFAULT_NPROBE, IndexBuilder, set_nprobe

    builder = IndexBuilder(kind, len(rows), vec.x.shape[1])
    for s in range(0, len(rows), QUERY_BATCH):
        builder.add(vec.gather(rows[s:s + QUERY_BATCH]))
    index = builder.finish()
    set_nprobe(index, DEFAULT_NPROBE)
    return index


def range_hits(index, vec: Vectors, rows: np.ndarray, threshold: float):
    """Per batch of QUERY_BATCH query positions (rows[j] is position j's vector): (query position, index id,
    cosine) of every pair at cosine >= threshold."""
    t = np.float32(threshold)
    for s in range(0, len(rows), QUERY_BATCH):
        lims, dist, ids = index.range_search(vec.gather(rows[s:s + QUERY_BATCH]), radius(threshold))
        owner = s + np.repeat(np.arange(len(lims) - 1), np.diff(lims).astype(np.int64))
        ok = dist >= t
        yield owner[ok], ids[ok], dist[ok]


def near_dup_greedy(vec: Vectors, rows: np.ndarray, threshold: float, kind: str = "auto"):
    """The greedy rule over positions 0..n-1 (rows[j] is position j's vector): j is dropped when an earlier KEPT
    position i < j has cosine >= threshold. Returns (dropped positions, the most similar such i, its cosine)."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    index = index_over(vec, rows, kind)
    dropped, partner, cos = greedy(n, range_hits(index, vec, rows, threshold))
    return dropped, partner, cos.astype(np.float32)


def greedy(n: int, batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy rule over positions 0..n-1, fed batches of near pairs (query position, other position, score;
    higher is nearer) whose query positions ascend from batch to batch: j is dropped when a near i < j is still
    kept. Returns (dropped positions, the nearest such i, the earliest on equal scores; its score)."""
    keep = np.ones(n, bool)
    found = ([], [], [])
    for owner, ids, dist in batches:
        hit = ids < owner
        owner = owner[hit]
        ids = ids[hit]
        dist = dist[hit]
        if not owner.size:
            continue
        order = np.lexsort((ids, owner))  # a query's earlier neighbours in position order
        owner = owner[order]
        ids = ids[order]
        dist = dist[order]
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        ends = np.r_[starts[1:], owner.size]
        for a, b in zip(starts.tolist(), ends.tolist()):  # in position order: a drop here decides later queries
            kept = keep[ids[a:b]]
            if kept.any():
                j = int(owner[a])
                keep[j] = False
                best = a + int(np.argmax(np.where(kept, dist[a:b], -np.inf)))  # first of the highest: earliest
                found[0].append(j)
                found[1].append(int(ids[best]))
                found[2].append(float(dist[best]))
    return (np.array(found[0], np.int64), np.array(found[1], np.int64), np.array(found[2], np.float64))

"""Samples by global index for the index samplers: IndexedShards (a compact per-shard member table, read shard by
shard), InstanceView.

Why not wids' random access, which this replaced: wids keeps a few shards indexed (an LRU of 16) and re-indexes a
shard on every miss, scanning all of its member headers in Python. GRIT's and TOnICS' batches draw from the whole
dataset, so past a few dozen shards nearly every sample was a miss, and a miss costs a whole shard's headers.
Here each shard's headers are scanned once per process, with vlprep's reader and its safety checks, into three
numpy arrays (each member's offset, size and extension), kept for the run: 8 bytes per sample plus 18 per member,
about 60 bytes a sample of image, caption and json. A batch's samples are then read in shard order, one open per
shard, and handed over in the sampler's order; the bytes are wids' (a reference test reads both).
"""

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from vlprep import VlprepError
from vlprep.dataset import REMAKE_HINT, BadShardError, iter_tar, open_dataset, plain_shard_name, short_shard
from vltrain.data.samples import FIRST, EpochCounter, LoadCounts, load_sample, reseed_worker, skip_reason, token_shape


class KeyArray:
    """The keys of every sample as one fixed-width bytes array (about one byte per key character), not a list of str:
    no per-sample Python object for DataLoader workers to inherit and touch."""

    def __init__(self, parts: list[np.ndarray]):
        self.array = np.concatenate(parts) if parts else np.empty(0, dtype="S1")

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: int) -> str:
        return self.array[i].decode()

    def __iter__(self):
        return (k.decode() for k in self.array)


class _Every:
    """iter_tar's `refs` holding every extension: a header scan that yields where each member lies, never its bytes."""

    def __contains__(self, ext: str) -> bool:
        return True


class ShardIndex(NamedTuple):
    """Where the members of each sample of one shard lie: sample j's members are starts[j]:starts[j + 1]."""

    starts: np.ndarray   # (n + 1,) int64
    offsets: np.ndarray  # (members,) int64: the first byte of each member's data
    sizes: np.ndarray    # (members,) int64
    exts: np.ndarray     # (members,) uint16: each member's extension, an index into names
    names: tuple         # the shard's distinct extensions


def scan_shard(path: Path) -> tuple[ShardIndex, list[str]]:
    """The member table of one shard and its keys in tar order, from its headers alone (vlprep.dataset.iter_tar:
    no pickles, no unsafe names; a tar tarfile cannot read is a BadShardError)."""
    starts = [0]
    offsets = []
    sizes = []
    exts = []
    names = {}
    keys = []
    for sample in iter_tar(path, refs=_Every()):
        for ext, ref in sample.items():
            if not ext.startswith("__"):
                exts.append(names.setdefault(ext, len(names)))
                offsets.append(ref.offset)
                sizes.append(ref.size)
        starts.append(len(offsets))
        keys.append(sample["__key__"])
    table = ShardIndex(np.asarray(starts, dtype=np.int64), np.asarray(offsets, dtype=np.int64),
                       np.asarray(sizes, dtype=np.int64), np.asarray(exts, dtype=np.uint16), tuple(names))
    return table, keys


class IndexedShards:
    """Raw samples of dataset folders by global index (folder order, then shard order, as index.json lists them)."""

    def __init__(self, folders):
        datasets = [open_dataset(f) for f in folders]
        for ds in datasets:
            if ds.url:  # random access wants local files (docs/SCALE.md: index samplers need local shards)
                raise VlprepError(f"{ds.url}: the index samplers (grit, tonics, triplets) read samples by index and "
                                  "need local shards; copy the dataset to a local folder (e.g. aws s3 sync, gcloud "
                                  "storage rsync) or train with sampler.kind=random, which streams")
            check_index(ds)
        self.roots = [ds.root for ds in datasets]
        self.counts = LoadCounts()
        self.offsets = np.concatenate([[0], np.cumsum([ds.num_samples for ds in datasets])]).astype(np.int64)
        self.paths = [ds.root / shard for ds in datasets for shard in ds.shards]  # one entry per shard
        self.first = np.concatenate([[0], np.cumsum([n for ds in datasets for n in ds.sizes.values()])]
                                    ).astype(np.int64)  # (shards + 1,) the global index of each shard's first sample
        parts = []
        for ds in datasets:
            for shard in ds.shards:
                keys = ds.column(shard, "key")
                parts.append(np.array([k.encode() for k in keys], dtype="S") if keys else np.empty(0, dtype="S1"))
        self.keys = KeyArray(parts)
        if len(self.keys) != self.offsets[-1]:
            raise ValueError("the sidecars and sizes.json disagree on the number of samples in "
                             + ", ".join(map(str, self.roots)))
        self.tables = {}  # shard number -> ShardIndex, scanned on first use in each process (each loader worker)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def table(self, s: int) -> ShardIndex:
        """Shard s's member table, scanned on first use; its keys must be its sidecar's and its count index.json's."""
        if s not in self.tables:
            path = self.paths[s]
            try:
                table, keys = scan_shard(path)
            except OSError as e:  # the file system refused: not the data's fault, so no advice to re-create it
                raise open_error(e, path) from None
            expected = int(self.first[s + 1] - self.first[s])
            if len(keys) != expected:  # tarfile takes a corrupt header for the end of the tar
                raise short_shard(path, len(keys), "index.json says", expected, REMAKE_HINT)
            sidecar = self.keys.array[self.first[s]:self.first[s + 1]]
            if keys and not np.array_equal(np.array([k.encode() for k in keys], dtype="S"), sidecar):
                j = next(j for j, k in enumerate(keys) if k.encode() != sidecar[j])
                raise BadShardError(f"{path}: sample {j} of the tar is {keys[j]}, its sidecar says "
                                    f"{sidecar[j].decode()}; {REMAKE_HINT}")
            self.tables[s] = table
        return self.tables[s]

    def raw(self, index: int) -> dict:
        """{'__key__', 'txt', 'jpg' | 'png' | ..., ...}: the member bytes of sample `index`."""
        return self.raws([index])[0]

    def raws(self, indices) -> list[dict]:
        """raw() of each index, in the order given; read in shard order, each shard opened once."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample index out of range 0..{len(self) - 1}")
        shard_of = np.searchsorted(self.first, indices, side="right") - 1
        out = [None] * len(indices)
        for s in np.unique(shard_of):  # ascending: shard order, and in each shard tar order
            table = self.table(int(s))
            wanted = np.flatnonzero(shard_of == s)
            wanted = wanted[np.argsort(indices[wanted], kind="stable")]
            try:
                with open(self.paths[s], "rb") as f:
                    for i in wanted:
                        out[i] = read_sample(f, table, int(indices[i] - self.first[s]))
            except OSError as e:
                raise open_error(e, self.paths[s]) from None
            for i in wanted:
                out[i]["__key__"] = self.keys[int(indices[i])]
        return out


def read_sample(f, table: ShardIndex, j: int) -> dict:
    """The member bytes of sample j of an open shard: one read spanning its members (they lie together in the tar)."""
    a = int(table.starts[j])
    b = int(table.starts[j + 1])
    first = int(table.offsets[a])
    f.seek(first)
    span = f.read(int(table.offsets[b - 1] + table.sizes[b - 1]) - first)
    out = {}
    for m in range(a, b):
        at = int(table.offsets[m]) - first
        out[table.names[table.exts[m]]] = span[at:at + int(table.sizes[m])]
    return out


def open_error(e: OSError, shard: Path) -> VlprepError:
    """The one line for a shard that could not be opened or read: the file system's refusal, not damaged data."""
    why = e.strerror or str(e)
    return VlprepError(f"{shard}: cannot open the shard ({type(e).__name__}: {why}); check that this user can read "
                       "it (the file itself is not known to be damaged)")


def check_index(ds) -> None:
    """index.json must list exactly sizes.json's shards and counts, by plain file name (wids opens those paths)."""
    path = ds.root / "index.json"
    try:
        shardlist = json.loads(path.read_text())["shardlist"]
        listed = {s["url"]: s["nsamples"] for s in shardlist}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VlprepError(f"{path}: not a wids index ({type(e).__name__}: {e}); re-create the dataset") from None
    bad = [u for u in listed if not plain_shard_name(u)]
    if bad:
        raise VlprepError(f"{path}: shard url {bad[0]!r} is not a plain .tar file name in the folder")
    if list(listed.items()) != list(ds.sizes.items()) or len(shardlist) != len(listed):
        raise VlprepError(f"{path} and sizes.json list different shards or counts; re-create the dataset")


class InstanceView(torch.utils.data.Dataset):
    """Position p -> (x, caption, key, p[, (start, end)]) for the sample samples[p] of an IndexedShards.

    `spans` (P, 2) gives each position a character span of its caption (TOnICS triplets: the noun), which is the
    first caption (`txt`). Otherwise `captions` is "first" or "draw" (a multi-caption sample gives the caption drawn
    for `seed` and the epoch of `set_epoch`, as ShardStream does).
    """

    def __init__(self, shards: IndexedShards, samples, transform, use_features: bool = False, spans=None,
                 captions: str = "first", seed: int = 0):
        self.shards, self.samples = shards, np.asarray(samples, dtype=np.int64)
        self.transform, self.use_features = transform, use_features
        self.shape = token_shape(shards.roots) if use_features else None  # what every npy member must be
        self.spans = None if spans is None else np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        self.captions, self.seed = captions, seed
        self._epoch, self._seeded = EpochCounter(), None  # _seeded: the epoch this worker last reseeded for

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def _reseed(self) -> int:
        """The epoch; a worker kept across epochs reseeds at each one's start."""
        epoch = self.epoch
        info = get_worker_info()
        if info is not None and self._seeded != epoch:
            reseed_worker(self.seed, epoch, info.id)
            self._seeded = epoch
        return epoch

    def __getitem__(self, p: int) -> tuple | None:
        """The sample at position p, or None (counted in shards.counts) when it cannot be decoded."""
        epoch = self._reseed()
        return self._load(p, self.shards.raw(int(self.samples[p])), epoch)

    def __getitems__(self, positions) -> list:
        """[self[p] for p in positions] (what a DataLoader's batch_sampler asks for), the bytes read in shard order;
        the samples are decoded and transformed in the order given, so they draw the same random numbers."""
        epoch = self._reseed()
        raws = self.shards.raws(self.samples[np.asarray(positions, dtype=np.int64)])
        return [self._load(p, raw, epoch) for p, raw in zip(positions, raws)]

    def _load(self, p: int, raw: dict, epoch: int) -> tuple | None:
        try:
            which = (self.seed, epoch) if self.captions == "draw" and self.spans is None else FIRST
            x, caption, key = load_sample(raw, self.transform, self.use_features, which, self.shape)
        except Exception as e:  # a corrupt image, caption or npy: the sample's fault; Collate drops the None
            self.shards.counts.add(1, 1, skip_reason(e))
            return None
        self.shards.counts.add(1, 0)
        if self.spans is None:
            return x, caption, key, int(p)
        return x, caption, key, int(p), tuple(int(v) for v in self.spans[p])

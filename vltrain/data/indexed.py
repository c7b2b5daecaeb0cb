"""Samples by global index through wids for the index samplers: IndexedShards, InstanceView."""

import contextlib
import functools
import io
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import get_worker_info

from vlprep import VlprepError
from vlprep.dataset import (PICKLE_EXTS, REMAKE_HINT, BadShardError, ShardFormatError, open_dataset, plain_shard_name,
                            short_shard)
from vltrain.data.samples import FIRST, EpochCounter, LoadCounts, load_sample, reseed_worker, skip_reason, token_shape


class IndexedShards:
    """Raw samples of dataset folders by global index (folder order, then shard order, as wids numbers them)."""

    def __init__(self, folders):
        import pyarrow.parquet as pq

        datasets = [open_dataset(f) for f in folders]
        for ds in datasets:
            if ds.url:  # wids' random access wants local files (docs/SCALE.md: index samplers need local shards)
                raise VlprepError(f"{ds.url}: the index samplers (grit, tonics, triplets) read samples by index and "
                                  "need local shards; copy the dataset to a local folder (e.g. aws s3 sync, gcloud "
                                  "storage rsync) or train with sampler.kind=random, which streams")
            check_index(ds)
        self.roots = [ds.root for ds in datasets]
        self.counts = LoadCounts()
        self.offsets = np.concatenate([[0], np.cumsum([ds.num_samples for ds in datasets])]).astype(np.int64)
        keys = []
        for ds in datasets:
            for shard in ds.shards:
                keys.extend(pq.read_table(ds.sidecar(shard), columns=["key"]).column(0).to_pylist())
        if len(keys) != self.offsets[-1]:
            raise ValueError("the sidecars and sizes.json disagree on the number of samples in "
                             + ", ".join(map(str, self.roots)))
        self.keys = keys
        self._wids = None  # opened on first use, in each DataLoader worker
        # wids writes a lock file beside the path it opens (wids_dl.download_and_open: LOCAL.lock). Inputs are never
        # written to (a read-only dataset must train), so wids opens a link to each shard in a private folder; the
        # process that made the folder removes it (DataLoader workers are forks that share it and leave it be).
        self.links = tempfile.mkdtemp(prefix="vltrain-wids-")
        weakref.finalize(self, _remove_links, self.links, os.getpid())

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _open(self) -> list:
        import wids

        out = []
        for f, root in enumerate(self.roots):
            # wids prints a line per dataset on stderr; the shards are local files, read in place (no cache copy).
            with contextlib.redirect_stderr(io.StringIO()):
                out.append(wids.ShardListDataset(str(root / "index.json"), transformations=[], lru_size=16,
                                                 localname=functools.partial(self._link, f)))
        return out

    def _link(self, folder: int, url: str) -> str:
        """wids' local name of a shard: a symlink to it in self.links, where wids' lock file goes."""
        link = os.path.join(self.links, str(folder), os.path.basename(url))
        if not os.path.islink(link):
            os.makedirs(os.path.dirname(link), exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another loader worker made the same link
                os.symlink(os.path.abspath(url), link)
        return link

    def raw(self, index: int) -> dict:
        """{'__key__', 'txt', 'jpg' | 'png' | ..., ...}: the member bytes of sample `index`."""
        if self._wids is None:
            self._wids = self._open()
        f = int(np.searchsorted(self.offsets, index, side="right")) - 1
        w = self._wids[f]
        local = int(index - self.offsets[f])
        url = Path(w.shards[int(np.searchsorted(w.cum_lengths, local, side="right"))]["url"]).name
        try:
            shard, inner, desc = w.get_shard(local)
        except OSError as e:  # the file system refused: not the data's fault, so no advice to re-create it
            raise open_error(e, self.roots[f] / url, self.links) from None
        except (ValueError, AssertionError) as e:  # wids could not index the tar (e.g. a corrupt header)
            raise BadShardError(f"{self.roots[f] / url}: not a readable tar ({type(e).__name__}: {e}); "
                                f"{REMAKE_HINT}") from None
        if len(shard) != desc["nsamples"]:  # a corrupt header ends the tar early, for wids as for tarfile
            raise short_shard(self.roots[f] / url, len(shard), "index.json says", desc["nsamples"], REMAKE_HINT)
        sample = shard[inner]
        for ext in sample:
            if ext.startswith(".") and ext.rsplit(".", 1)[-1].lower() in PICKLE_EXTS:
                raise ShardFormatError(f"{self.roots[f] / url}: refusing pickled member "
                                       f"{sample['__key__']}{ext}")
        # wids hands over member bytes (transformations=[]): we decode the caption, image and npy only
        raw = {k[1:]: v.getvalue() for k, v in sample.items() if k.startswith(".")}
        raw["__key__"] = sample["__key__"]
        if raw["__key__"] != self.keys[index]:
            raise ValueError(f"wids returned {raw['__key__']} for index {index}, the sidecars say "
                             f"{self.keys[index]}: index.json is out of date")
        return raw


def _remove_links(path: str, pid: int) -> None:
    if os.getpid() == pid:  # only the process that made the folder: a loader worker's copy must not remove it
        shutil.rmtree(path, ignore_errors=True)


def open_error(e: OSError, shard: Path, links: str) -> VlprepError:
    """The one line for a shard wids could not open: its lock file or link (in our temp folder) or the shard itself."""
    why = e.strerror or str(e)
    name = str(e.filename or "")
    if name.startswith(links) and (name.endswith(".lock") or not os.path.islink(name)):
        what = "wids' lock file" if name.endswith(".lock") else "the link wids opens"
        return VlprepError(f"{shard}: cannot create {what} {name} ({why}); the dataset is fine: make "
                           f"{tempfile.gettempdir()} writable or set TMPDIR to a writable folder")
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

    def __getitem__(self, p: int) -> tuple | None:
        """The sample at position p, or None (counted in shards.counts) when it cannot be decoded."""
        epoch = self.epoch
        info = get_worker_info()
        if info is not None and self._seeded != epoch:  # a worker kept across epochs: reseed at each one's start
            reseed_worker(self.seed, epoch, info.id)
            self._seeded = epoch
        raw = self.shards.raw(int(self.samples[p]))
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

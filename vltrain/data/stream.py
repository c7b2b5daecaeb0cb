"""`ShardStream`: the samples of dataset folders streamed shard by shard, shuffled per epoch."""

import random
import sys
from collections.abc import Iterator
from pathlib import Path

from torch.utils.data import IterableDataset, get_worker_info

from vlprep import objstore
from vlprep.dataset import REMAKE_HINT, BadShardError, iter_tar, short_shard
from vlprep.urls import redact, redact_text
from vltrain.data.samples import (EpochCounter, LoadCounts, caption_of, load_sample, reseed_worker, skip_reason,
                                  token_shape)
from vltrain.data.shards import in_val, shard_sizes


class ShardStream(IterableDataset):
    """(image tensor or feature tokens, caption, key) from shard folders, one split, shuffled per epoch.

    DataLoader workers (and under torchrun, ranks x workers) take disjoint shards; the order depends only on (seed,
    epoch). `captions` picks what a multi-caption sample gives: "draw" one per epoch (training), "all" (evaluation)
    or "first". A sample that cannot be
    decoded is skipped and counted in `self.counts` (webdataset's warn_and_continue, with a count); a shard whose
    tar ends before its sizes.json count is a BadShardError, and a remote shard that cannot be read after the
    retries (vlprep.objstore; each retry counted) a RemoteError naming its URL. With `skip_bad_shards` both leave the
    rest of that shard out instead, counted (`counts.io_totals()`) and warned about on stderr. `subset` (shards, keys),
    as `first_held_out` gives, reads only those shards and of them only those keys (a capped evaluation).
    """

    def __init__(self, folders, split: str, val_frac: float, transform, shuffle: bool = True,
                 buffer: int = 1000, seed: int = 0, use_features: bool = False, rank: int = 0, world: int = 1,
                 captions: str = "draw", bucket: int = 0, batch: int = 1, lengths=None, skip_bad_shards: bool = False,
                 subset: tuple | None = None):
        self.sizes = shard_sizes(folders)
        self.shards = list(self.sizes)
        self.keys = None  # every sample of the split, or (subset) only these keys
        if subset is not None:
            wanted = set(subset[0])
            self.shards = [s for s in self.shards if s in wanted]
            self.keys = subset[1]
        if not self.shards and subset is None:
            raise ValueError("no shards in " + ", ".join(map(str, folders)))
        self.split, self.val_frac, self.transform = split, val_frac, transform
        self.shuffle, self.buffer, self.seed = shuffle, buffer, seed
        self._epoch = EpochCounter()
        self.use_features, self.rank, self.world = use_features, rank, world
        self.captions = captions
        self.shape = token_shape(folders) if use_features else None  # what every npy member must be
        self.counts = LoadCounts()
        self.skip_bad_shards = skip_bad_shards
        # Length bucketing (shuffled training only): `lengths` maps captions to token counts (TokenLengths)
        self.bucket, self.batch, self.lengths = (bucket, batch, lengths) if shuffle and lengths else (0, 1, None)

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = epoch

    def _wanted(self, key: str) -> bool:
        if self.keys is not None:
            return key in self.keys
        return in_val(key, self.val_frac) == (self.split == "val")

    def _load(self, raw: dict):
        """The loaded sample, or None (counted) when it cannot be decoded."""
        try:
            which = (self.seed, self.epoch) if self.captions == "draw" else self.captions
            sample = load_sample(raw, self.transform, self.use_features, which, self.shape)
        except Exception as e:  # a corrupt image, caption or npy: any decoder error is the sample's, not ours
            self.counts.add(1, 1, skip_reason(e))
            return None
        self.counts.add(1, 0)
        return sample

    def _samples(self, shard: Path | str) -> Iterator[dict]:
        """The raw samples of one shard; a tar that ends before its sizes.json count is a BadShardError."""
        n = 0
        try:
            # vlprep's reader: docs/FORMAT.md's safety rules hold (no pickles, no odd names)
            for raw in iter_tar(shard, on_retry=self.counts.retry):
                n += 1
                yield raw
            if n != self.sizes[shard]:
                raise short_shard(shard, n, "sizes.json says", self.sizes[shard], REMAKE_HINT)
        except (BadShardError, objstore.RemoteError) as e:
            if not self.skip_bad_shards:
                raise
            self.counts.skip_shard()
            print(f"warning: left out the rest of shard {redact(str(shard))} (--skip-bad-shards, after {n} samples): "
                  f"{redact_text(str(e))}",
                  file=sys.stderr, flush=True)

    def __iter__(self) -> Iterator[tuple]:
        epoch = self.epoch
        rng = random.Random(self.seed * 1_000_003 + epoch)
        shards = list(self.shards)
        if self.shuffle:
            rng.shuffle(shards)
        info = get_worker_info()
        if self.world > 1:  # torchrun: the shards are split over rank x worker, every rank shuffling them alike
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            slot = self.rank * workers + worker
            shards = shards[slot::self.world * workers]
            rng = random.Random(self.seed * 1_000_003 + epoch * 1009 + 7919 * slot + 1)
        elif info is not None:
            shards = shards[info.id::info.num_workers]
            rng = random.Random(self.seed * 1_000_003 + epoch * 1009 + info.id)
        if info is not None:  # a worker that lives across epochs: its augmentations a function of (seed, epoch, id)
            reseed_worker(self.seed, epoch, info.id)
        raws = self._shuffled(shards, rng) if self.shuffle else self._raws(shards)
        if self.bucket > 0:  # its own generator: the shuffled stream is the same with and without bucketing
            slot = (self.rank * info.num_workers + info.id) if info is not None else self.rank
            raws = self._bucketed(raws, random.Random(f"bucket {self.seed} {epoch} {slot}"), epoch)
        yield from (s for s in map(self._load, raws) if s is not None)

    def _raws(self, shards: list) -> Iterator[dict]:
        for shard in shards:
            for raw in self._samples(shard):
                if self._wanted(raw["__key__"]):
                    yield raw

    def _shuffled(self, shards: list, rng: random.Random) -> Iterator[dict]:
        # The buffer holds raw samples (encoded bytes), not decoded tensors: 1,000 tensors of
        # 3x224x224 floats would be 600 MB per worker and slow everything down.
        buf = []
        for raw in self._raws(shards):
            buf.append(raw)
            if len(buf) >= self.buffer:
                yield buf.pop(rng.randrange(len(buf)))
        rng.shuffle(buf)
        yield from buf

    def _bucketed(self, raws: Iterator[dict], rng: random.Random, epoch: int) -> Iterator[dict]:
        """The shuffled raw samples in windows of `bucket` batches: each window sorted by caption length (ties in
        arrival order), cut into batches, the batches in a shuffled order, so a batch pads to a similar length.

        A trailing partial batch stays last, where the loader's drop_last leaves it. The order is a function of the
        seed and epoch (the rng), so a resumed run draws the same batches."""
        size = self.bucket * self.batch
        window = []
        for raw in raws:
            window.append(raw)
            if len(window) == size:
                yield from self._window(window, rng, epoch)
                window = []
        yield from self._window(window, rng, epoch)

    def _window(self, window: list, rng: random.Random, epoch: int) -> list:
        which = (self.seed, epoch) if self.captions == "draw" else self.captions
        lengths = self.lengths([caption_of(raw, which) for raw in window])
        order = sorted(range(len(window)), key=lambda i: lengths[i])  # stable: ties keep their arrival order
        full = len(order) - len(order) % self.batch
        batches = [order[i:i + self.batch] for i in range(0, full, self.batch)]
        rng.shuffle(batches)
        return [window[i] for b in batches for i in b] + [window[i] for i in order[full:]]

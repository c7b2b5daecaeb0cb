"""Shard reading for vltrain: a key-hash validation split, torchvision v2 transforms, tokenisation, collate.

Samples come through vlprep's reader (`vlprep.dataset.iter_tar`), so the safety rules of
docs/FORMAT.md hold here too. Several dataset folders are mixed by interleaving their shards.
"""

import hashlib
import io
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchvision.transforms import v2

from vlprep.dataset import image_ext, iter_tar, open_dataset, to_rgb


def in_val(key: str, frac: float) -> bool:
    """Held-out membership by key hash: the same samples whatever the seed, run or shard order."""
    h = hashlib.blake2b(f"val:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < frac * 2**64


def train_transform(size: int, mean, std, min_scale: float = 0.5) -> v2.Compose:
    return v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True),
                       v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def eval_transform(size: int, mean, std) -> v2.Compose:
    return v2.Compose([v2.ToImage(), v2.Resize(size, antialias=True), v2.CenterCrop(size),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def shard_paths(folders: list[str | Path]) -> list[Path]:
    """All shards of the given dataset folders, interleaved so that every folder is mixed from the start."""
    lists = [[ds.root / s for s in ds.shards] for ds in map(open_dataset, folders)]
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


class ShardStream(IterableDataset):
    """(image tensor or feature tokens, caption, key) from shard folders, one split, shuffled per epoch.

    DataLoader workers take disjoint shards; the order depends only on (seed, epoch).
    """

    def __init__(self, folders, split: str, val_frac: float, transform, shuffle: bool = True,
                 buffer: int = 1000, seed: int = 0, use_features: bool = False):
        self.shards = shard_paths(folders)
        if not self.shards:
            raise ValueError("no shards in " + ", ".join(map(str, folders)))
        self.split, self.val_frac, self.transform = split, val_frac, transform
        self.shuffle, self.buffer, self.seed, self.epoch = shuffle, buffer, seed, 0
        self.use_features = use_features

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _wanted(self, key: str) -> bool:
        return in_val(key, self.val_frac) == (self.split == "val")

    def _load(self, raw: dict):
        caption = raw["txt"].decode("utf-8")  # only the caption: the json member is not needed here
        if self.use_features:
            if "npy" not in raw:
                raise ValueError(f"{raw['__url__']}: sample {raw['__key__']} has no npy features")
            x = torch.from_numpy(np.load(io.BytesIO(raw["npy"]), allow_pickle=False)).float()
        else:
            x = self.transform(to_rgb(raw[image_ext(raw)]))
        return x, caption, raw["__key__"]

    def __iter__(self) -> Iterator[tuple]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        shards = list(self.shards)
        if self.shuffle:
            rng.shuffle(shards)
        info = get_worker_info()
        if info is not None:
            shards = shards[info.id::info.num_workers]
            rng = random.Random(self.seed * 1_000_003 + self.epoch * 1009 + info.id)
        # The buffer holds raw samples (encoded bytes), not decoded tensors: 1,000 tensors of
        # 3x224x224 floats would be 600 MB per worker and slow everything down.
        buf = []
        for shard in shards:
            for raw in iter_tar(shard):
                if not self._wanted(raw["__key__"]):
                    continue
                if not self.shuffle:
                    yield self._load(raw)
                    continue
                buf.append(raw)
                if len(buf) >= self.buffer:
                    yield self._load(buf.pop(rng.randrange(len(buf))))
        rng.shuffle(buf)
        yield from map(self._load, buf)


class Collate:
    """Batch of (x, caption, key) -> {'images' | 'features', 'input_ids', 'attention_mask', 'keys', 'captions'}."""

    def __init__(self, tokenizer, max_len: int, use_features: bool = False):
        self.tokenizer, self.max_len, self.use_features = tokenizer, max_len, use_features

    def __call__(self, batch: list[tuple]) -> dict:
        xs, captions, keys = zip(*batch)
        tok = self.tokenizer(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             return_tensors="pt")
        return {"features" if self.use_features else "images": torch.stack(xs), "input_ids": tok["input_ids"],
                "attention_mask": tok["attention_mask"], "keys": list(keys), "captions": list(captions)}


def count_split(folders, val_frac: float) -> dict[str, int]:
    """Number of train / val samples, from the sidecars' keys (no tar reads)."""
    import pyarrow.parquet as pq

    n = {"train": 0, "val": 0}
    for ds in map(open_dataset, folders):
        for shard in ds.shards:
            for key in pq.read_table(ds.sidecar(shard), columns=["key"]).column(0).to_pylist():
                n["val" if in_val(key, val_frac) else "train"] += 1
    return n

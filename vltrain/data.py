"""Shard reading for vltrain: a key-hash validation split, torchvision v2 transforms, tokenisation, collate.

Two ways in: `ShardStream` streams shards through vlprep's reader (`vlprep.dataset.iter_tar`, so the safety
rules of docs/FORMAT.md hold; several dataset folders are mixed by interleaving their shards), and
`IndexedShards` + `InstanceView` read samples by global index through wids (`index.json`) for the index-based
samplers. wids never unpickles anything here: only the caption, image and `npy` members are decoded, by us.
"""

import contextlib
import functools
import hashlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchvision.transforms import v2

from vlprep import VlprepError, objstore
from vlprep.urls import redact, redact_text
from vlprep.dataset import (PICKLE_EXTS, REMAKE_HINT, BadShardError, ShardFormatError, image_ext, iter_tar,
                            open_dataset, plain_shard_name, short_shard, to_rgb)


def in_val(key: str, frac: float) -> bool:
    """Held-out membership by key hash: the same samples whatever the seed, run or shard order."""
    h = hashlib.blake2b(f"val:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < frac * 2**64


# Spec keys that must agree for two `vlprep features` datasets to be mixed (dtype may differ: same encoder).
SAME_ENCODER = ("encoder", "weights_sha256", "size", "mean", "std", "tokens", "dim")


def feature_input(folders, mode: str = "auto") -> dict | None:
    """The `vlprep features` record to train on (feature input), or None for pixel input; ValueError if mixed.

    mode "auto" takes features when every folder has them and pixels when none has; "pixels" ignores them;
    "features" requires them. Folders made by different encoders are never mixed.
    """
    from vlprep.encoders import features_spec

    specs = {str(f): features_spec(f) for f in folders}
    if mode == "pixels":
        return None
    have = [f for f, s in specs.items() if s]
    lack = [f for f, s in specs.items() if not s]
    if not have:
        if mode == "features":
            raise ValueError(f"data.input=features but {', '.join(lack)} holds no `vlprep features` tokens "
                             "(no 'features' record in meta.json); run `vlprep features` on it first")
        return None
    if lack:
        raise ValueError(f"cannot mix feature datasets ({', '.join(have)}) with pixel datasets ({', '.join(lack)}): "
                         "run `vlprep features` on the pixel ones, or train on pixels with --set data.input=pixels")
    first = specs[have[0]]
    for f in have[1:]:
        diff = [k for k in SAME_ENCODER if specs[f].get(k) != first.get(k)]
        if diff:
            k = diff[0]
            raise ValueError(f"{have[0]} and {f} hold features of different encoders ({k} {first.get(k)!r} vs "
                             f"{specs[f].get(k)!r}); make both with the same `vlprep features` options")
    return first


def train_transform(size: int, mean, std, min_scale: float = 0.5, augment: str = "none") -> v2.Compose:
    """Training view of an image: augment none (crop at scale min_scale..1 + flip), albef or softmask (MMDA).

    albef is ALBEF's pre-training recipe: crop at scale 0.2..1, flip, RandAugment with 2 ops at magnitude 7
    (torchvision's op set, not ALBEF's hand-written one). softmask adds TCL's colour recipe, which SoftMask++'s MMDA
    takes: ColorJitter(0.4, 0.4, 0.4, 0.1) at p 0.8, grayscale at p 0.2, Gaussian blur (sigma 0.1..2) at p 0.5.
    """
    if augment == "none":
        return v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True),
                           v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True,
                                                interpolation=v2.InterpolationMode.BICUBIC),
             v2.RandomHorizontalFlip(), v2.RandAugment(num_ops=2, magnitude=7)]
    if augment == "softmask":
        kernel = 2 * max(1, round(0.05 * size)) + 1  # SimCLR's blur kernel: about a tenth of the image side, odd
        steps += [v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                  v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5)]
    return v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def eval_transform(size: int, mean, std) -> v2.Compose:
    return v2.Compose([v2.ToImage(), v2.Resize(size, antialias=True), v2.CenterCrop(size),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def shard_sizes(folders: list[str | Path]) -> dict[Path | str, int]:
    """Every shard of the given dataset folders (a path, or a URL for a remote folder) -> its sizes.json count,
    interleaved so that every folder is mixed from the start."""
    lists = [[(ds.tar(s), n) for s, n in ds.sizes.items()] for ds in map(open_dataset, folders)]
    out = {}
    for i in range(max((len(x) for x in lists), default=0)):
        out.update(x[i] for x in lists if i < len(x))
    return out


def shard_paths(folders: list[str | Path]) -> list[Path]:
    return list(shard_sizes(folders))


def data_signature(folders: list[str | Path]) -> str:
    """What identifies the training data's contents, for `--resume` and for pipelines that reuse finished runs: a
    hash of each folder's sizes.json and every shard's Parquet sidecar (keys and captions), which vlprep rewrites
    when a shard's records change. Content, not mtimes: a stage re-run with the same result keeps the signature.
    A remote folder (a URL) is not read whole for it: its sizes.json, and each shard's tar and sidecar by their ETag
    (S3's and GCS's are content hashes for a plain upload) or, where the server gives none, their size."""
    h = hashlib.sha256()
    for folder in folders:
        ds = open_dataset(folder)
        h.update(b"\0" + json.dumps(ds.sizes, sort_keys=True).encode())
        if ds.url:
            for shard in ds.sizes:
                side = Path(shard).with_suffix(".parquet").name
                tar, meta = ds.stat(shard), (ds.listed or {}).get(side) or objstore.info(objstore.join(ds.url, side))
                h.update(json.dumps([shard, tar["etag"] or tar["size"], meta["etag"] or meta["size"]]).encode())
            continue
        for shard in ds.sizes:
            side = ds.root / Path(shard).with_suffix(".parquet")
            h.update(shard.encode() + (side.read_bytes() if side.is_file() else b"-"))
    return h.hexdigest()[:16]


class BadSample(ValueError):
    """A sample that cannot be used, with the reason it is counted under (one of LoadCounts.REASONS)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class LoadCounts:
    """Samples read and samples skipped as bad (by reason), summed over the main process and DataLoader workers.

    The counts live in a shared-memory tensor with one row per worker (no locks needed): workers are new
    processes every epoch, and only shared memory carries their counts back to the training loop.
    """

    SLOTS = 65
    # Why a sample was skipped: an image, caption or other member that does not decode, and the `npy` checks of
    # `load_tokens`. Column 0 of the counts is the samples read, column 1 + i the samples skipped for REASONS[i].
    REASONS = ("undecodable", "npy_missing", "npy_unreadable", "npy_dtype", "npy_shape", "npy_nonfinite")
    # Reading shards, apart from samples: retried remote reads (vlprep.objstore) and shards left out as unreadable.
    IO = ("read_retries", "shards_skipped")

    def __init__(self):
        self.counts = torch.zeros((self.SLOTS, 1 + len(self.REASONS)), dtype=torch.int64).share_memory_()
        self.io = torch.zeros((self.SLOTS, len(self.IO)), dtype=torch.int64).share_memory_()

    @staticmethod
    def _slot() -> int:
        info = get_worker_info()
        return 0 if info is None else 1 + info.id % (LoadCounts.SLOTS - 1)

    def add(self, read: int, bad: int, reason: str = "undecodable") -> None:
        slot = self._slot()
        self.counts[slot, 0] += read
        self.counts[slot, 1 + self.REASONS.index(reason)] += bad

    def retry(self) -> None:
        """A remote read that failed transiently and is tried again."""
        self.io[self._slot(), 0] += 1

    def skip_shard(self) -> None:
        self.io[self._slot(), 1] += 1

    def io_totals(self) -> dict[str, int]:
        """{'read_retries': n, 'shards_skipped': m} over the main process and the loader workers."""
        return {k: int(v) for k, v in zip(self.IO, self.io.sum(dim=0).tolist())}

    def totals(self) -> tuple[int, int]:
        """(samples read, of which skipped as bad)."""
        total = self.counts.sum(dim=0)
        return int(total[0]), int(total[1:].sum())

    def reasons(self) -> dict[str, int]:
        """The skipped samples by reason, the reasons that occurred only."""
        total = self.counts.sum(dim=0)[1:].tolist()
        return {r: int(n) for r, n in zip(self.REASONS, total) if n}

    def skipped(self) -> dict:
        """{'count': skipped samples, 'reasons': {reason: count}}, as eval.json and the held-out results carry it."""
        return {"count": self.totals()[1], "reasons": self.reasons()}


def skip_reason(e: Exception) -> str:
    return e.reason if isinstance(e, BadSample) else "undecodable"


def loader_error(e: Exception) -> Exception:
    """The one line a DataLoader worker's exception had there (torch prefixes its text with the worker traceback)."""
    text = str(e)
    if "Original Traceback" not in text:
        return e
    last = text.strip().splitlines()[-1]  # "vlprep.BadShardError: the message"
    _, sep, msg = last.partition(": ")
    try:
        return type(e)(msg) if sep else e
    except TypeError:
        return e


def sample_captions(raw: dict) -> list[str]:
    """Every caption of a raw sample: `json.captions` of a multi-caption sample (docs/FORMAT.md), else [txt]."""
    text = raw["txt"].decode("utf-8")
    meta = raw.get("json")
    if not meta or b'"captions"' not in meta:  # most samples have one caption: no json parse for them
        return [text]
    captions = json.loads(meta).get("captions")
    if captions is None:  # the bytes only mentioned "captions" somewhere else
        return [text]
    if not isinstance(captions, list) or not captions or not all(isinstance(c, str) and c for c in captions):
        raise ValueError(f"sample {raw.get('__key__')}: json.captions is not a list of captions")
    return captions


def drawn_caption(captions: list[str], seed: int, epoch: int, key: str) -> str:
    """The caption a multi-caption sample trains on in an epoch: a function of (seed, epoch, key) only, so every
    worker, rank and resumed run draws the same one, and each epoch may draw another (ALBEF trains on them all)."""
    if len(captions) == 1:
        return captions[0]
    h = hashlib.blake2b(f"caption:{seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return captions[int.from_bytes(h, "big") % len(captions)]


# Which caption(s) load_sample returns: "first" (txt), "all" (a tuple, for evaluation) or (seed, epoch) to draw one.
FIRST, ALL = "first", "all"


def token_shape(folders) -> tuple[int, int] | None:
    """(N, D): the shape every `npy` member of these folders has, from their `features` records (None when none has
    a record: nothing to check a member's shape against); ValueError when the records disagree."""
    from vlprep.encoders import features_spec

    shapes = {}
    for folder in folders:
        spec = features_spec(folder)
        if spec and "tokens" in spec and "dim" in spec:
            shapes.setdefault((int(spec["tokens"]), int(spec["dim"])), str(folder))
    if len(shapes) > 1:
        raise ValueError("the features records of " + " and ".join(f"{f} ({n}x{d} tokens)" for (n, d), f in
                                                                   shapes.items()) + " disagree")
    return next(iter(shapes), None)


def load_tokens(data: bytes, shape: tuple[int, int] | None) -> torch.Tensor:
    """An `npy` member -> float32 tokens (N, D), checked against the dataset's `features` record (docs/FORMAT.md):
    float16, float32 and float64 are read as float32, in C order and native byte order; BadSample when the member
    does not load, has another dtype kind or shape (`shape`; any 2-D shape when None) or a value that is not finite."""
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as e:  # not an npy file, a pickled (object) array, cut short: numpy's error names it
        raise BadSample("npy_unreadable", f"not a readable npy array ({type(e).__name__}: {e})") from None
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (2, 4, 8):
        raise BadSample("npy_dtype", f"npy dtype {arr.dtype}, not float16, float32 or float64")
    if arr.shape != (shape or arr.shape) or arr.ndim != 2:
        want = f"{shape[0]}x{shape[1]}" if shape else "2-D"
        raise BadSample("npy_shape", f"npy shape {arr.shape}, the features record says {want}")
    # One copy: float32 (float64 values beyond float32's range become inf, caught below), C order, native bytes.
    with np.errstate(over="ignore"):
        x = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if not bool(torch.isfinite(x).all()):
        raise BadSample("npy_nonfinite", "npy tokens hold NaN or infinite values")
    return x


def load_sample(raw: dict, transform, use_features: bool, captions=FIRST, shape=None) -> tuple:
    """Raw sample (member bytes by extension) -> (image tensor or feature tokens, caption(s), key).

    With `use_features` the `npy` member is read by `load_tokens` against `shape` (N, D); a bad one is a BadSample.
    """
    if captions == FIRST:
        caption = raw["txt"].decode("utf-8")  # only the caption: the json member is not needed here
    elif captions == ALL:
        caption = tuple(sample_captions(raw))
    else:
        caption = drawn_caption(sample_captions(raw), *captions, raw["__key__"])
    if use_features:
        if "npy" not in raw:
            raise BadSample("npy_missing", f"{raw.get('__url__', '')}: sample {raw['__key__']} has no npy features")
        x = load_tokens(raw["npy"], shape)
    else:
        x = transform(to_rgb(raw[image_ext(raw)]))
    return x, caption, raw["__key__"]


class ShardStream(IterableDataset):
    """(image tensor or feature tokens, caption, key) from shard folders, one split, shuffled per epoch.

    DataLoader workers (and under torchrun, ranks x workers) take disjoint shards; the order depends only on (seed,
    epoch). `captions` picks what a multi-caption sample gives: "draw" one per epoch (training), "all" (evaluation)
    or "first". A sample that cannot be
    decoded is skipped and counted in `self.counts` (webdataset's warn_and_continue, with a count); a shard whose
    tar ends before its sizes.json count is a BadShardError, and a remote shard that cannot be read after the
    retries (vlprep.objstore; each retry counted) a RemoteError naming its URL. With `skip_bad_shards` both leave the
    rest of that shard out instead, counted (`counts.io_totals()`) and warned about on stderr.
    """

    def __init__(self, folders, split: str, val_frac: float, transform, shuffle: bool = True,
                 buffer: int = 1000, seed: int = 0, use_features: bool = False, rank: int = 0, world: int = 1,
                 captions: str = "draw", bucket: int = 0, batch: int = 1, lengths=None, skip_bad_shards: bool = False):
        self.sizes = shard_sizes(folders)
        self.shards = list(self.sizes)
        if not self.shards:
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
        w, local = self._wids[f], int(index - self.offsets[f])
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
    why, name = e.strerror or str(e), str(e.filename or "")
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
        epoch, info = self.epoch, get_worker_info()
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


def span_mask(offsets: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Word pieces overlapping each character span: offsets (B, L, 2), spans (B, 2) -> bool (B, L).

    Special and padding tokens have empty offsets and never match.
    """
    start, end = spans[:, None, 0], spans[:, None, 1]
    return (offsets[..., 0] < end) & (offsets[..., 1] > start) & (offsets[..., 1] > offsets[..., 0])


def caption_of(raw: dict, captions) -> str:
    """The caption `load_sample` would train on for `raw` ('' when it cannot be read: the load counts that)."""
    try:
        if captions == FIRST:
            return raw["txt"].decode("utf-8")
        return drawn_caption(sample_captions(raw), *captions, raw["__key__"])
    except (KeyError, UnicodeDecodeError, ValueError):
        return ""


class TokenLengths:
    """Captions -> their token counts as Collate tokenises them (with [CLS] / [SEP], cut at max_len); a class, not a
    closure, so that a DataLoader worker started by spawn can receive it."""

    def __init__(self, tokenizer, max_len: int):
        self.tokenizer, self.max_len = tokenizer, max_len

    def __call__(self, captions: list[str]) -> list[int]:
        if not captions:
            return []
        ids = self.tokenizer(captions, truncation=True, max_length=self.max_len)["input_ids"]
        return [len(x) for x in ids]


class EpochCounter:
    """The data's epoch in shared memory: DataLoader workers that live across epochs (persistent_workers) read the
    epoch the main process set, not the one they were forked with."""

    def __init__(self):
        self._value = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def value(self) -> int:
        return int(self._value)

    @value.setter
    def value(self, epoch: int) -> None:
        self._value.fill_(epoch)


def reseed_worker(seed: int, epoch: int, worker: int) -> None:
    """A DataLoader worker's torch, numpy and random generators, as a function of (run seed, epoch, worker id)
    only: a worker kept across epochs then draws the augmentations a freshly started one would, so a run resumed
    mid-training replays them bit for bit."""
    s = (seed * 1_000_003 + epoch * 10_007 + worker * 101 + 17) % 2 ** 32
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


class Collate:
    """Batch of (x, caption, key[, position[, span]]) -> {'images' | 'features', 'input_ids', 'attention_mask',
    'keys', 'captions'[, 'index'[, 'noun_mask']]}; noun_mask (B, L) marks the word pieces of each span.

    Samples loaded with every caption (a tuple each, for evaluation) give one row of input_ids per caption and
    'caption_owner' (T,): the batch position of each caption's image."""

    def __init__(self, tokenizer, max_len: int, use_features: bool = False):
        self.tokenizer, self.max_len, self.use_features = tokenizer, max_len, use_features

    def __call__(self, batch: list[tuple | None]) -> dict | None:
        batch = [b for b in batch if b is not None]  # undecodable samples (counted where they were read)
        if not batch:
            return None
        xs, captions, keys, *extra = zip(*batch)
        owner = None
        if isinstance(captions[0], tuple):  # every caption of each sample
            owner = torch.tensor([i for i, caps in enumerate(captions) for _ in caps], dtype=torch.long)
            captions = [c for caps in captions for c in caps]
        spans = len(extra) > 1
        extra_args = {"return_offsets_mapping": True} if spans else {}  # fast tokenizers only: triplets need it
        tok = self.tokenizer(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             return_tensors="pt", **extra_args)
        out = {"features" if self.use_features else "images": torch.stack(xs), "input_ids": tok["input_ids"],
               "attention_mask": tok["attention_mask"], "keys": list(keys), "captions": list(captions)}
        if owner is not None:
            out["caption_owner"] = owner
        if extra:
            out["index"] = torch.tensor(extra[0], dtype=torch.long)
        if spans:
            out["noun_mask"] = span_mask(tok["offset_mapping"], torch.tensor(extra[1], dtype=torch.long))
        return out


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device` (non-blocking from pinned memory); other entries as they are."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def count_split(folders, val_frac: float) -> dict[str, int]:
    """Number of train / val samples, from the sidecars' keys (no tar reads)."""
    import pyarrow.parquet as pq

    n = {"train": 0, "val": 0}
    for ds in map(open_dataset, folders):
        for shard in ds.shards:
            for key in pq.read_table(ds.sidecar(shard), columns=["key"]).column(0).to_pylist():
                n["val" if in_val(key, val_frac) else "train"] += 1
    return n

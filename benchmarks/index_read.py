"""Read speed of the index samplers' loader (GRIT, TOnICS, triplets) against the streamed loader, on the same shards.

The data: --samples synthetic pairs (16 px PNG, a caption) in shards of --per-shard, written by vlprep's shard writer
into a temporary folder. Each side reads --batches batches of --batch-size through a torch DataLoader with --workers
workers, decoding every image and applying the training transform (random resized crop to 32 px, flip, to tensor);
the collate only counts the samples, so no tokenizer time is in either side.
- stream: the random sampler's loader, ShardStream (train split, shuffled: shards in a seeded order, a 1,000-sample
  shuffle buffer), shard after shard.
- index: InstanceView over IndexedShards with a batch_sampler of uniformly random positions without repeats (GRIT's
  first epoch is such a permutation, TOnICS' entity node draws uniformly), each batch read in shard order through the
  per-shard member tables, all of them built before the workers start (a run's later epochs, whose persistent
  workers keep the tables they built).
- index-cold: the same with no table built yet, so each worker scans the headers of every shard it meets for the
  first time (a run's first epoch, until each worker has met every shard).
- wids (the former reader, informational; --no-wids to skip): the same positions read one at a time through
  wids.ShardListDataset with its LRU of 16 indexed shards, as the index samplers did before.
Each side runs once untimed (imports, page cache), then --rounds times in alternating order, each round with new
positions and fresh loader workers; the clock runs from the loader's start to its last batch (the table building of
`index` is before it); medians decide. Prints samples/s per side and the ratio index / stream (target: >= 0.5),
with the load average at start and end.

    .venv/bin/python benchmarks/index_read.py [--samples 100000] [--per-shard 100] [--workers 2] [--batches 40]
"""

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

from vlprep.output import Out, finish_dataset, write_shard
from vltrain.data.indexed import IndexedShards, InstanceView
from vltrain.data.samples import FIRST, load_sample
from vltrain.data.stream import ShardStream

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_line  # noqa: E402


def make_data(root: Path, samples: int, per_shard: int) -> Path:
    """samples pairs in shards of per_shard: one of 64 16 px PNGs and a caption each."""
    root.mkdir(parents=True)
    out = Out(root)
    rng = np.random.default_rng(0)
    images = []
    for _ in range(64):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3)).astype(np.uint8)).save(buf, "PNG")
        images.append(buf.getvalue())
    sizes = {}
    for s, a in enumerate(range(0, samples, per_shard)):
        ids = range(a, min(a + per_shard, samples))
        name = f"bench-{s:06d}.tar"
        keys = [f"bench_{i:09d}" for i in ids]
        captions = [f"a small picture number {i}" for i in ids]
        write_shard(out, name, ({"__key__": k, "txt": c, "png": images[i % 64]} for i, k, c in zip(ids, keys, captions)),
                    [{"key": k, "caption": c} for k, c in zip(keys, captions)])
        sizes[name] = len(ids)
    finish_dataset(out, sizes, {"stage": "benchmark"})
    return root


def count(batch: list) -> int:
    return sum(b is not None for b in batch)


def positions(n: int, batches: int, batch_size: int, seed: int) -> list[list[int]]:
    order = np.random.default_rng(seed).permutation(n)[:batches * batch_size]
    return [order[b * batch_size:(b + 1) * batch_size].tolist() for b in range(batches)]


def read_stream(root: Path, tf, args, seed: int) -> tuple[int, float]:
    stream = ShardStream([root], "train", 0.0, tf, seed=seed)
    loader = DataLoader(stream, batch_size=args.batch_size, collate_fn=count, num_workers=args.workers)
    t = time.perf_counter()
    n = 0
    for b, got in enumerate(loader):
        n += got
        if b + 1 == args.batches:
            break
    return n, time.perf_counter() - t


def read_index(root: Path, tf, args, seed: int, warm: bool = True) -> int:
    shards = IndexedShards([root])
    if warm:  # every member table built before the workers fork, as a later epoch of a run finds them
        for s in range(len(shards.paths)):
            shards.table(s)
    view = InstanceView(shards, np.arange(len(shards)), tf)
    plan = positions(len(shards), args.batches, args.batch_size, seed)
    loader = DataLoader(view, batch_sampler=plan, collate_fn=count, num_workers=args.workers)
    t = time.perf_counter()
    return sum(loader), time.perf_counter() - t


def read_index_cold(root: Path, tf, args, seed: int) -> int:
    return read_index(root, tf, args, seed, warm=False)


class WidsView:
    """The former reader: sample i through wids' random access (an LRU of 16 indexed shards)."""

    def __init__(self, root: Path, tf):
        import contextlib

        import wids

        with contextlib.redirect_stderr(io.StringIO()):
            self.ds = wids.ShardListDataset(str(root / "index.json"), transformations=[], lru_size=16)
        self.ds.check_cache_misses = lambda: None  # its one-line warning per worker: the misses are what is measured
        self.tf = tf

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        sample = self.ds[i]
        raw = {k[1:]: v.getvalue() for k, v in sample.items() if k.startswith(".")}
        raw["__key__"] = sample["__key__"]
        return load_sample(raw, self.tf, False, FIRST)


def read_wids(root: Path, tf, args, seed: int) -> tuple[int, float]:
    view = WidsView(root, tf)
    plan = positions(len(view), args.batches, args.batch_size, seed)
    loader = DataLoader(view, batch_sampler=plan, collate_fn=count, num_workers=args.workers)
    t = time.perf_counter()
    return sum(loader), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-wids", action="store_true", help="skip the former reader's side")
    args = ap.parse_args()
    print(load_line("start"), flush=True)
    tf = transforms.Compose([transforms.RandomResizedCrop(32, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor()])
    sides = {"stream": read_stream, "index": read_index, "index-cold": read_index_cold}
    if not args.no_wids:
        sides["wids"] = read_wids
    with tempfile.TemporaryDirectory(prefix="index-read-") as tmp:
        t0 = time.perf_counter()
        root = make_data(Path(tmp) / "data", args.samples, args.per_shard)
        print(f"data: {args.samples:,} samples in {-(-args.samples // args.per_shard):,} shards of {args.per_shard} "
              f"({time.perf_counter() - t0:.1f} s to write); {args.batches} batches of {args.batch_size}, "
              f"{args.workers} workers", flush=True)
        rates = {name: [] for name in sides}
        for r in range(args.rounds + 1):  # round 0: untimed warm-up
            for name in (list(sides) if r % 2 else list(sides)[::-1]):
                n, seconds = sides[name](root, tf, args, seed=r)
                if r:
                    rates[name].append(n / seconds)
        med = {name: statistics.median(v) for name, v in rates.items()}
        for name, v in med.items():
            print(f"{name:10s} {v:9.0f} samples/s  (rounds: {', '.join(f'{x:.0f}' for x in rates[name])})")
        print(f"ratio index / stream: {med['index'] / med['stream']:.2f} (target >= 0.5)")
        print(f"ratio index-cold / stream: {med['index-cold'] / med['stream']:.2f} (each worker scanning the "
              "headers of the shards it meets for the first time: a run's first epoch)")
        if "wids" in med:
            print(f"ratio wids / stream:  {med['wids'] / med['stream']:.2f} (the former reader)")
    print(load_line("end"))


if __name__ == "__main__":
    main()

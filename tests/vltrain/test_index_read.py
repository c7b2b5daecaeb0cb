"""The index samplers' reader (vltrain.data.indexed): the bytes wids reads, each shard scanned once per process and
opened once per batch, a batch as __getitem__ gives it sample by sample, the TOnICS instances of the former
pandas code, and a set-up whose memory grows by a few numpy bytes per sample."""

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torchvision.transforms.functional import to_tensor

import vltrain.data.indexed as indexed
from tests.conftest import npy_bytes
from tests.memrule import growth_per_sample
from vlprep.output import Out, finish_dataset, write_shard
from vltrain.config import Config, SamplerConfig
from vltrain.data.indexed import IndexedShards, InstanceView
from vltrain.samplers import tonics_instances
from vltrain.trainset import index_data

CLASSES = [f"class{c}" for c in range(12)]


def png(i: int, side: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 255, (side, side, 3)).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_folder(root: Path, counts: list[int], members: bool = True, start: int = 0) -> Path:
    """Shards of counts[s] samples; with `members` each sample has png, txt, json and npy members of varying sizes,
    else png and txt. Samples are numbered from `start`; their keys are shard_{i:09d}. Also a triplets.parquet (two
    triplets per sample) and ontology.json, as `vlprep ontology` writes them."""
    root.mkdir(parents=True)
    out = Out(root)
    sizes = {}
    images = [png(i) for i in range(16)]
    triplets = []
    i = start
    for s, n in enumerate(counts):
        name = f"shard-{s:06d}.tar"
        samples = []
        rows = []
        for _ in range(n):
            key = f"shard_{i:09d}"
            caption = f"a cat and a dog number {i}" + " again" * (i % 5)
            sample = {"__key__": key, "txt": caption, "png": images[i % 16]}
            if members:
                sample["json"] = {"uid": key, "pad": "x" * (i % 700)}
                sample["npy"] = npy_bytes(np.full((1 + i % 3, 4), i, dtype=np.float16))
            samples.append(sample)
            rows.append({"key": key, "caption": caption})
            triplets += [{"key": key, "index": i - start, "noun": "cat", "start": 2 + t, "end": 5 + t,
                          "class": CLASSES[(i * 7 + t * 5) % 12]} for t in range(2)]
            i += 1
        write_shard(out, name, samples, rows)
        sizes[name] = n
    finish_dataset(out, sizes, {"stage": "synthetic"})
    pq.write_table(pa.Table.from_pylist(triplets), root / "triplets.parquet")
    (root / "ontology.json").write_text(json.dumps({"root": {"name": "entity", "instances": i - start},
                                                    "nodes": [{"class": c, "nouns": [c], "instances": 1}
                                                              for c in CLASSES]}))
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("index")
    return [write_folder(tmp / "a", [7, 1, 12, 5]), write_folder(tmp / "b", [9, 3], start=100)]


def wids_raws(folder: Path, cache: Path) -> list[dict]:
    """Every sample of a folder as wids reads it through index.json, its member bytes by extension."""
    import wids

    ds = wids.ShardListDataset(str(folder / "index.json"), cache_dir=str(cache), transformations=[])
    return [{"__key__": s["__key__"], **{k[1:]: v.getvalue() for k, v in s.items() if k.startswith(".")}}
            for s in (ds[i] for i in range(len(ds)))]


def test_the_reader_reads_the_bytes_wids_reads(folders, tmp_path):
    shards = IndexedShards(folders)
    want = wids_raws(folders[0], tmp_path / "c0") + wids_raws(folders[1], tmp_path / "c1")
    assert len(shards) == len(want) == 37
    assert [shards.raw(i) for i in range(37)] == want
    order = np.random.default_rng(0).integers(0, 37, 60)  # any order, repeats included, across folders
    assert shards.raws(order) == [want[i] for i in order]
    assert list(shards.keys) == [w["__key__"] for w in want] and shards.keys[36] == want[36]["__key__"]


def test_each_shard_is_scanned_once_per_process_and_opened_once_per_batch(folders, monkeypatch):
    scanned = []
    opened = []
    real_scan = indexed.scan_shard
    real_open = open

    def counting_scan(path):
        scanned.append(path)
        return real_scan(path)

    def counting_open(file, *a, **k):
        if str(file).endswith(".tar"):
            opened.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(indexed, "scan_shard", counting_scan)
    monkeypatch.setattr("builtins.open", counting_open)
    shards = IndexedShards(folders)
    rng = np.random.default_rng(1)
    for _ in range(6):
        shards.raws(rng.permutation(37)[:8])
    assert len(scanned) == len(set(scanned))  # each shard scanned at most once, then its table is kept
    shards.raws(np.arange(37))
    assert sorted(map(str, scanned)) == sorted(map(str, shards.paths))
    for _ in range(6):  # every table kept: a batch opens each shard it touches once, and scans nothing
        batch = rng.permutation(37)[:8]
        opened.clear()
        shards.raws(batch)
        touched = {str(shards.paths[int(np.searchsorted(shards.first, i, side="right")) - 1]) for i in batch}
        assert sorted(opened) == sorted(touched)
    assert len(scanned) == len(shards.paths)


def test_a_batch_is_what_getitem_gives_sample_by_sample(folders):
    """__getitems__ reads in shard order but decodes in the sampler's order: the same random draws per sample."""
    shards = IndexedShards(folders)

    def transform(image):  # draws from the torch RNG, as a random crop does
        return to_tensor(image) + torch.rand(1)

    view = InstanceView(shards, np.random.default_rng(2).permutation(37), transform, captions="draw", seed=3)
    positions = [30, 2, 17, 5, 36, 0, 11]
    torch.manual_seed(0)
    batch = view.__getitems__(positions)
    torch.manual_seed(0)
    one_by_one = [view[p] for p in positions]
    for (x, caption, key, p), (x1, caption1, key1, p1) in zip(batch, one_by_one, strict=True):
        assert torch.equal(x, x1) and (caption, key, p) == (caption1, key1, p1)


def former_tonics_instances(folder: Path, keys: list[str], is_val: np.ndarray, triplets: bool) -> dict:
    """The instances as the former code derived them, with pandas and a pass per class."""
    classes = [n["class"] for n in json.loads((folder / "ontology.json").read_text())["nodes"]]
    t = pd.read_parquet(folder / "triplets.parquet")
    idx = t["index"].to_numpy(np.int64)
    cls = t["class"].to_numpy()
    out = {}
    if triplets:
        for split, keep in (("train", ~is_val[idx]), ("val", is_val[idx])):
            out[split] = {"samples": idx[keep], "spans": t[["start", "end"]].to_numpy(np.int64)[keep]}
        out["train"]["nodes"] = [(c, np.flatnonzero(cls[~is_val[idx]] == c)) for c in classes]
        return out
    for split, keep in (("train", ~is_val), ("val", is_val)):
        out[split] = {"samples": np.flatnonzero(keep), "spans": None}
    pos_of = {int(s): p for p, s in enumerate(out["train"]["samples"])}
    out["train"]["nodes"] = [(c, np.array([pos_of[s] for s in sorted(set(idx[cls == c].tolist())) if s in pos_of],
                                          dtype=np.int64)) for c in classes]
    return out


@pytest.mark.parametrize("triplets", [True, False])
def test_tonics_instances_are_the_former_codes(tmp_path, triplets):
    folder = write_folder(tmp_path / "t", [40, 40, 20], members=False)
    t = pq.read_table(folder / "triplets.parquet").to_pylist()
    t[3]["class"] = "not in the ontology"  # counted in no node, as before
    t += [dict(t[0], start=9, end=12)]  # a third triplet of one sample, of its first triplet's class
    pq.write_table(pa.Table.from_pylist(t), folder / "triplets.parquet")
    keys = [f"shard_{i:09d}" for i in range(100)]
    is_val = np.random.default_rng(4).random(100) < 0.3
    for given in (keys, IndexedShards([folder]).keys):  # a list, or the reader's KeyArray
        got = tonics_instances(folder, given, is_val, triplets)
        want = former_tonics_instances(folder, keys, is_val, triplets)
        for split in ("train", "val"):
            assert np.array_equal(got[split]["samples"], want[split]["samples"])
            assert got[split]["samples"].dtype == np.int64
            if triplets:
                assert np.array_equal(got[split]["spans"], want[split]["spans"])
            else:
                assert got[split]["spans"] is None
        assert [c for c, _ in got["train"]["nodes"]] == CLASSES
        for (_, a), (_, b) in zip(got["train"]["nodes"], want["train"]["nodes"], strict=True):
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="does not describe the first shard folder"):
        tonics_instances(folder, keys[:1] + ["x"] + keys[2:], is_val, triplets)


# Measured on the former code (wids reader with a list of keys, one Python bool per sample on the way to is_val,
# the triplets as a pandas frame): tonics 239, tonics triplets 285, grit 92 bytes per sample, so this test failed
# there; on this code 62, 90 and 43 (a KeyArray of 15-character keys, the triplets' index and class (and span) arrays,
# the views' and samplers' positions). tracemalloc's counts are exact, so the margins only absorb library versions.
GROWTH = {"tonics": 128, "triplets": 160, "grit": 64}


N_GROWTH = 2000


@pytest.fixture(scope="module")
def growth_folders(tmp_path_factory):
    """The 2,000- and 8,000-sample folders (shards of 50), written once for the three kinds: index_data only reads
    them."""
    tmp = tmp_path_factory.mktemp("growth")
    return {m: write_folder(tmp / str(m), [50] * (m // 50), members=False) for m in (N_GROWTH, 4 * N_GROWTH)}


@pytest.mark.parametrize("kind", list(GROWTH))
def test_the_index_samplers_set_up_holds_a_few_numpy_bytes_per_sample(growth_folders, kind):
    """The memory rule: index_data's peak grows by less than GROWTH[kind] bytes per extra sample from 2,000 to
    8,000 samples in shards of 50 (the former code: about twice to four times as much, see GROWTH)."""
    n = N_GROWTH
    data = growth_folders

    def run(m: int):
        cfg = Config(shards=[str(data[m])], batch_size=4,
                     sampler=SamplerConfig(kind="grit" if kind == "grit" else "tonics"))
        cfg.data.triplets = kind == "triplets"
        return index_data(cfg, False, None, None)

    assert growth_per_sample(run, n) < GROWTH[kind]

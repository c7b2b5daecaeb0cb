"""`vlprep pseudolabel` holds ALIGNED's captions as a compact table in memory-mapped files: the same outputs as the
former per-caption Python structures, and a peak memory that does not grow with the aligned set."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.memrule import growth_per_sample
from vlprep import knn
from vlprep.output import Out, finish_dataset, write_shard
from vlprep.pseudolabel import PseudolabelConfig, caption_words, pseudolabel
from vltrain.checkpoint_encoder import CheckpointEncoder

WORDS = [f"w{i}" for i in range(200)] + ["dog", "cat", "the", "a", "red", "tree"]


def aligned_set(root: Path, n: int, per_shard: int = 250, seed: int = 0) -> Path:
    """n aligned samples (a sidecar of key and caption; the tars hold the captions only: pseudolabel reads ALIGNED
    through its sidecars), Zipf captions over WORDS."""
    if root.exists():
        return root
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    sizes = {}
    for s in range(-(-n // per_shard)):
        shard = f"al-{s:06d}.tar"
        m = min(per_shard, n - s * per_shard)
        rows = []
        for i in range(m):
            ids = np.minimum(rng.zipf(1.4, int(rng.integers(3, 12))) - 1, len(WORDS) - 1)
            rows.append({"key": f"al_{s * per_shard + i:09d}", "caption": " ".join(WORDS[j] for j in ids) + "."})
        write_shard(Out(root), shard, [{"__key__": r["key"], "txt": r["caption"]} for r in rows], rows)
        sizes[shard] = m
    finish_dataset(Out(root), sizes, {"stage": "test"})
    return root


@pytest.mark.slow  # about 20 s: five runs of the stage, embedding up to 6,000 captions
def test_memory_does_not_grow_with_the_aligned_set(world, tmp_path):
    """Measured: +5 B per extra aligned caption; the former stage, whose driver (and worker) held every key, caption,
    word set and embedding in Python lists and arrays, grew by +578 B per aligned caption on the same data."""
    enc = CheckpointEncoder(world["ckpt"], "cpu")
    runs = []

    def run(m: int):
        runs.append(m)  # a new OUT each time: every run builds its index and table
        cfg = PseudolabelConfig(aligned=aligned_set(tmp_path / f"al{m}", m), unaligned=world["unaligned"],
                                out=tmp_path / f"o{len(runs)}", k=3, crops=2, batch_size=4, device="cpu")
        return pseudolabel(cfg, enc)

    assert growth_per_sample(run, 1500) < 50


def test_npy_appender_writes_what_numpy_reads(tmp_path):
    rng = np.random.default_rng(0)
    pieces = [rng.integers(-2**31, 2**31 - 1, m) for m in (0, 1, 7, 1000, 0, 3)]
    f = knn.NpyAppender(tmp_path / "a.npy", "<i4")
    for piece in pieces:
        f.append(piece)
    assert not (tmp_path / "a.npy").exists()  # under a .tmp name until closed
    f.close()
    got = np.load(tmp_path / "a.npy", mmap_mode="r")
    assert got.dtype == np.dtype("<i4") and (got == np.concatenate(pieces)).all()
    empty = knn.NpyAppender(tmp_path / "e.npy", "<i8")
    empty.close()
    assert np.load(tmp_path / "e.npy", mmap_mode="r").shape == (0,)
    assert not list(tmp_path.glob("*.tmp"))


def test_caption_table_is_the_per_caption_word_sets(tmp_path):
    """Row by row, the table's keys, words and document frequencies are the former lists of keys and frozensets and
    their Counter; word_counts over a sample's retrieved rows (repeats, IVF's -1) is the former Counter update."""
    rng = np.random.default_rng(1)
    captions = [" ".join(rng.choice(WORDS, int(rng.integers(0, 9)))) for _ in range(300)]
    captions += ["", "The a of, and!", "Dog dog DOG café naïve"]
    keys = [f"k_{i}_é" for i in range(len(captions))]
    writer = knn.CaptionTableWriter(tmp_path, "fp")
    for i in range(0, len(captions), 41):  # a shard at a time
        writer.add(keys[i:i + 41], (caption_words(c) for c in captions[i:i + 41]))
    writer.close()
    table = knn.CaptionTable(tmp_path)
    sets = [caption_words(c) for c in captions]
    df = Counter(w for ws in sets for w in ws)
    assert len(table) == len(captions) and len(table.keys) == len(keys)
    assert [table.keys[j] for j in range(len(keys))] == keys
    assert [set(table.words(j)) for j in range(len(captions))] == [set(ws) for ws in sets]
    assert dict(zip(table.vocab, table.df.tolist())) == df
    assert knn.table_fingerprint(tmp_path) == "fp" and knn.table_fingerprint(tmp_path / "none") is None
    for _ in range(50):
        rows = rng.integers(-1, len(captions), (3, 4))
        expected = Counter()
        for j in rows.ravel().tolist():
            if j >= 0:
                expected.update(sets[j])
        counts, dfs = table.word_counts(rows)
        assert counts == expected and dfs == {w: df[w] for w in expected}
    assert table.word_counts(np.full((2, 3), -1)) == ({}, {})
    (tmp_path / "x").mkdir()
    failed = knn.CaptionTableWriter(tmp_path / "x", "fp")
    with pytest.raises(KeyError), failed:
        failed.add(["k"], [{"w"}])
        raise KeyError("a failure while writing")
    assert [p.name for p in (tmp_path / "x").iterdir() if not p.name.endswith(".tmp")] == []  # nothing final
    assert all(f.f.closed for f in failed.files.values())


def run_stage(w, aligned, out, **kw):
    enc = CheckpointEncoder(w["ckpt"], "cpu")
    return pseudolabel(PseudolabelConfig(aligned=aligned, unaligned=w["unaligned"], out=out, k=3, crops=2,
                                         batch_size=4, device="cpu", **kw), enc)


def files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".tar", ".faiss", ".npy")
            or (p.suffix == ".parquet" and p.name != "knn_captions.parquet")}


def test_output_does_not_depend_on_the_aligned_sharding(world, tmp_path):
    """600 ALIGNED captions in shards of 97 or in one shard give the same index, caption table and output bytes (the
    table's rows and offsets run on across shards; the captions are embedded in batches of 256 across them, though
    this tiny text tower would embed a shorter batch alike)."""
    a97 = aligned_set(tmp_path / "a97", 600, per_shard=97)
    a600 = aligned_set(tmp_path / "a600", 600, per_shard=600)
    run_stage(world, a97, tmp_path / "o97")
    run_stage(world, a600, tmp_path / "o600")
    got = files(tmp_path / "o97")
    want = files(tmp_path / "o600")
    # the sidecars' metadata holds the index fingerprint, which hashes ALIGNED's sidecars: their rows must agree
    for name in [n for n in got if n.endswith(".parquet")]:
        assert pq.read_table(tmp_path / "o97" / name).replace_schema_metadata(None).equals(
            pq.read_table(tmp_path / "o600" / name).replace_schema_metadata(None))
        del got[name], want[name]
    assert got == want


def test_a_missing_or_stale_table_is_rebuilt(world, tmp_path, monkeypatch):
    """The index is reused only with a caption table of its fingerprint (an OUT of an older vlprep has none).

    The report's figures (report.json's "plots", drawn after every output file is written) are left out of these four
    runs: nothing here reads them, and matplotlib cost about half of each run; the other pseudolabel tests draw them."""
    monkeypatch.setattr("vlprep.report.pseudolabel_figures", lambda *args: {})
    first = run_stage(world, world["aligned"], tmp_path / "o")
    before = files(tmp_path / "o")
    (tmp_path / "o" / knn.VOCAB).unlink()
    assert run_stage(world, world["aligned"], tmp_path / "o", overwrite=True)["index"]["reused"] is False
    assert files(tmp_path / "o") == before and (tmp_path / "o" / knn.VOCAB).exists()
    vocab = json.loads((tmp_path / "o" / knn.VOCAB).read_text())
    (tmp_path / "o" / knn.VOCAB).write_text(json.dumps({**vocab, "fingerprint": "another"}))
    again = run_stage(world, world["aligned"], tmp_path / "o", overwrite=True)
    assert again["index"]["reused"] is False and files(tmp_path / "o") == before
    assert run_stage(world, world["aligned"], tmp_path / "o", overwrite=True)["index"]["reused"] is True
    assert (again["aligned_captions"], again["aligned_vocab"]) == (first["aligned_captions"], first["aligned_vocab"])


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_index_builder_is_build_index_over_all_rows(tmp_path, kind):
    """Rows added in uneven batches give the index build_index makes from them in one array, byte for byte."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((500, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    builder = knn.IndexBuilder(kind, len(x), 8)
    for i, j in [(0, 256), (256, 300), (300, 500)]:
        builder.add(x[i:j])
    knn.save_index(builder.finish(), tmp_path / "built.faiss")
    knn.save_index(knn.build_index(x, kind), tmp_path / "whole.faiss")
    assert (tmp_path / "built.faiss").read_bytes() == (tmp_path / "whole.faiss").read_bytes()
    short = knn.IndexBuilder(kind, 3, 8)
    short.add(x[:2])
    with pytest.raises(ValueError, match="2 rows added, 3 announced"):
        short.finish()

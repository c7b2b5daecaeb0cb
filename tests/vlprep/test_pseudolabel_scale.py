"""`vlprep pseudolabel` holds ALIGNED's captions as a compact table in memory-mapped files: the same outputs as the
former per-caption Python structures, and a peak memory that does not grow with the aligned set."""

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tiny_checkpoint
from tests.memrule import growth_per_sample
from vlprep.output import Out, finish_dataset, write_shard
from vlprep.pseudolabel import PseudolabelConfig, pseudolabel
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
    """The peak grows by B per extra aligned caption (measured); the former stage, whose driver held every key, caption,
    word set and embedding in Python lists and arrays, grew by B per aligned caption on the same data."""
    enc = CheckpointEncoder(world["ckpt"], "cpu")
    runs = []

    def run(m: int):
        runs.append(m)  # a new OUT each time: every run builds its index and table
        cfg = PseudolabelConfig(aligned=aligned_set(tmp_path / f"al{m}", m), unaligned=world["unaligned"],
                                out=tmp_path / f"o{len(runs)}", k=3, crops=2, batch_size=4, device="cpu")
        return pseudolabel(cfg, enc)

    growth = growth_per_sample(run, 1500)
    print("growth", growth)
    assert growth < 50

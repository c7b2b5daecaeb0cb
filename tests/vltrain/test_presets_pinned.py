"""Five presets' first 20 steps on tiny data, pinned: a change to the trainer's structure must not change one number.

The pins (tests/vltrain/data/preset_pins.json) were written by this file at the commit before the trainer was split into
modules (ee0e786, "vlprep: one run_stage tail ..."), and every later tree must reproduce them: the training rows'
losses, learning rates and distillation weights, the held-out recalls, and TOnICS' curriculum checks.

The runs compute in float64 (default dtype float64, each batch's images fixed float64 tensors of their keys), so
the pins hold on any x86-64 CPU: float32 losses after 20 steps differ between CPUs' kernels in their last digits,
float64 ones in the last few of 16. The tolerance is rel 1e-9: AdamW divides by sqrt(v) + eps, eps = 1e-8, so a float64 rounding
difference of the gradient (~1e-16 relative) moves a parameter by at most lr * 1e-16 * |g| / 1e-8 per step, ~1e-9
of the loss over 20 steps at lr 0.01 and |g| < 1. Recalls are rank counts: they are compared exactly (the
similarities they rank are float64, so no near-tie within float32 rounding can flip one).

Regenerate (only for an intended change of numbers, saying why in the commit): VLTRAIN_WRITE_PINS=1 pytest this file.
"""

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ontology_dataset
from vltrain.data import collate as collate_mod
from vltrain.config_load import load_config
from vltrain.train import train

PINS = Path(__file__).parent / "data" / "preset_pins.json"
PRESETS = ["clip", "albef", "grit", "tonics", "softmask"]
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=16", "log_every=1", "optim.warmup_steps=3", "optim.lr=0.01",
        "data.val_frac=0.25", "eval_every=10", "ckpt_every=10",
        # the random stream and the padded batches as they were pinned (length bucketing and length groups came
        # later: tests/vltrain/test_speed.py)
        "data.bucket=0", "train.unpad=false"]
PER_PRESET = {  # the tiny BERT has 2 layers: split 1 + 1; queues and GRIT's search space sized for 36 pairs
    "clip": [],
    "albef": ["model.fusion_layers=1", "model.queue_size=16", "model.momentum_m=0.9"],
    "grit": ["model.fusion_layers=1", "sampler.search_space=8", "sampler.queue_size=16"],
    "tonics": ["sampler.refresh_every=5", "sampler.threshold=0"],
    "softmask": ["model.fusion_layers=1", "model.queue_size=16", "model.momentum_m=0.9"],
}
# metrics.jsonl keys that are measurements of the machine, not results of the arithmetic
TIMING = {"samples_per_s"}


@pytest.fixture(scope="module")
def onto(tmp_path_factory):
    return ontology_dataset(tmp_path_factory.mktemp("pins"))


def pixels_of(key: str, shape) -> torch.Tensor:
    """A fixed float64 image for a sample key: numpy's PCG64 seeded by the key's CRC (the same bits on any CPU)."""
    return torch.from_numpy(np.random.default_rng(zlib.crc32(key.encode())).standard_normal(tuple(shape)))


@pytest.fixture
def float64(monkeypatch):
    """Models built in float64, and every batch's images replaced by fixed float64 images of their keys.

    The images the trainer's transforms produce depend on the CPU's uint8 resize and colour kernels (an AVX2 path
    rounds differently from the scalar one), so the batch's images are swapped for a function of the keys alone;
    everything else (captions, tokens, sampling, the loop) is the trainer's own.
    """
    collate = collate_mod.Collate.__call__

    def to64(self, batch):
        out = collate(self, batch)
        if out is not None:
            shape = out["images"].shape[1:]
            out["images"] = torch.stack([pixels_of(k, shape) for k in out["keys"]])
        return out

    monkeypatch.setattr(collate_mod.Collate, "__call__", to64)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def pinned_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def close(a, b, path: str = "") -> list[str]:
    """Where a and b differ: floats beyond rel 1e-9 (abs 1e-12), anything else at all."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in close(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
        return [] if abs(a - b) <= 1e-12 + 1e-9 * abs(b) else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("preset", PRESETS)
def test_twenty_steps_reproduce_the_pinned_metrics(onto, tmp_path, float64, preset):
    cfg = load_config(preset, shards=[str(onto)], out=str(tmp_path / preset), steps=20, batch_size=4, device="cpu",
                      sets=TINY + PER_PRESET[preset])
    train(cfg)
    rows = pinned_rows(tmp_path / preset)
    assert [r["step"] for r in rows if "total" in r] == list(range(1, 21))
    if os.environ.get("VLTRAIN_WRITE_PINS"):
        pins = json.loads(PINS.read_text()) if PINS.exists() else {}
        pins[preset] = rows
        PINS.parent.mkdir(exist_ok=True)
        PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {preset}'s pins")
    diffs = close(rows, json.loads(PINS.read_text())[preset])
    assert not diffs, "\n".join(diffs[:20])

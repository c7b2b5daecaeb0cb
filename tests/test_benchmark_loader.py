"""benchmarks/loader.py --quick, in-process: a row per (augment, worker count), each side's rate positive, the same
samples read by all three sides, the bytes each sample costs in the worker queue, and the ratios; the bare side's
transform is the trainer's, op for op, and the before side's the same with torchvision's own RandAugment, jitter and
blur."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def bench_loader(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(BENCH)] + sys.path)  # the script's own imports (common); restored after
    return importlib.import_module("loader")


@pytest.mark.slow  # torchvision's import alone is 3-5 s on 2 cores when no earlier test paid it
def test_the_bare_side_runs_the_trainers_transform(monkeypatch):
    # equal work: the baseline's uint8 transform is the trainer's op for op (each op's repr names its parameters:
    # crop size, scale, ratio, interpolation, antialias, RandAugment's ops and magnitude, jitter, blur kernel; each
    # op's class, RandomApply's inner ones too: RandAugment is vltrain.data.randaug's, softmask's jitter and blur
    # vltrain.data.colour's); the before side has the same ops with torchvision's own RandAugment, jitter and blur
    # (what the trainer ran before), then exactly ToDtype(float32) + Normalize
    from torchvision.transforms import v2

    from vltrain.data import colour, randaug
    from vltrain.data.samples import train_transform

    def ops(transforms) -> list:
        return [(type(t), repr(t), [type(u) for u in getattr(t, "transforms", [])]) for t in transforms]

    def torchvisions(op: tuple) -> tuple:
        swap = {colour.ColorJitter: v2.ColorJitter, colour.GaussianBlur: v2.GaussianBlur,
                randaug.RandAugment: v2.RandAugment}
        return swap.get(op[0], op[0]), op[1], [swap.get(u, u) for u in op[2]]

    loader = bench_loader(monkeypatch)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    for augment in ("none", "albef", "softmask"):
        for how in ("bilinear", "bicubic"):
            ours = ops(train_transform(96, mean, std, 0.6, augment, how).transforms)
            bare = loader.plain_transform(96, mean, std, 0.6, augment, how, "uint8")
            before = loader.plain_transform(96, mean, std, 0.6, augment, how, "float32")
            assert ops(bare.transforms) == ours, (augment, how)
            assert ops(before.transforms[:-2]) == [torchvisions(op) for op in ours], (augment, how)
            assert [type(t).__name__ for t in before.transforms[-2:]] == ["ToDtype", "Normalize"]
            assert repr(before.transforms[-1]) == repr(type(before.transforms[-1])(mean, std))
    inner = [u for op in ops(train_transform(96, mean, std, 0.6, "softmask").transforms) for u in op[2]]
    assert colour.ColorJitter in inner and colour.GaussianBlur in inner
    for augment in ("albef", "softmask"):
        assert randaug.RandAugment in [op[0] for op in ops(train_transform(96, mean, std, 0.6, augment).transforms)]


@pytest.mark.slow  # the benchmark builds 3 pipelines and 18 loaders; about 10-25 s with its imports on 2 cores
def test_the_quick_loader_benchmark_fills_its_table(tmp_path, monkeypatch, capsys):
    loader = bench_loader(monkeypatch)
    out = tmp_path / "loader.json"
    rows = loader.main(["--quick", "--workers", "2", "--json", str(out)])
    assert [(r["augment"], r["workers"]) for r in rows] == [(a, w) for a in ("none", "albef", "softmask")
                                                            for w in (1, 2)]
    size = 64  # --quick's image size
    for r in rows:
        assert r["runs"] == 1
        for side in ("vltrain", "bare", "before"):
            assert r[f"{side}_per_s"] > 0 and r[f"{side}_per_cpu_s"] > 0 and r[f"{side}_cpu_s"] > 0, (side, r)
            # 16 images in 4 shards of 4, batches of 4 with drop_last: every image once, on every side
            assert r[f"{side}_samples"] == 16, (side, r)
        assert r["bare_bytes_per_sample"] == 3 * size * size  # uint8 C x S x S, as the trainer ships
        assert r["before_bytes_per_sample"] == 3 * size * size * 4  # float32, as it shipped before
        assert r["vltrain_bytes_per_sample"] in {3 * size * size * k for k in (1, 2, 4)}  # uint8, 16-bit or float32
        for name, other in (("overhead", "bare"), ("speedup", "before")):
            assert r[name] == r["vltrain_per_s"] / r[f"{other}_per_s"]
            assert r[f"{name}_per_cpu_s"] == r["vltrain_per_cpu_s"] / r[f"{other}_per_cpu_s"]
            assert r[f"{name}_cpu_ratio"] == r["vltrain_cpu_s"] / r[f"{other}_cpu_s"]
    record = json.loads(out.read_text())
    assert record["rows"] == rows and record["targets"] == {"overhead": 0.9, "speedup": 1.5}
    text = capsys.readouterr().out
    assert "vs bare" in text and "vs before" in text and "load average at end" in text

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.leakguard import MARK, guard
from tests.slowest import Slowest

# --- the leak guard (tests/leakguard.py): every test, module and the session must leave the process as they found it


def pytest_configure(config) -> None:
    # the session's mark, inherited by every process a test starts (leakguard.started_here); a pytest that a test
    # runs inside this one keeps its parent's. An xdist worker (`-n 2`) takes a mark of its own in place of the one
    # it inherits from the controller, so that one worker's children are never counted as another worker's leaks.
    if hasattr(config, "workerinput"):
        os.environ[MARK] = uuid.uuid4().hex
        # each worker its share of the cores, for torch in this process and (OMP_NUM_THREADS) in the processes its
        # tests start, unless the caller chose: workers with a thread per core each oversubscribe the machine, and
        # OpenMP's spinning threads then cost more than the second worker gains
        share = max(1, len(os.sched_getaffinity(0)) // int(config.workerinput["workercount"]))
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:
        os.environ.setdefault(MARK, uuid.uuid4().hex)
    config.pluginmanager.register(Slowest(), "slowest")


def pytest_runtest_setup(item) -> None:
    # `cuda` tests: a skip without a device, unless the GPU check asks for them with VLTRAIN_REQUIRE_CUDA=1, where
    # a skip would hide that they never ran (a driver that does not load, a CPU-only torch)
    if item.get_closest_marker("cuda") is None or torch.cuda.is_available():
        return
    if os.environ.get("VLTRAIN_REQUIRE_CUDA") == "1":
        pytest.fail("VLTRAIN_REQUIRE_CUDA=1 but torch sees no CUDA device", pytrace=False)
    pytest.skip("needs a CUDA device")


@pytest.fixture(autouse=True, scope="session")
def session_leaves_no_trace():
    yield from guard("the session-scoped fixtures")


@pytest.fixture(autouse=True, scope="module")
def module_leaves_no_trace(request):
    yield from guard(f"the module-scoped fixtures of {request.module.__name__}")


@pytest.fixture(autouse=True)
def test_leaves_no_trace(request):
    yield from guard(request.node.nodeid)


@pytest.fixture
def default_float64():
    """torch's default dtype float64 for the test (models and tensors built in it), the caller's back after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
THINGS = ["dog", "cat", "car", "boat", "tree", "house", "bird", "kite"]


def image_bytes(w: int = 48, h: int = 32, fmt: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    """A small random image encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, size=(h, w, len(mode)), dtype=np.uint8)
    im = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """12 images (png and jpg) with captions in a nested folder."""
    root = tmp_path / "imgs"
    (root / "sub").mkdir(parents=True)
    for i in range(12):
        fmt, ext = ("JPEG", "jpg") if i % 3 == 0 else ("PNG", "png")
        d = root / "sub" if i % 2 else root
        (d / f"img{i:02d}.{ext}").write_bytes(image_bytes(40 + i, 30 + i, fmt, seed=i))
        (d / f"img{i:02d}.txt").write_text(f"a picture  of thing {i}\n")
    return root


def tiny_checkpoint(path: Path, embed_dim: int = 16, image_model: str = "tiny", seed: int = 0) -> Path:
    """A random tiny model saved in vltrain's checkpoint format (model state dict + the asdict'ed Config)."""
    from vltrain.config import Config, DataConfig, to_dict
    from vltrain.config import ModelConfig
    from vltrain.model import build_model

    torch.manual_seed(seed)
    mc = ModelConfig(text_model="tiny", image_model=image_model, embed_dim=embed_dim, fusion_layers=0, feature_dim=8)
    torch.save({"model": build_model(mc).state_dict(),
                "config": to_dict(Config(model=mc, data=DataConfig(image_size=32, max_len=12)))}, path)
    return path


WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "car", "boat", "house", "sun", "moon"]


def colour_pairs(tmp: Path, n: int, per_shard: int = 4) -> Path:
    """tmp/src: n pairs, a near-solid colour per image (it survives random crops) and distinct captions
    "a WORD WORD number i" (the trainer tests' data); sharded into tmp/ds, which is returned."""
    src = tmp / "src"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        noise = rng.integers(-20, 20, (40, 40, 3))
        Image.fromarray(np.clip(rng.integers(0, 255, 3) + noise, 0, 255).astype(np.uint8)).save(src / f"{i:03d}.png")
        (src / f"{i:03d}.txt").write_text(f"a {WORDS[i % 12]} {WORDS[(i * 5 + 1) % 12]} number {i}")
    from vlprep.shards import ShardsConfig, build_shards

    build_shards(ShardsConfig(src=src, out=tmp / "ds", samples_per_shard=per_shard, workers=1))
    return tmp / "ds"


def make_dataset(root: Path, captions: list[str], per_shard: int, seed: int = 0, prefix: str = "shard") -> Path:
    src = root.with_name(root.name + "-src")
    src.mkdir(parents=True)
    for i, c in enumerate(captions):
        (src / f"{i:04d}.png").write_bytes(image_bytes(20 + i % 7, 16 + i % 5, seed=seed + i))
        (src / f"{i:04d}.txt").write_text(c)
    from vlprep.shards import ShardsConfig, build_shards

    build_shards(ShardsConfig(src=src, out=root, samples_per_shard=per_shard, workers=1, prefix=prefix))
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(pseudolabel, embed) A tiny checkpoint, 40 distinct aligned captions in 4 shards, 14 unaligned images in 3 shards."""
    tmp = tmp_path_factory.mktemp("pseudo")
    caps = [f"A {COLOURS[i % 6]} {THINGS[i % 8]} and the {THINGS[(i * 3 + 1) % 8]}, number {i}" for i in range(40)]
    return {"tmp": tmp, "ckpt": tiny_checkpoint(tmp / "ckpt.pt"),
            "aligned": make_dataset(tmp / "aligned", caps, 10, prefix="al"),
            "unaligned": make_dataset(tmp / "unaligned", ["a caption nobody reads"] * 14, 5, seed=500, prefix="un"),
            "captions": caps}


def detected_dataset(tmp_path: Path, captions: list[str], objects: list[list[str]]) -> Path:
    """Shards of `captions` with detections imported from a file: `objects` at 0.9, plus a 0.1-score tv each."""
    src = tmp_path / "src"
    src.mkdir()
    for i, c in enumerate(captions):
        (src / f"{i}.png").write_bytes(image_bytes(16, 16, seed=i))
        (src / f"{i}.txt").write_text(c)
    from vlprep.detect import DetectConfig, detect
    from vlprep.shards import ShardsConfig, build_shards

    build_shards(ShardsConfig(src=src, out=tmp_path / "raw", samples_per_shard=4, workers=1))
    lines = [json.dumps({"key": f"shard_{i:09d}", "objects": [{"label": o, "score": 0.9, "box": [0, 0, 0.5, 1]}
                                                              for o in objs] + [{"label": "tv", "score": 0.1,
                                                                                 "box": [0, 0, 1, 1]}]})
             for i, objs in enumerate(objects)]
    (tmp_path / "dets.jsonl").write_text("\n".join(lines) + "\n")
    detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "det", from_file=tmp_path / "dets.jsonl", min_score=0.3))
    return tmp_path / "det"


ANIMALS = ["cat", "dog", "bird"]
ONTO_COLOURS = ["red", "green", "blue", "yellow"]


def ontology_dataset(tmp: Path) -> Path:
    """48 pairs (near-solid colours that survive crops) with a hand-made ontology (the vlprep ontology output
    contract): one triplet per caption's animal, a second 'pet' triplet for cats (two triplets of one image in one
    node). Written to tmp/ds."""
    from collections import Counter

    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlprep.shards import ShardsConfig, build_shards

    src = tmp / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(48):
        animal, colour = ANIMALS[i % 3], ONTO_COLOURS[i % 4]
        Image.fromarray(np.clip(rng.integers(0, 255, 3) + rng.integers(-20, 20, (40, 40, 3)), 0, 255)
                        .astype(np.uint8)).save(src / f"{i:03d}.png")
        caption = f"a {colour} {animal} number {i}" + (" and a pet" if animal == "cat" else "")
        (src / f"{i:03d}.txt").write_text(caption)
        start = caption.index(animal)
        rows.append({"key": f"shard_{i:09d}", "index": i, "noun": animal, "start": start,
                     "end": start + len(animal), "class": animal})
        if animal == "cat":
            rows.append({"key": f"shard_{i:09d}", "index": i, "noun": "pet", "start": caption.index("pet"),
                         "end": caption.index("pet") + 3, "class": "cat"})
    ds = tmp / "ds"
    build_shards(ShardsConfig(src=src, out=ds, samples_per_shard=10, workers=1))
    pq.write_table(pa.Table.from_pylist(rows), ds / "triplets.parquet")
    counts = Counter(r["class"] for r in rows)
    (ds / "ontology.json").write_text(json.dumps({
        "root": {"name": "entity", "instances": 48},
        "nodes": [{"class": c, "nouns": [c], "instances": counts[c]} for c in ANIMALS]}))
    return ds


def features_pairs(tmp: Path, n: int = 120, per_shard: int = 40) -> Path:
    """colour_pairs' n pairs (in tmp/ds) with `vlprep features` tokens at 64 px in tmp/feat, which is returned:
    EfficientNet-Lite0's 2x2 grid, so every `npy` member is (4, 1280) float16."""
    from vlprep.features import FeaturesConfig, features

    ds = colour_pairs(tmp, n, per_shard)
    features(FeaturesConfig(src=ds, out=tmp / "feat", size=64, device="cpu", decode_threads=0))
    return tmp / "feat"


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def replace_member(folder: Path, name: str, data: bytes) -> Path:
    """Rewrite the shard of `folder` that holds member `name` (e.g. KEY.npy) with `data` in its place, every other
    member and the member order kept; returns the shard."""
    import tarfile

    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        if name not in [m.name for m, _ in members]:
            continue
        with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
            for m, body in members:
                body = data if m.name == name else body
                m.size = len(body)
                tar.addfile(m, io.BytesIO(body))
        return shard
    raise FileNotFoundError(f"no member {name} in {folder}")


def cli_in_process(capfd, *args) -> subprocess.CompletedProcess:
    """`python -m vlprep.cli ARGS` as its `main()` in this process: exit status and what reached fds 1 and 2."""
    from vlprep.cli import main

    capfd.readouterr()
    argv, sys.argv = sys.argv, ["vlprep.cli", *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as e:  # typer exits 0 on success too
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv = argv
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture
def vlprep(capfd, monkeypatch):
    """vlprep(*ARGS, cwd=None): `vlprep ARGS` as its main() in this process (cli_in_process), run in `cwd` (this
    process's, restored after the test)."""
    def run(*args, cwd=None) -> subprocess.CompletedProcess:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        return cli_in_process(capfd, *args)
    return run

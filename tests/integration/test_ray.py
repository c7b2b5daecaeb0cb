"""--distributor ray on a local 2-CPU Ray: the outputs are sha256-identical to the local run (shards, bow,
detect --from-file), each actor runs its initializer once, and worker errors come back as one line.

One Ray for the module: starting it takes several seconds here. The stages find it initialised and never
call ray.init themselves.
"""

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import image_bytes
from vlprep import VlprepError
from vlprep.bow import BowConfig, bow
from vlprep.detect import DetectConfig, detect
from vlprep.engine import Work, map_shards
from vlprep.output import Out
from vlprep.shards import ShardsConfig, build_shards

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parents[1]  # tests/


@pytest.fixture(scope="module")
def local_ray():
    """A local 2-CPU Ray for this module, and afterwards the process as it was: ray.init sets RAY_* variables and
    PYTHONBREAKPOINT in os.environ and installs a SIGTERM handler, and ray.shutdown undoes neither (every later test's
    subprocesses inherited the variables, and the handler outlived the cluster)."""
    # In CI the [ray] extra is installed (Makefile): a missing Ray fails there rather than skipping.
    ray = __import__("ray") if os.environ.get("CI") else pytest.importorskip("ray")
    env, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # The actors import vlprep and this test folder (for the helpers below) like the driver does.
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(env)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file the contract covers: tars, parquet sidecars, index.json, sizes.json."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix in (".tar", ".parquet") or p.name in ("index.json", "sizes.json")}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """23 captioned images (PNG and JPEG, one corrupt, one without a caption): 6 shards of 4."""
    src = tmp_path_factory.mktemp("raysrc")
    for i in range(23):
        fmt, ext = ("JPEG", "jpg") if i % 3 == 0 else ("PNG", "png")
        (src / f"{i:03d}.{ext}").write_bytes(image_bytes(20 + i, 16 + i % 5, fmt, seed=i) if i != 7 else b"junk")
        if i != 11:
            (src / f"{i:03d}.txt").write_text(f"A red dog and the {['cat', 'car', 'tree'][i % 3]} number {i}.")
    return src


def test_shards_bow_and_detect_on_ray_are_byte_identical_to_local(local_ray, source, tmp_path):
    local = build_shards(ShardsConfig(src=source, out=tmp_path / "raw-local", samples_per_shard=4, workers=1))
    on_ray = build_shards(ShardsConfig(src=source, out=tmp_path / "raw-ray", samples_per_shard=4, workers=2,
                                       distributor="ray"))
    assert digests(tmp_path / "raw-local") == digests(tmp_path / "raw-ray")
    assert len(digests(tmp_path / "raw-ray")) == 2 * 6 + 2 and on_ray["written"] == local["written"] == 21
    assert on_ray["skipped"] == {"corrupt_image": 1, "missing_caption": 1}

    raw = tmp_path / "raw-local"
    ops = "shuffle,rmstop,basevocab,rmtop:2,keep:3"
    bow(BowConfig(src=raw, out=tmp_path / "bow-local", ops=ops, base_frac=0.5, workers=1))
    bow(BowConfig(src=raw, out=tmp_path / "bow-ray", ops=ops, base_frac=0.5, workers=2, distributor="ray"))
    assert digests(tmp_path / "bow-local") == digests(tmp_path / "bow-ray")

    keys = [r["key"] for s in sorted(raw.glob("*.parquet")) for r in __import__("pyarrow.parquet").parquet
            .read_table(s, columns=["key"]).to_pylist()]
    dets = tmp_path / "dets.jsonl"
    dets.write_text("".join(json.dumps({"key": k, "objects": [{"label": "dog", "score": 0.5 + i % 5 / 10,
                                                               "box": [0, 0.1, 0.5, 1]}]}) + "\n"
                            for i, k in enumerate(keys)))
    detect(DetectConfig(src=raw, out=tmp_path / "det-local", from_file=dets, min_score=0.6))
    rep = detect(DetectConfig(src=raw, out=tmp_path / "det-ray", from_file=dets, min_score=0.6, workers=2,
                              distributor="ray"))
    assert digests(tmp_path / "det-local") == digests(tmp_path / "det-ray")
    assert rep["samples"] == 21 and 0 < rep["with_objects"] < 21


def test_ray_resumes_a_local_run_and_a_local_run_resumes_ray(local_ray, source, tmp_path):
    build_shards(ShardsConfig(src=source, out=tmp_path / "o", samples_per_shard=4, workers=1))
    before = digests(tmp_path / "o")
    (tmp_path / "o" / "shard-000002.tar").unlink()
    rep = build_shards(ShardsConfig(src=source, out=tmp_path / "o", samples_per_shard=4, workers=2,
                                    distributor="ray"))
    assert rep["shards_resumed"] == 5 and digests(tmp_path / "o") == before


_state: dict = {}


def _init(tag: str) -> None:
    _state["inits"] = _state.get("inits", 0) + 1
    _state["tag"] = tag


def _count(out: Path, n: int, fp: str) -> dict:
    return {"in": n, "pid": os.getpid(), "inits": _state["inits"], "tag": _state["tag"]}


def _fail(out: Path, n: int, fp: str) -> dict:
    raise VlprepError(f"shard {n} is bad")


def test_each_actor_runs_the_initializer_once_and_errors_stay_one_line(local_ray, tmp_path):
    plan = [Work(f"s-{n:06d}.tar", (n,), "", n) for n in range(8)]
    stats, _ = map_shards(Out(tmp_path), plan, _count, init=_init, initargs=("t",), workers=2, distributor="ray")
    assert {s["tag"] for s in stats.values()} == {"t"} and all(s["inits"] == 1 for s in stats.values())
    assert len({s["pid"] for s in stats.values()}) == 2 and os.getpid() not in {s["pid"] for s in stats.values()}
    with pytest.raises(VlprepError) as e:
        map_shards(Out(tmp_path), plan[:2], _fail, workers=2, distributor="ray")
    assert str(e.value) in ("shard 0 is bad", "shard 1 is bad")  # the worker's own error, not Ray's traceback


def test_filter_on_ray_is_byte_identical_to_local(local_ray, source, tmp_path):
    from vlprep.filter import FilterConfig, filter_dataset

    raw = tmp_path / "raw"
    build_shards(ShardsConfig(src=source, out=raw, samples_per_shard=4, workers=1))
    rules = {"min_side": 18, "dedup": ["image", "caption", "pair"]}
    local = filter_dataset(FilterConfig(src=raw, out=tmp_path / "f-local", workers=1, **rules))
    on_ray = filter_dataset(FilterConfig(src=raw, out=tmp_path / "f-ray", workers=2, distributor="ray", **rules))
    assert digests(tmp_path / "f-local") == digests(tmp_path / "f-ray")  # dropped.parquet among them
    assert on_ray["dropped"] == local["dropped"] and 0 < on_ray["dropped"]["min_side"] < on_ray["samples_in"]

"""vlprep's stages on a Ray cluster whose nodes share no filesystem: outputs byte-identical to the same stage run
locally, every shard done by actors on a node that cannot see a file the driver wrote.

How the cluster is made (one for the module, `cluster`):
- moto's S3 server on 127.0.0.1 holds SRC and OUT (tests/integration/servers.py); the AWS_* variables that point
  botocore at it are set in the driver and given to both nodes.
- The head node is a plain `ray start --head --num-cpus 0`: it runs the GCS and the driver's raylet but takes no
  actor (vlprep's actors ask for one CPU each), so every actor is placed on the second node.
- The second node is `ray start --address HEAD --num-cpus 2` inside `unshare --mount --propagation private`, after a
  private tmpfs is mounted over /tmp, over TMPDIR and over pytest's base temporary folder where those lie elsewhere:
  its raylet and every worker it starts see empty folders there, so no file the driver wrote under them (its staging
  folders TMPDIR/vlprep-out-UID/HASH, the local datasets, the pytest folders) can be read by a worker. The repository
  and the virtual environment stay visible, as an installed package is on every node (a clone under /tmp is held
  aside on a private tmpfs before the masks and bound back at its path after them). The one file a worker may
  need from outside, the encoder's checkpoint (an input the user installs on each node, not something the driver
  makes), is copied into the node's private /tmp at the same path before `ray start`.
- The driver joins with `ray.init(address=HEAD)`; the stages find Ray initialised and use it (vlprep.engine). Each
  test counts the actors Ray placed on the second node (the GCS's actor table) and checks that there were some.
- Token authentication, Ray's default for `ray start`, is switched off for the test cluster (RAY_AUTH_MODE=disabled
  in the nodes' environment only), so the test needs no token in ~/.ray and leaves the driver's mode alone.
- Teardown: the driver disconnects, both `ray start --block` processes get SIGTERM (they stop their own Ray
  processes), and any process still carrying this cluster's mark in its environment is killed and waited for.
Skipped with the reason where `unshare --mount` or mounting a tmpfs is not permitted (not root, a container without
CAP_SYS_ADMIN).
"""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import colour_pairs, image_bytes, tiny_checkpoint
from tests.integration.servers import free_port, moto_s3, need, s3_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
TESTS = ROOT / "tests"
NODE_MARK = "VLPREP_TEST_RAY_NODE"  # in the environment of every process of the test cluster


def _unshare_permitted() -> str | None:
    """None, or why a private mount namespace with a tmpfs cannot be made here."""
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    with tempfile.TemporaryDirectory() as probe:
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs none {probe}"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"unshare --mount with a tmpfs is not permitted here ({(r.stderr.strip() or 'no reason given')[:200]})"
    return None


def _marked(mark: str) -> list[int]:
    """The running processes whose environment carries NODE_MARK=mark."""
    needle = f"{NODE_MARK}={mark}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry.name}/stat", "rb") as s:
                        if s.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                            found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _masks(basetemp: Path) -> list[str]:
    """The folders the second node gets a private tmpfs over: /tmp, TMPDIR, pytest's base temp (outermost only)."""
    folders = sorted({"/tmp", os.path.realpath(tempfile.gettempdir()), os.path.realpath(basetemp)}, key=len)
    kept: list[str] = []
    for f in folders:
        if not any(f == k or f.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(f)
    return kept


def _kept_visible(masks: list[str]) -> list[str]:
    """The repository and the virtual environment where they lie under a masked folder (a clone in /tmp): the node
    sees them again through bind mounts, as an installed package is on every node (outermost only)."""
    inside = [os.path.realpath(p) for p in (ROOT, sys.prefix)]
    inside = [p for p in inside if any(p == m or p.startswith(m.rstrip("/") + "/") for m in masks)]
    kept: list[str] = []
    for p in sorted(set(inside), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


def _holder(masks: list[str], kept: list[str]) -> str:
    """A folder outside every mask and kept path, over which the node's namespace mounts a tmpfs of its own to hold
    the kept folders while /tmp is masked (the mount is private: the host's folder is untouched)."""
    for h in ("/mnt", "/media", "/srv", "/opt"):
        if os.path.isdir(h) and not any(p == h or p.startswith(h + "/") or h.startswith(p.rstrip("/") + "/")
                                        for p in [*masks, *kept]):
            return h
    raise RuntimeError("no folder to hold the repository while /tmp is masked (clone it outside /tmp)")


def _ray_start(args: list[str], env: dict, log: Path, masks: list[str] = (), installed: list[Path] = ()):
    """`ray start ARGS --block` in a session of its own; inside a private mount namespace when `masks` is given."""
    ray = str(Path(sys.executable).with_name("ray"))
    cmd = [ray, "start", *args, "--disable-usage-stats", "--block"]
    if masks:
        kept = _kept_visible(list(masks))
        rel = " ".join(f"'{str(p).lstrip('/')}'" for p in installed)
        script = "set -e\n"
        if kept:  # the repository (and its .venv) under a masked folder: held aside, bound back after the masks
            hold = _holder(list(masks), kept)
            script += f"mount -t tmpfs -o mode=0755 none '{hold}'\n"
            script += "".join(f"mkdir -p '{hold}/k{i}'\nmount --bind '{k}' '{hold}/k{i}'\n" for i, k in enumerate(kept))
        script += f"kept=$(tar --format=posix -cf - -C / {rel} | base64 -w0)\n" if installed else ""
        script += "".join(f"mount -t tmpfs -o mode=1777 none '{m}'\n" for m in masks)
        if kept:
            script += "".join(f"mkdir -p '{k}'\nmount --bind '{hold}/k{i}' '{k}'\n" for i, k in enumerate(kept))
        script += "printf %s \"$kept\" | base64 -d | tar -xf - -C /\n" if installed else ""
        script += "exec " + " ".join(f"'{c}'" for c in cmd) + "\n"
        cmd = ["unshare", "--mount", "--propagation", "private", "bash", "-c", script]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class Cluster:
    """The running test cluster: its head address, the second node's id and files installed on both nodes."""

    def __init__(self, ray, address: str, node_id: str, ckpt: Path, local: Path):
        self.ray = ray
        self.address = address
        self.node_id = node_id
        self.ckpt = ckpt
        self.local = local  # a driver-only folder for local inputs and outputs

    def actors_on_node(self) -> int:
        """vlprep actors (engine._RayWorker) that Ray placed on the second node so far, dead ones included."""
        from ray._private import state

        return sum(1 for a in state.actors().values() if a.get("ActorClassName", "").endswith("_RayWorker")
                   and a.get("Address", {}).get("NodeID") == self.node_id)

    def actors_elsewhere(self) -> int:
        from ray._private import state

        return sum(1 for a in state.actors().values() if a.get("ActorClassName", "").endswith("_RayWorker")
                   and a.get("Address", {}).get("NodeID") not in (self.node_id, None, ""))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _unshare_permitted()
    if why:
        pytest.skip(why)
    ray = __import__("ray") if os.environ.get("CI") else pytest.importorskip("ray")
    need("s3fs", "moto")
    import s3fs

    tmp = tmp_path_factory.mktemp("cluster")
    ckpt = tiny_checkpoint(tmp / "enc.pt")
    env_before = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    mark = uuid.uuid4().hex
    procs: list[subprocess.Popen] = []
    head_tmp = Path(tempfile.mkdtemp(prefix="vlprep-rh-"))  # short: Ray's socket paths must fit in 107 bytes
    with moto_s3(tmp / "moto.log") as endpoint:
        aws = s3_env(endpoint)
        os.environ.update(aws)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            s3fs.S3FileSystem().mkdir("bkt")
            path = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, NODE_MARK: mark, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                   "PYTHONPATH": path}
            port = free_port()

            def ports() -> list[str]:  # two nodes on one machine: nothing may rely on Ray's fixed default ports
                return [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
                        f"--runtime-env-agent-port={free_port()}"]

            procs.append(_ray_start(["--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
                                     f"--ray-client-server-port={free_port()}", f"--temp-dir={head_tmp}", *ports()],
                                    env, tmp / "head.log"))
            procs.append(_ray_start([f"--address=127.0.0.1:{port}", "--num-cpus=2", *ports()], env,
                                    tmp / "node.log", masks=_masks(tmp_path_factory.getbasetemp()), installed=[ckpt]))
            deadline = time.monotonic() + 90
            while True:  # the head's GCS answers only once it is up
                try:
                    ray.init(address=f"127.0.0.1:{port}", include_dashboard=False, log_to_driver=False,
                             logging_level="WARNING", runtime_env={"env_vars": {"PYTHONPATH": path, **aws}})
                    break
                except ConnectionError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise RuntimeError("the Ray head did not start: " + (tmp / "head.log").read_text()[-2000:])
                    time.sleep(0.5)
            while True:
                nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
                if nodes:
                    break
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("the second Ray node did not join: " + (tmp / "node.log").read_text()[-2000:])
                time.sleep(0.5)
            local = tmp_path_factory.mktemp("driver")
            yield Cluster(ray, f"127.0.0.1:{port}", nodes[0]["NodeID"], ckpt, local)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while _marked(mark) and time.monotonic() < deadline:
                time.sleep(0.2)
            for pid in _marked(mark):  # processes of this cluster only (the mark), by pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in procs:
                p.wait(timeout=30)
            deadline = time.monotonic() + 20
            while _marked(mark) and time.monotonic() < deadline:
                time.sleep(0.2)
            shutil.rmtree(head_tmp, ignore_errors=True)
            s3fs.S3FileSystem.clear_instance_cache()
            os.environ.clear()
            os.environ.update(env_before)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def s3_files(prefix: str) -> dict[str, bytes]:
    """Every object under s3://bkt/PREFIX/ (subfolders included, by relative name)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    base = f"bkt/{prefix.strip('/')}/"
    return {p[len(base):]: fs.cat_file(p) for p in fs.find(base)}


def digests(files: dict[str, bytes], skip: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of each file that depends only on the inputs and options: not meta.json (it names OUT's input, with
    library versions), report.json (timings), the run marker or the lock."""
    return {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())
            if n.rsplit("/", 1)[-1] not in ("meta.json", "report.json", ".vlprep-run.json", ".vlprep.lock")
            and not n.endswith(skip)}


@pytest.fixture(scope="module")
def raw(cluster) -> str:
    """s3://bkt/raw: 12 captioned colour images in 6 shards of 2, written by `vlprep shards` from a local folder."""
    from vlprep.shards import ShardsConfig, build_shards

    colour_pairs(cluster.local / "pairs", 12, per_shard=2)
    build_shards(ShardsConfig(src=cluster.local / "pairs" / "src", out="s3://bkt/raw", samples_per_shard=2,
                              workers=1))
    return "s3://bkt/raw"


def on_both(cluster, run, name: str) -> tuple[dict, dict, int]:
    """run(out, distributor, workers) locally (1 process) and on the cluster (2 actors): both OUTs' files, and the
    number of actors the cluster run placed on the second node."""
    run(f"s3://bkt/local/{name}", "local", 1)
    before = cluster.actors_on_node()
    run(f"s3://bkt/ray/{name}", "ray", 2)
    placed = cluster.actors_on_node() - before
    return s3_files(f"local/{name}"), s3_files(f"ray/{name}"), placed


def test_bow_on_the_cluster_is_byte_identical_to_local(cluster, raw):
    from vlprep.bow import BowConfig, bow

    def run(out, distributor, workers):
        bow(BowConfig(src=raw, out=out, ops="shuffle,rmstop,basevocab,rmtop:2,keep:3", base_frac=0.5,
                      workers=workers, distributor=distributor))

    local, ray_files, placed = on_both(cluster, run, "bow")
    assert digests(local) == digests(ray_files) and sum(n.endswith(".tar") for n in local) == 6
    assert placed == 2 and cluster.actors_elsewhere() == 0


def test_the_second_node_sees_no_file_the_driver_wrote(cluster):
    """The premise of this module: a task on the second node finds neither the driver's folders nor its files."""
    (cluster.local / "mine.txt").write_text("driver only")
    probe = Path(tempfile.gettempdir()) / f"vlprep-probe-{uuid.uuid4().hex}"
    probe.write_text("driver only")
    try:
        # an actor, not a task: killed at the end, its process exits (a task's worker would idle on in Ray's pool)
        looker = cluster.ray.remote(num_cpus=1)(Look).remote()
        node, seen, repo = cluster.ray.get(looker.look.remote([str(cluster.local / "mine.txt"), str(probe),
                                                               str(cluster.ckpt.parent / "moto.log")]))
        assert node == cluster.node_id and seen == [False, False, False] and repo
        assert cluster.ray.get(looker.look.remote([str(cluster.ckpt)]))[1] == [True]  # installed there (docstring)
        cluster.ray.kill(looker)
    finally:
        probe.unlink()


class Look:
    def look(self, paths: list[str]) -> tuple[str, list[bool], bool]:
        """(this node's id, whether each path exists here, whether the repository does)."""
        import ray

        return (ray.get_runtime_context().get_node_id(), [os.path.exists(p) for p in paths],
                os.path.exists(os.path.join(str(ROOT), "vlprep", "engine.py")))


# rmtoprand: its draws are seeded per key, so they cannot depend on which worker ran a shard
@pytest.mark.parametrize("strategy,index", [("weighted", "flat"), ("rmtoprand", "ivf")])
def test_pseudolabel_on_the_cluster_is_byte_identical_to_local(cluster, raw, strategy, index):
    """The workers need OUT's kNN index and caption table, which the driver builds: they come from OUT's object
    storage (the second node cannot see the driver's staging folder)."""
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel
    from vltrain.checkpoint_encoder import CheckpointEncoder

    def run(out, distributor, workers):
        cfg = PseudolabelConfig(aligned=raw, unaligned=raw, out=out, strategy=strategy, index=index, k=3, crops=2,
                                rmtop=2, batch_size=4, device="cpu", workers=workers, distributor=distributor)
        rep = pseudolabel(cfg, CheckpointEncoder(cluster.ckpt, "cpu"))
        assert rep["written"] > 0 and rep["index"]["kind"] == index

    local, ray_files, placed = on_both(cluster, run, f"pseudo-{strategy}-{index}")
    assert digests(local) == digests(ray_files) and "knn.faiss" in local
    assert placed == 2 and cluster.actors_elsewhere() == 0


def test_filter_on_the_cluster_is_byte_identical_to_local_and_its_embedding_cache_is_in_out(cluster, raw):
    """Every kind of rule: per-sample ones, the hash dedups and pHash (their scan tables travel through OUT/_scan/),
    and an embedding rule with --checkpoint, whose `vlprep embed` runs on the cluster into OUT/_embed/image (the
    cache; its embeddings.npy byte-identical too). A re-run finds everything in OUT and starts no actor."""
    from vlprep.filter import FilterConfig, filter_dataset
    from vltrain.checkpoint_encoder import CheckpointEncoder

    keys = cluster.local / "drop.txt"
    keys.write_text("000005\n")  # read by the driver alone

    def run(out, distributor, workers):
        cfg = FilterConfig(src=raw, out=out, drop_keys=keys, min_side=8, caption_words="2:", dedup=["image", "caption",
                           "pair"], phash=2, near_dup=0.999, workers=workers,
                           distributor=distributor)
        return filter_dataset(cfg, encoder=CheckpointEncoder(cluster.ckpt, "cpu"))

    local, ray_files, placed = on_both(cluster, run, "filter")
    assert digests(local) == digests(ray_files)
    assert "dropped.parquet" in local and any(n.startswith("_scan/") for n in ray_files)
    assert "_embed/image/embeddings.npy" in local
    assert placed == 6 and cluster.actors_elsewhere() == 0  # scan, embed, copy: 2 actors each
    before = cluster.actors_on_node()
    again = run("s3://bkt/ray/filter", "ray", 2)
    assert cluster.actors_on_node() == before and again["shards_resumed"] == again["scan_resumed"] == 6
    assert digests(s3_files("ray/filter")) == digests(ray_files)



def test_detect_from_a_file_and_ontology_on_the_cluster_are_byte_identical_to_local(cluster):
    """detect --from-file: the driver reads the detections file and each shard's detections travel with its work item.
    ontology: the nouns pass's tables go through OUT/_nouns/, the annotate pass gets the noun mapping with its work
    items and reads the nouns from OUT."""
    import json

    from vlprep.detect import DetectConfig, detect
    from vlprep.ontology import OntologyConfig, ontology
    from vlprep.shards import ShardsConfig, build_shards

    captions = ["A dog runs on the grass.", "Two dogs and a man in a park.", "A man with a hat.", "The cat sleeps.",
                "A dog and a cat.", "A red car.", "A cat on a car.", "A man and his dog."]
    objects = [["dog"], ["dog", "person"], ["person"], ["cat"], ["dog", "cat"], [], ["cat", "car"], ["person", "dog"]]
    src = cluster.local / "captions"
    src.mkdir()
    for i, c in enumerate(captions):
        (src / f"{i}.png").write_bytes(image_bytes(16, 16, seed=i))
        (src / f"{i}.txt").write_text(c)
    build_shards(ShardsConfig(src=src, out="s3://bkt/captions", samples_per_shard=2, workers=1))
    dets = cluster.local / "dets.jsonl"
    dets.write_text("".join(json.dumps({"key": f"shard_{i:09d}", "objects": [
        {"label": o, "score": 0.9, "box": [0, 0, 0.5, 1]} for o in objs]}) + "\n" for i, objs in enumerate(objects)))

    def run_detect(out, distributor, workers):
        detect(DetectConfig(src="s3://bkt/captions", out=out, from_file=dets, min_score=0.3, workers=workers,
                            distributor=distributor))

    local, ray_files, placed = on_both(cluster, run_detect, "detect")
    assert digests(local) == digests(ray_files) and placed == 2

    def run_ontology(out, distributor, workers):
        rep = ontology(OntologyConfig(src="s3://bkt/local/detect", out=out, min_cooccur=1, min_instances=2,
                                      workers=workers, distributor=distributor))
        assert rep["triplets"] > 0

    local, ray_files, placed = on_both(cluster, run_ontology, "ontology")
    assert digests(local) == digests(ray_files) and "triplets.parquet" in local and "ontology.json" in local
    assert placed == 4 and cluster.actors_elsewhere() == 0  # nouns, annotate: 2 actors each


def test_features_on_the_cluster_is_byte_identical_to_local(cluster, raw):
    """The packaged encoder's weights are part of the installed package, on every node."""
    from vlprep.features import FeaturesConfig, features

    def run(out, distributor, workers):
        features(FeaturesConfig(src=raw, out=out, size=64, decode_threads=1, device="cpu", workers=workers,
                                distributor=distributor))

    local, ray_files, placed = on_both(cluster, run, "features")
    assert digests(local) == digests(ray_files) and sum(n.endswith(".tar") for n in local) == 6
    assert placed == 2 and cluster.actors_elsewhere() == 0

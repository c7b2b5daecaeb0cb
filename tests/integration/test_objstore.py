"""Datasets in object storage, against real servers on 127.0.0.1 (tests/integration/servers.py): Python's http.server
for `vltrain run/eval http://...` (with a connection dropped mid-shard, and a server that always fails), and moto's
standalone S3 server for `vlprep shards` / `vlprep bow` writing s3:// (byte-identical to a local run, a kill -9 then
a re-run, the lock object) and `vltrain run s3://...`. No other address is ever contacted; endpoints and
credentials come from the standard AWS_* variables only."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from tests.integration.servers import http_server, moto_s3, need, s3_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01"]
FAST_RETRIES = {"VLPREP_REMOTE_TRIES": "3", "VLPREP_REMOTE_BACKOFF": "0.01"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(local dataset folder, its URL on a local HTTP server, the server's Faults): 8 pixel pairs in 2 shards."""
    need("fsspec", "aiohttp")
    tmp = tmp_path_factory.mktemp("http")
    ds = colour_pairs(tmp, 8)
    with http_server(tmp) as (base, faults):
        yield ds, f"{base}/ds/", faults


@pytest.fixture
def fast_retries(monkeypatch):
    for k, v in FAST_RETRIES.items():
        monkeypatch.setenv(k, v)


def train(data: str, out: Path, *extra: str):
    from vltrain.cli import app

    return CliRunner().invoke(app, ["run", data, "--out", str(out), "--batch-size", "4", "--device", "cpu", "--steps",
                                    "2", "--preset", "clip", *[x for s in TINY for x in ("--set", s)], *extra])


@pytest.fixture(scope="module")
def local_run(served, tmp_path_factory) -> Path:
    """OUT of `train` on the served dataset's local folder (read only): the numbers the URL runs must give."""
    out = tmp_path_factory.mktemp("local") / "run"
    r = train(str(served[0]), out)
    assert r.exit_code == 0, r.output
    return out


def losses(out: Path) -> list[dict]:
    """Each metrics.jsonl row without its timing and its remote-read counts."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("samples_per_s", "read_retries", "shards_skipped")}
            for r in rows]


def io_counts(out: Path) -> dict:
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return {k: last.get(k, 0) for k in ("read_retries", "shards_skipped")}


def error_line(result) -> str:
    """The run's one 'error:' line, its last (a fault met while training follows the run's summary), no traceback."""
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert result.exit_code == 2 and errors == lines[-1:] and "Traceback" not in result.output, (result.output,
                                                                                                 result.exception)
    return lines[-1]


# --- HTTP: vltrain reads shards from a URL --------------------------------------------------------------------------


def test_run_and_eval_from_http_give_the_local_numbers(served, local_run, tmp_path, fast_retries):
    """`vltrain run http://127.0.0.1:PORT/ds/` trains 2 steps with the losses of the same data on disk, and `vltrain
    eval` of the checkpoint scores the URL exactly as the folder."""
    from vltrain.cli import app

    ds, url, faults = served
    remote = train(url, tmp_path / "http")
    assert remote.exit_code == 0, remote.output
    assert losses(tmp_path / "http") == losses(local_run) and len(losses(local_run)) == 2
    scores = {}
    for name, data in (("local", str(ds)), ("http", url)):
        r = CliRunner().invoke(app, ["eval", str(local_run / "last.pt"), data, "--out",
                                     str(tmp_path / f"{name}.json"), "--device", "cpu"])
        assert r.exit_code == 0, r.output
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for key in ("retrieval", "chance", "n_samples", "skipped"):
        assert scores["http"][key] == scores["local"][key], key
    assert "read_retries" not in scores["http"]  # nothing was retried


def test_a_connection_dropped_mid_shard_is_retried_and_the_numbers_do_not_change(served, local_run, tmp_path,
                                                                                  fast_retries):
    """The server cuts its answer for each tar once, halfway through the body: the reads resume at their offset,
    each retry is counted in metrics.jsonl, and the losses are those of the local run."""
    ds, url, faults = served
    before = faults.dropped
    faults.drop.update({"shard-000000.tar": 1, "shard-000001.tar": 1})
    r = train(url, tmp_path / "http")
    assert r.exit_code == 0, r.output
    assert faults.dropped - before == 2 and not any(faults.drop.values())
    assert losses(tmp_path / "http") == losses(local_run)
    assert io_counts(tmp_path / "http") == {"read_retries": 2, "shards_skipped": 0}


def test_a_server_that_always_fails_is_one_line_naming_the_url(served, tmp_path, fast_retries):
    ds, url, faults = served
    faults.fail.add("shard-000001.tar")  # 503 for every request of it
    try:
        line = error_line(train(url, tmp_path / "run"))
    finally:
        faults.fail.clear()
    assert line.startswith(f"error: {url}shard-000001.tar: cannot read it after 3 tries (ClientResponseError: 503"), \
        line


def test_a_shard_whose_reads_always_break_is_one_line_or_with_skip_bad_shards_a_counted_skip(served, tmp_path,
                                                                                           fast_retries):
    """Every answer for one tar is cut mid-body (its size is known, its bytes never arrive whole)."""
    ds, url, faults = served
    faults.drop["shard-000001.tar"] = 10_000
    try:
        line = error_line(train(url, tmp_path / "run"))
        assert line.startswith(f"error: {url}shard-000001.tar: cannot read it after 3 tries (ClientPayloadError"), line
        # --skip-bad-shards: the shard is left out and counted in each epoch that meets it, and the run trains
        r = train(url, tmp_path / "skip", "--skip-bad-shards", "--batch-size", "2")
    finally:
        faults.drop.clear()
    assert r.exit_code == 0, r.output
    counts = io_counts(tmp_path / "skip")
    assert counts["shards_skipped"] >= 1 and counts["read_retries"] >= 2, counts


# --- S3 (moto's standalone server) ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The endpoint of a moto S3 server on 127.0.0.1 with the bucket `bkt`, its AWS_* variables set in this process
    for the module (and given to the subprocesses)."""
    need("s3fs", "moto")
    import s3fs

    tmp = tmp_path_factory.mktemp("s3")
    with moto_s3(tmp / "moto.log") as endpoint:
        env = s3_env(endpoint)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            s3fs.S3FileSystem().mkdir("bkt")
            yield env
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def vlprep_process(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m vlprep.cli ARGS`, a process of its own (with the variables `env` set)."""
    return subprocess.run([sys.executable, "-m", "vlprep.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})


@pytest.fixture
def vlprep(capfd, monkeypatch):
    """`vlprep ARGS` (with the variables `env` set) in this process, as `python -m vlprep.cli` runs it: its main()
    under capfd, which sees all that reaches fds 1 and 2 (its pool workers' too); a CompletedProcess of it."""
    from vlprep.cli import main

    def run(*args, env: dict | None = None) -> subprocess.CompletedProcess:
        capfd.readouterr()
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            m.setattr(sys, "argv", ["vlprep", *map(str, args)])
            try:
                main()
                code = 0
            except SystemExit as e:  # typer exits 0 on success too
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def s3_objects(prefix: str) -> dict[str, bytes]:
    """Every object under s3://bkt/PREFIX/ (top level), by name."""
    import s3fs

    fs = s3fs.S3FileSystem()
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.ls(f"bkt/{prefix}", refresh=True)
            if fs.isfile(p)}


def digests(files: dict[str, bytes]) -> dict[str, str]:
    """sha256 of what the contract makes identical across runs: tars, sidecars, sizes.json, index.json (meta.json
    names the input, a local path or a URL, and report.json holds timings)."""
    return {n: hashlib.sha256(b).hexdigest() for n, b in files.items()
            if n.endswith((".tar", ".parquet")) or n in ("sizes.json", "index.json")}


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """12 captioned pixel images (colour_pairs' src folder): shards of 2."""
    tmp = tmp_path_factory.mktemp("s3src")
    colour_pairs(tmp, 12)
    return tmp / "src"


BOW = ["--ops", "shuffle,rmstop,keep:3", "--base-frac", "0.5"]


def test_shards_and_bow_to_s3_are_byte_identical_to_local_and_vltrain_trains_from_s3(s3, source, tmp_path, vlprep):
    r = vlprep("shards", source, "s3://bkt/raw/", "-n", "2", "--workers", "1")
    assert r.returncode == 0 and "wrote s3://bkt/raw/" in r.stderr, r.stderr
    r = vlprep("bow", "s3://bkt/raw/", "s3://bkt/bow/", "--workers", "2", *BOW)
    assert r.returncode == 0 and "wrote s3://bkt/bow/" in r.stderr, r.stderr
    assert vlprep("shards", source, tmp_path / "raw", "-n", "2", "--workers", "1").returncode == 0
    assert vlprep("bow", tmp_path / "raw", tmp_path / "bow", "--workers", "2", *BOW).returncode == 0
    for name in ("raw", "bow"):
        remote, local = s3_objects(name), local_files(tmp_path / name)
        assert digests(remote) == digests(local) and len(digests(local)) == 2 * 6 + 2, name
        assert ".vlprep.lock" not in remote and not any(n.endswith(".tmp") for n in remote)  # released, no leftovers
        # meta.json names the input in its canonical form (no trailing slash; vlprep.urls)
        assert json.loads(remote["meta.json"])["input"] == (str(source) if name == "raw" else "s3://bkt/raw")
    # --distributor ray: the actors fetch their input shards and upload their own output shards (a local Ray, started
    # by the stage in its own process, with the AWS_* variables of its environment)
    if os.environ.get("CI") or __import__("importlib").util.find_spec("ray"):
        r = vlprep_process("bow", "s3://bkt/raw/", "s3://bkt/bow-ray/", "--workers", "2", "--distributor", "ray", *BOW)
        assert r.returncode == 0, r.stderr
        assert digests(s3_objects("bow-ray")) == digests(local_files(tmp_path / "bow"))
    out = tmp_path / "run"
    r = train("s3://bkt/bow/", out, "--set", "data.val_frac=0")
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in losses(out)] == [1, 2]


def test_a_stage_killed_mid_run_leaves_no_partial_object_and_a_rerun_ends_identical(s3, source, tmp_path, vlprep):
    """kill -9 of `vlprep bow` to s3:// once its first shard is up, the listing polled throughout: every final-named
    object ever seen holds the bytes of the local run's file, sizes.json appears only with the re-run, which resumes
    (past the stale lock of the killed process) and ends byte-identical to the local run."""
    assert vlprep("shards", source, tmp_path / "raw", "-n", "1", "--workers", "1").returncode == 0
    assert vlprep("shards", source, "s3://bkt/raw1/", "-n", "1", "--workers", "1").returncode == 0
    assert vlprep("bow", tmp_path / "raw", tmp_path / "bow", "--workers", "1", *BOW).returncode == 0
    want = digests(local_files(tmp_path / "bow"))
    seen, bad, stop = {}, [], threading.Event()

    def poll() -> None:  # bounded: stops when told, or after 300 s
        import s3fs

        fs, deadline = s3fs.S3FileSystem(), time.monotonic() + 300
        while not stop.is_set() and time.monotonic() < deadline:
            for p in fs.ls("bkt/bow1", refresh=True) if fs.exists("bkt/bow1") else []:
                name = p.rsplit("/", 1)[1]
                if name in want and name not in seen:
                    got = hashlib.sha256(fs.cat_file(p)).hexdigest()
                    seen[name] = got
                    if got != want[name]:
                        bad.append(name)
            time.sleep(0.01)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    proc = subprocess.Popen([sys.executable, "-m", "vlprep.cli", "bow", "s3://bkt/raw1/", "s3://bkt/bow1/", "--workers",
                             "1", *BOW], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any(n.endswith(".tar") for n in seen) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        killed_mid_run = proc.poll() is None and "sizes.json" not in seen
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert killed_mid_run, "the stage finished before it could be killed"
        assert "sizes.json" not in s3_objects("bow1")
        r = vlprep("bow", "s3://bkt/raw1/", "s3://bkt/bow1/", "--workers", "2", *BOW)
        assert r.returncode == 0, r.stderr
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert not bad, f"partial or wrong final-named objects: {bad}"
    assert digests(s3_objects("bow1")) == want
    report = json.loads(s3_objects("bow1")["report.json"])
    assert report["shards_resumed"] >= 1  # resumed by fingerprint from the listing


def test_the_lock_object_refuses_a_second_writer_in_one_line_and_a_dead_holders_lock_is_replaced(s3, source, vlprep):
    import s3fs

    fs = s3fs.S3FileSystem()
    holder = {"host": "elsewhere", "pid": 4242, "start": "1", "since": "2026-01-01T00:00:00Z", "token": "x"}
    fs.pipe_file("bkt/locked/.vlprep.lock", json.dumps(holder).encode())
    r = vlprep("shards", source, "s3://bkt/locked/", "-n", "4", "--workers", "1")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == [
        "error: OUT s3://bkt/locked is being written by another vlprep process (pid 4242 on elsewhere, since "
        "2026-01-01T00:00:00Z); wait for it to finish or choose another folder (the lock is advisory: if that process "
        "is gone, delete s3://bkt/locked/.vlprep.lock)"], lines
    assert sorted(s3_objects("locked")) == [".vlprep.lock"]  # nothing written
    # a lock of this machine whose process is gone (as after kill -9) is replaced
    import socket

    fs.pipe_file("bkt/locked/.vlprep.lock", json.dumps({**holder, "host": socket.gethostname(), "pid": 2 ** 22 + 1}
                                                       ).encode())
    r = vlprep("shards", source, "s3://bkt/locked/", "-n", "4", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert "sizes.json" in s3_objects("locked") and ".vlprep.lock" not in s3_objects("locked")


def test_an_alias_of_the_input_url_as_out_is_refused_and_the_input_is_kept(s3, source, vlprep):
    """s3a:// (and s3n://, a trailing slash, a `..` segment, a percent-escape) names the input's own folder: with
    --overwrite it once deleted the input. Refused in one line; nothing under the input changes."""
    assert vlprep("shards", source, "s3://bkt/raw2/", "-n", "4", "--workers", "1").returncode == 0
    before = s3_objects("raw2")
    for out, says in (("s3a://bkt/raw2", "is the input"), ("s3n://bkt/raw2/", "is the input"),
                      ("s3://bkt/x/../raw%32", "is the input"), ("s3a://bkt/raw2/x", "lies inside the input"),
                      ("s3a://bkt", "contains the input")):
        r = vlprep("bow", "s3://bkt/raw2", out, "--overwrite", *BOW)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (out, lines)
        assert s3_objects("raw2") == before, out
    import s3fs

    assert not s3fs.S3FileSystem().exists("bkt/raw2/x")


def test_credentials_in_an_s3_url_are_one_line_at_once_and_never_echoed(s3, source):
    """A process of its own: whatever it prints, warnings and log lines included, up to its exit, is searched."""
    for args in (("bow", "s3://AKIAXX:T0PS3CRET@bkt/raw2/", "s3://bkt/o"),
                 ("bow", "s3://bkt/raw2", "s3a://k:T0PS3CRET@bkt/o")):
        t = time.monotonic()
        r = vlprep_process(*args, env={"VLPREP_REMOTE_BACKOFF": "2"})
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "AWS_ACCESS_KEY_ID" in lines[0], lines
        assert "T0PS3CRET" not in r.stdout + r.stderr and "AKIAXX" not in r.stdout + r.stderr
        assert time.monotonic() - t < 30  # no retries with backoff


def test_missing_s3_credentials_are_one_line_without_retries(s3, tmp_path):
    """No AWS_* credentials anywhere: a configuration error, said once, not retried as a transient fault."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"], "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
                "AWS_EC2_METADATA_DISABLED": "true", "VLPREP_REMOTE_TRIES": "5", "VLPREP_REMOTE_BACKOFF": "4",
                "PYTHONPATH": str(ROOT)})
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "vlprep.cli", "bow", "s3://bkt/raw2", str(tmp_path / "o"), *BOW],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "no credentials" in lines[0], lines
    assert "AWS_ACCESS_KEY_ID" in lines[0] and time.monotonic() - t < 4 * 3  # five tries would wait 4+8+8+8 s


@pytest.mark.parametrize("body", [b"[1, 2]", b'"taken"'])
def test_a_lock_object_that_is_a_list_or_a_string_is_one_line_saying_how_to_remove_it(s3, source, vlprep, body):
    import s3fs

    s3fs.S3FileSystem().pipe_file("bkt/oddlock/.vlprep.lock", body)
    r = vlprep("shards", source, "s3://bkt/oddlock/", "-n", "4", "--workers", "1")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, lines
    assert "s3://bkt/oddlock/.vlprep.lock is not a vlprep lock" in lines[0] and "delete it" in lines[0], lines
    assert sorted(s3_objects("oddlock")) == [".vlprep.lock"]


class Meet:
    """A progress bar that, at its stage's first written shard, waits until the other stage has written one too:
    from then on both OUTs are open and locked at once in this process."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier = barrier
        self.met = False

    def add_task(self, *args, **kw) -> int:
        return 0

    def advance(self, task, n) -> None:
        if not self.met:
            self.met = True
            self.barrier.wait(timeout=120)


def test_two_stages_in_one_process_write_a_local_and_an_s3_out_at_once_as_each_alone(s3, source, tmp_path):
    """`vlprep shards` to s3:// and `vlprep bow` to a local folder, in two threads of one process, both mid-run at
    once (each waits after its first shard for the other): each OUT ends byte-identical to its stage run alone."""
    import s3fs
    from concurrent.futures import ThreadPoolExecutor

    from vlprep.bow import BowConfig, bow
    from vlprep.shards import ShardsConfig, build_shards

    build_shards(ShardsConfig(src=source, out=tmp_path / "raw", samples_per_shard=2, workers=1))
    bow_options = {"ops": "shuffle,rmstop,keep:3", "base_frac": 0.5, "workers": 1}
    build_shards(ShardsConfig(src=source, out="s3://bkt/alone-s3/", samples_per_shard=2, workers=1))
    bow(BowConfig(src=tmp_path / "raw", out=tmp_path / "alone-bow", **bow_options))

    held = []

    def both_open() -> None:  # run by the barrier once both stages wait there: both locks are held
        import fcntl

        fd = os.open(tmp_path / "two-bow" / ".vlprep.lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            local_held = False
        except OSError:
            local_held = True
        finally:
            os.close(fd)
        held.append((s3fs.S3FileSystem().exists("bkt/two-s3/.vlprep.lock"), local_held))

    barrier = threading.Barrier(2, action=both_open)
    with ThreadPoolExecutor(2) as pool:
        remote = pool.submit(build_shards, ShardsConfig(src=source, out="s3://bkt/two-s3/", samples_per_shard=2,
                                                        workers=1), progress=Meet(barrier))
        local = pool.submit(bow, BowConfig(src=tmp_path / "raw", out=tmp_path / "two-bow", **bow_options),
                            progress=Meet(barrier))
        remote.result()
        local.result()
    assert held == [(True, True)]
    assert digests(s3_objects("two-s3")) == digests(s3_objects("alone-s3")) and len(digests(s3_objects("two-s3"))) == 14
    assert digests(local_files(tmp_path / "two-bow")) == digests(local_files(tmp_path / "alone-bow"))
    assert ".vlprep.lock" not in s3_objects("two-s3")


def test_filter_from_and_to_s3_is_byte_identical_to_local_and_resumes(s3, source, tmp_path, vlprep):
    assert vlprep("shards", source, "s3://bkt/fraw/", "-n", "2", "--workers", "1").returncode == 0
    assert vlprep("shards", source, tmp_path / "raw", "-n", "2", "--workers", "1").returncode == 0
    rules = ["--dedup", "image,caption", "--max-aspect", "1", "--workers", "2"]
    r = vlprep("filter", "s3://bkt/fraw/", "s3://bkt/filtered/", *rules)
    assert r.returncode == 0 and "wrote s3://bkt/filtered/" in r.stderr, r.stderr
    assert vlprep("filter", tmp_path / "raw", tmp_path / "filtered", *rules).returncode == 0
    remote = s3_objects("filtered")
    assert digests(remote) == digests(local_files(tmp_path / "filtered")) and "report.json" in remote
    assert "dropped.parquet" in remote and not any(n.endswith(".tmp") for n in remote)
    r = vlprep("filter", "s3://bkt/fraw/", "s3://bkt/filtered/", *rules)  # a re-run resumes from the bucket
    assert r.returncode == 0, r.stderr
    report = json.loads(s3_objects("filtered")["report.json"])
    assert report["scan_resumed"] == report["shards_resumed"] == 6

"""Workers die with their driver: a `vlprep features --workers 2` killed mid-run (SIGTERM, kill -9)
leaves no process behind and no file in OUT changes after it, and a re-run gives the bytes of an uninterrupted run.
Also the pieces one by one: a forked pool, the rename guard, Stopped.

Every process a test starts carries a unique marker in its environment, which is how the test finds what the run
left behind (/proc/PID/environ) and what it may kill when it cleans up: nothing else is touched.
"""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import make_dataset
from vlprep.features import FeaturesConfig, features

pytestmark = pytest.mark.slow  # subprocesses and the packaged image encoder
ROOT = Path(__file__).parents[2]
MARK = "VLPREP_TEST_RUN"


def marked(marker: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds MARK=marker."""
    needle = f"{MARK}={marker}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            zombie = (d / "stat").read_text().rsplit(") ", 1)[1][0] == "Z"  # dead, not yet reaped
            if needle in (d / "environ").read_bytes().split(b"\0") and not zombie:
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:150]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def kill_marked(marker: str) -> None:
    """Clean-up after a failure: SIGKILL exactly the processes this test started (by their marker)."""
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix in (".tar", ".parquet") or p.name in ("index.json", "sizes.json")}


def vlprep(*args: str, marker: str, **kw) -> subprocess.Popen:
    env = {**os.environ, MARK: marker, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "vlprep.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


FEATURES = ["--size", "64", "--decode-threads", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """60 captioned images in 12 shards of 5: many small shards, so a kill lands mid-run."""
    return make_dataset(tmp_path_factory.mktemp("orphans") / "raw", [f"a red dog number {i}" for i in range(60)], 5)


@pytest.fixture(scope="module")
def reference(raw, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ref") / "fw"
    features(FeaturesConfig(src=raw, out=out, size=64, decode_threads=1, device="cpu"))
    return digests(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_a_killed_stage_leaves_no_worker_and_no_writer_and_resumes_byte_identical(raw, reference, tmp_path, sig):
    out, marker = tmp_path / "fw", uuid.uuid4().hex
    try:
        run = vlprep("features", str(raw), str(out), "--workers", "2", *FEATURES, marker=marker)
        deadline = time.monotonic() + 180
        while not list(out.glob("*.tar")):  # the first shard is written: the workers are busy with the next
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.02)
        run.send_signal(sig)
        killed = time.monotonic()
        _, err = run.communicate(timeout=60)
        if sig == signal.SIGTERM:
            # the pool is stopped, then one line says how to resume; the exit code is 128 + SIGTERM, as a shell's
            assert run.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
            assert "run the same command again to resume" in err, err
        else:
            assert run.returncode == -signal.SIGKILL
        while marked(marker) and time.monotonic() < killed + 5:
            time.sleep(0.05)
        assert marked(marker) == {}  # within 5 s: no worker, no resource tracker
        gone = snapshot(out)
        # A writer that escaped the marker would still rename the shard it was busy with: one shard is 5 images at
        # 64 px, a fraction of a second of work (the first shard, model load included, is what the run waited for
        # above), so 3 s, the length of the former 5 s..8 s window, would see it land.
        time.sleep(3)
        assert snapshot(out) == gone
        assert len(list(out.glob("*.tar"))) < 12  # the kill landed mid-run
    finally:
        kill_marked(marker)
    again = vlprep("features", str(raw), str(out), "--workers", "2", *FEATURES, marker=marker)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert digests(out) == reference
    assert marked(marker) == {}


def test_forked_pool_workers_die_with_a_killed_driver(tmp_path):
    """The fork pool (bow, shards, ontology): its workers inherit OUT's lock, so an orphan would even keep it."""
    marker = uuid.uuid4().hex
    code = textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        from vlprep.engine import Work, map_shards
        from vlprep.output import Out

        def slow(out, n, fp):
            os.write(1, f"{os.getpid()}\\n".encode())  # one write under PIPE_BUF: the two workers' lines never mix
            time.sleep(60)
            return {}

        if __name__ == "__main__":
            map_shards(Out(Path(sys.argv[1])), [Work(f"s{n}", (n,), "", 1) for n in range(4)], slow, workers=2)
    """)
    env = {**os.environ, MARK: marker, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        workers = set()
        while len(workers) < 2:  # the workers' pids; the driver's own progress lines may come in between
            line = driver.stdout.readline()
            assert line, "the driver ended before both workers started"
            if line.strip().isdigit():
                workers.add(int(line))
        assert workers | {driver.pid} <= set(marked(marker))
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 5
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked(marker) == {}
    finally:
        kill_marked(marker)


def test_the_rename_guard_ends_a_worker_whose_driver_is_gone_instead_of_renaming(tmp_path):
    """A Ray actor's way (it is no child of the driver): the driver's pid and start time, checked at the rename
    itself; the watchdog is made too slow to act first."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARK: marker, "PYTHONPATH": str(ROOT)}
    stand_in = subprocess.Popen(["sleep", "60"], env=env)  # the driver
    (tmp_path / "a.tmp").write_text("shard")
    code = textwrap.dedent("""
        import os, socket, sys, time
        from vlprep import lifeline
        lifeline.POLL = 3600
        pid, tmp = int(sys.argv[1]), sys.argv[2]
        assert lifeline.guard(lifeline.Driver(pid, socket.gethostname(), lifeline._start_time(pid)), child=False)
        os.replace(tmp + "/a.tmp", tmp + "/a.tar")  # the driver is alive: renamed
        print("ok", flush=True)
        while not os.path.exists(tmp + "/go"):
            time.sleep(0.01)
        os.replace(tmp + "/a.tar", tmp + "/b.tar")
        print("renamed", flush=True)
    """)
    worker = subprocess.Popen([sys.executable, "-c", code, str(stand_in.pid), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "ok\n"
        stand_in.kill()
        stand_in.wait()
        (tmp_path / "go").touch()
        assert worker.wait(timeout=30) == 1 and worker.stdout.read() == ""
        assert (tmp_path / "a.tar").exists() and not (tmp_path / "b.tar").exists()
    finally:
        stand_in.kill()
        kill_marked(marker)

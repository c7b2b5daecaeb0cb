"""--distributor ray when things go wrong: an unreachable RAY_ADDRESS fails in one line within the
connect timeout, and the actors of a driver killed with kill -9 (on the local Ray it started) exit at once and
rename nothing into OUT.

Like tests/integration/test_ray.py, these skip without Ray, except in CI (where the [ray] extra is installed and a
missing Ray fails).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from vlprep.output import Out, write_shard

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
MARK = "VLPREP_TEST_RUN"


@pytest.fixture(scope="module", autouse=True)
def ray_installed():
    __import__("ray") if os.environ.get("CI") else pytest.importorskip("ray")


def test_an_unreachable_ray_address_fails_in_one_line_within_the_timeout(tmp_path):
    from tests.conftest import image_bytes  # here: the actors below import this module, and conftest imports torch

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(image_bytes())
    (src / "a.txt").write_text("a caption")
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "VLPREP_RAY_CONNECT_TIMEOUT": "3", "PYTHONPATH": str(ROOT)}
    for stage in ("shards", "bow"):
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "vlprep.cli", stage, str(src), str(tmp_path / "o"), "--distributor",
                            "ray"], env=env, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == ("error: cannot reach the Ray cluster at RAY_ADDRESS=127.0.0.1:1 (connection "
                                    "refused, within 3 s); start it, fix RAY_ADDRESS, or unset it to start a Ray here")
        assert took < 30  # the import and the one refused connection, not ray.init's minutes of retries
    assert not (tmp_path / "o").exists()


def _slow_shard(out: Out, n: int, fp: str) -> dict:
    """Shard n after a pause: short on even shards (actor 0's), long on odd ones (actor 1's); the actor's pid goes
    to OUT/../pids first."""
    (out.root.parent / "pids" / str(os.getpid())).touch()
    time.sleep(0.3 if n % 2 == 0 else 3)
    write_shard(out, f"s-{n:06d}.tar", [{"__key__": f"k{n}", "txt": "x"}], [{"key": f"k{n}"}],
                stats={"fingerprint": fp})
    return {}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()}


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_actors_of_a_killed_driver_exit_and_rename_nothing(tmp_path):
    """The driver starts its own local Ray (RAY_ADDRESS unset, as `vlprep ... --distributor ray` does); its actors
    used to finish their shards, and live 1-2 minutes, after a kill -9."""
    out, marker = tmp_path / "out", uuid.uuid4().hex
    out.mkdir()
    (tmp_path / "pids").mkdir()
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from tests.integration.test_ray_faults import _slow_shard
        from vlprep.engine import Work, map_shards
        from vlprep.output import Out

        if __name__ == "__main__":
            plan = [Work(f"s-{n:06d}.tar", (n,), "f", 1) for n in range(8)]
            map_shards(Out(Path(sys.argv[1])), plan, _slow_shard, workers=2, distributor="ray")
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({MARK: marker, "PYTHONPATH": str(ROOT)})
    driver = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "s-000000.tar").exists():
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
            time.sleep(0.01)
        driver.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        driver.wait()
        after = snapshot(out)
        actors = [int(p.name) for p in (tmp_path / "pids").iterdir()]
        assert len(actors) == 2
        time.sleep(max(0.0, killed + 5 - time.monotonic()))
        assert [pid for pid in actors if alive(pid)] == []
        assert snapshot(out) == after  # the odd shard, 3 s into its pause, never entered OUT; nor did the next even
        time.sleep(max(0.0, killed + 8 - time.monotonic()))
        assert snapshot(out) == after
    finally:
        driver.kill()
        _kill_marked(marker, driver.pid)  # what the driver's Ray left (its agents outlive it a while)


def _kill_marked(marker: str, session: int, settle: float = 10.0) -> None:
    """SIGKILL what the driver's Ray left: every process of the driver's session (it was started as a session
    leader, and Ray's processes stay in it) and every process carrying this test's marker in its environment (Ray
    renames its agents with setproctitle, which can overwrite what /proc/PID/environ shows, so the marker alone
    misses some); sweeping again until a sweep finds none alive, or `settle` seconds pass."""
    needle = f"{MARK}={marker}".encode()
    deadline = time.monotonic() + settle
    while True:
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or not alive(int(d.name)):
                continue
            try:
                stat = (d / "stat").read_bytes()
                sid = int(stat[stat.rindex(b")") + 2:].split()[3])
                if sid == session or needle in (d / "environ").read_bytes().split(b"\0"):
                    os.kill(int(d.name), signal.SIGKILL)
                    found.append(d.name)
            except (OSError, ProcessLookupError, ValueError):
                continue
        if not found or time.monotonic() > deadline:
            return
        time.sleep(0.2)
"""The leak guard (tests/leakguard.py) itself: it names what a scope left changed, and only that."""

import os
import signal
import subprocess
import sys
import time

from tests.leakguard import Snapshot, changes, cv2_amended, started_here

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_the_guard_names_an_environment_variable_a_handler_and_a_process_left_behind():
    before = Snapshot.take()
    os.environ["LEAKGUARD_PROBE"] = "1"
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    proc = subprocess.Popen(SLEEPER)
    try:
        found = changes(before, Snapshot.take(), grace_s=0)
    finally:
        del os.environ["LEAKGUARD_PROBE"]
        signal.signal(signal.SIGUSR1, old)
        proc.kill()
        proc.wait()
    assert found[0] == "environment variable LEAKGUARD_PROBE set"
    assert found[1].startswith("SIGUSR1 handler changed from ")
    assert found[2].startswith(f"child process {proc.pid} (") and found[2].endswith("still running")
    assert len(found) == 3
    assert changes(before, Snapshot.take(), grace_s=0) == []  # all undone: nothing to say


def test_an_orphan_carrying_the_session_mark_is_found_and_a_child_that_exits_in_time_is_not():
    """A process whose parent is gone (reparented to init) is found by the mark it inherited."""
    before = Snapshot.take()
    # the shell starts a sleeper in the background and exits at once: the sleeper is nobody's child here
    out = subprocess.run(["sh", "-c", f"{SLEEPER[0]} -c '{SLEEPER[2]}' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    orphan = int(out.stdout)
    try:
        assert orphan in started_here()
        assert any(f"child process {orphan} (" in c for c in changes(before, Snapshot.take(), grace_s=0))
    finally:
        os.kill(orphan, signal.SIGKILL)
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert changes(before, Snapshot.take(), grace_s=30) == []  # it exited within the grace (a zombie until waited)
    quick.wait()
    deadline = time.monotonic() + 30
    while orphan in started_here() and time.monotonic() < deadline:  # init reaps the killed orphan
        time.sleep(0.05)


def test_only_cv2s_own_amendment_of_ld_library_path_is_let_through():
    lib = "/venv/lib/python3.11/site-packages/lib64"
    assert cv2_amended("LD_LIBRARY_PATH", None, f"{lib}:")
    assert cv2_amended("LD_LIBRARY_PATH", "/opt/x", f"{lib}:/opt/x")
    assert not cv2_amended("LD_LIBRARY_PATH", "/opt/x", "/opt/y:/opt/x")  # another folder put first
    assert not cv2_amended("LD_LIBRARY_PATH", "/opt/x", f"{lib}:/opt/z")  # the old value changed too
    assert not cv2_amended("LD_PRELOAD", None, f"{lib}:")

"""The leak guard: a test (or a fixture) that leaves the process changed fails, naming itself.

Tests share one pytest process, so whatever one leaves behind (an environment variable, the working directory, a
signal handler, a child process still running) is the next one's starting point: a suite that passes file by file
can fail as a whole, and only on a busy machine. tests/conftest.py turns the three checks below into autouse
fixtures, one per scope: a function-scoped one snapshots after the module's and session's fixtures are set up and
checks before they are torn down, so it names the test; the module- and session-scoped ones name the fixtures of a
module, or of the session, that did not undo what they did.
"""

import os
import signal
import time
from dataclasses import dataclass

import pytest

# SIGKILL and SIGSTOP cannot be caught, so getsignal has nothing to say of them.
SIGNALS = sorted(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))
# A child told to stop (a terminated pool worker, a killed server) may take a moment to exit, longer on a loaded
# machine; the guard waits this long before it calls one a leak.
CHILD_GRACE_S = 30.0
# Helpers that the multiprocessing module starts once and keeps for the life of the process by design (its resource
# tracker, its forkserver): the first test that needs one starts it, and no test is to stop it.
PROCESS_SINGLETONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# Set once per process by a library, which no test can undo: sklearn and joblib setdefault the Intel OpenMP switches
# when imported, `import ray` sets RAY_CLIENT_MODE=0 ("not a Ray Client"), and torch's inductor writes the cache folder
# it settled on into TORCHINDUCTOR_CACHE_DIR the first time it looks (open_clip's training code does, on import).
# pytest's own variable names the running test.
# torch.compile's first code cache load sets _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR for its compiled kernels.
# open_clip's tokenizer module sets TOKENIZERS_PARALLELISM=false on import (clip_benchmark imports open_clip).
NOT_STATE = {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "RAY_CLIENT_MODE", "TORCHINDUCTOR_CACHE_DIR",
             "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTEST_CURRENT_TEST", "TOKENIZERS_PARALLELISM"}
# tests/conftest.py puts a value unique to the session under this name before the first test: every process a test
# starts inherits it (through os.environ), so one that outlives the test is found even when its parent is gone (a
# driver killed with kill -9 leaves its Ray behind, adopted by init).
MARK = "VLPREP_TEST_SESSION"
# Installed once per process by a library and kept by design: torch's DataLoader sets a SIGCHLD handler (chaining the
# one before it) the first time a loader starts workers, and never sets it again, so undoing it would leave later
# loaders unwatched.
LIBRARY_HANDLERS = {"_set_SIGCHLD_handler.<locals>.handler"}


def cv2_amended(key: str, before: str | None, after: str | None) -> bool:
    """Whether `after` is `before` with cv2's binaries folder put first: `import cv2` prepends it (a `lib64` folder
    beside site-packages) to LD_LIBRARY_PATH, "for sub-processes only", once per process."""
    if key != "LD_LIBRARY_PATH" or after is None:
        return False
    head, _, tail = after.partition(":")
    return head.endswith("lib64") and tail == (before or "")


def started_here() -> set[int]:
    """Running processes this session started: this process's children, and any process that carries the session's
    mark in its environment (zombies, exited but not yet waited for, are not counted)."""
    me, mark = os.getpid(), os.environ.get(MARK)
    needle = f"{MARK}={mark}".encode() if mark else None
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            # "PID (COMM) STATE PPID ...", where COMM may hold spaces or parentheses: split after the last ')'
            state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
            if state == b"Z":
                continue
            if int(ppid) == me:
                found.add(int(entry.name))
            elif needle:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.add(int(entry.name))
        except (OSError, ValueError):  # it exited while we looked
            continue
    return found


@dataclass(frozen=True)
class Snapshot:
    env: dict[str, str]
    cwd: str
    handlers: dict[int, object]
    children: frozenset[int]

    @classmethod
    def take(cls) -> "Snapshot":
        return cls(dict(os.environ), os.getcwd(), {s: signal.getsignal(s) for s in SIGNALS},
                   frozenset(started_here()))


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def changes(before: Snapshot, after: Snapshot, grace_s: float = CHILD_GRACE_S) -> list[str]:
    """What differs between two snapshots, one phrase each; new children get `grace_s` to exit first."""
    found = []
    for key in sorted((before.env.keys() | after.env.keys()) - NOT_STATE):
        if before.env.get(key) != after.env.get(key) and not cv2_amended(key, before.env.get(key), after.env.get(key)):
            # the name only: a value may be a secret (a test's fake credentials included)
            verb = "set" if key not in before.env else "removed" if key not in after.env else "changed"
            found.append(f"environment variable {key} {verb}")
    if before.cwd != after.cwd:
        found.append(f"working directory changed from {before.cwd} to {after.cwd}")
    for sig in SIGNALS:
        if before.handlers[sig] != after.handlers[sig] and \
                getattr(after.handlers[sig], "__qualname__", None) not in LIBRARY_HANDLERS:
            found.append(f"{signal.Signals(sig).name} handler changed from {before.handlers[sig]!r} to "
                         f"{after.handlers[sig]!r}")
    new = {pid for pid in after.children - before.children
           if not any(name in cmdline(pid) for name in PROCESS_SINGLETONS)}
    deadline = time.monotonic() + grace_s
    while new and time.monotonic() < deadline:
        time.sleep(0.1)
        new &= started_here()
    found += [f"child process {pid} ({cmdline(pid)[:100]}) still running" for pid in sorted(new)]
    return found


def guard(what: str):
    """A fixture body: snapshot, run the scope, fail naming `what` when the scope left the process changed."""
    before = Snapshot.take()
    yield
    left = changes(before, Snapshot.take())
    if left:
        pytest.fail(f"{what} left the test process changed: " + "; ".join(left), pytrace=False)

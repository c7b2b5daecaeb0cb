"""Workers die with their driver (the process that runs the stage and holds OUT's lock) and never rename a file
into OUT once it is gone.

A driver killed by SIGTERM or kill -9 used to leave its pool workers (and multiprocessing's resource tracker)
alive under PID 1, writing shards into OUT after the lock was gone, so a second run could start beside them.
`map_shards` stops its workers itself on SIGTERM / SIGINT; for a driver that dies without running any code, each
worker calls `guard` at start:
- a pool worker (a child of the driver), on Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), so the kernel kills it as
  its parent exits. The signal follows the parent *thread* that started the worker: the pool starts its workers
  from the thread that calls `map_shards` (the main thread for the CLI), and that call outlives its pool;
- every worker, on every platform: a daemon thread that looks at the driver every `POLL` seconds and ends the
  process (os._exit) when it is gone. A pool worker compares os.getppid() with the driver's pid; a Ray actor,
  whose parent is Ray's raylet, reads the driver's start time in /proc (a recycled pid is not the driver);
- a rename guard: an audit hook on "os.rename", the event os.rename and os.replace (so Path.rename / replace)
  raise before they act. Every file a stage completes enters OUT by a rename (shards, embed's parts, the
  ontology's cache), so a worker asks for proof that the driver is alive right before each one and ends instead
  of renaming. The hook covers every stage without each remembering to check. An upload to a URL OUT raises
  the event "vlprep.upload" (vlprep.output.publish) right before it, judged the same way.
A Ray actor that cannot see the driver's process (another host, another pid namespace) cannot watch it: there
Ray's fate sharing applies (an actor that is not detached dies with the driver that created it).
"""

import os
import signal
import socket
import sys
import threading
import time
from typing import NamedTuple

POLL = 0.2  # seconds between the watchdog's looks at the driver
_guarded = False


class Driver(NamedTuple):
    """The process that runs a stage: its pid, host and start time (field 22 of /proc/PID/stat; "" off Linux)."""

    pid: int
    host: str
    start: str


def _start_time(pid: int) -> str | None:
    """A live process's start time; None for no process, or a dead one its parent has not reaped yet (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": fields 3 (state), 4, ...
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()


def this_driver() -> Driver:
    """The calling process as a Driver (made in the driver, sent to its workers)."""
    return Driver(os.getpid(), socket.gethostname(), _start_time(os.getpid()) or "")


def _pid_alive(driver: Driver) -> bool:
    if driver.start:
        return _start_time(driver.pid) == driver.start
    try:
        os.kill(driver.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent thread exits."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watchdog and the rename guard still apply


def guard(driver: Driver, child: bool) -> bool:
    """In a worker, at start: end with `driver` (see the module docstring); `child` for a pool worker (the driver is
    its parent). Returns whether the driver is watched (False: a Ray actor that cannot see it)."""
    global _guarded
    if child:
        if sys.platform.startswith("linux"):
            _die_with_parent()
        # the driver may have died before prctl: the worker then already has another parent

        def alive() -> bool:
            return os.getppid() == driver.pid
    else:
        def alive() -> bool:
            return _pid_alive(driver)

        if driver.host != socket.gethostname() or not alive():
            return False
    if not alive():
        os._exit(1)
    if _guarded:  # a process guards once (its hooks stay for its life)
        return True
    _guarded = True
    me = os.getpid()

    def rename_guard(event: str, args: tuple) -> None:
        # a process the worker forks inherits the hook (not the thread), and its parent is the worker: not judged
        # (vlprep.upload: vlprep.output.publish, about to put a file under its final key in a URL OUT)
        if event in ("os.rename", "vlprep.upload") and os.getpid() == me and not alive():
            os._exit(1)

    def watch() -> None:
        while alive():
            time.sleep(POLL)
        os._exit(1)

    sys.addaudithook(rename_guard)
    threading.Thread(target=watch, name="vlprep-lifeline", daemon=True).start()
    return True


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT reached a stage while its workers ran; a KeyboardInterrupt, so callers treat it as Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class stop_on_signals:
    """Within: SIGTERM and SIGINT raise `Stopped` once in the main thread (later ones are ignored, so the clean-up
    after the first runs to its end). Handlers an application set itself are left alone, as is any thread but the
    main one (only it may set handlers)."""

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        fired = []

        def stop(signum, frame):
            if not fired:
                fired.append(signum)
                raise Stopped(signum)

        for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if signal.getsignal(sig) is default:
                self.previous[sig] = signal.signal(sig, stop)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def reset_signals_in_worker() -> None:
    """A pool worker: SIGTERM kills it (a forked one inherits the driver's handler), and Ctrl-C, which reaches
    the whole process group, is left to the driver, which stops its workers itself (no traceback per worker)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

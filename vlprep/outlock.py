"""OUT's lock, one concept for both kinds of OUT (`OutLock`): a stage holds it from start to end, so two writers
never clean up each other's files.

- A local OUT: `flock` on OUT/.vlprep.lock. The kernel drops it when the holder dies (even kill -9), so there is no
  stale-lock clean-up.
- A URL OUT: `flock` does not exist on an object store, so the lock is the object OUT/.vlprep.lock (host, pid,
  start time), created with a create-only write where the store has one (S3's If-None-Match, which s3fs's
  mode="create" sends). It is advisory: a writer that ignores it is not stopped.
"""

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from vlprep import VlprepError, objstore, urls

LOCK_FILE = ".vlprep.lock"


@dataclass
class OutLock:
    """OUT's lock as this process holds it: a flock'd descriptor (a local OUT) or the token of the lock object (a URL
    OUT). An empty one stands for a hold this process already had (a library user running stages one after another),
    which its first holder releases."""

    fd: int = -1
    url: str | None = None
    token: str = ""

    def release(self) -> None:
        """Let other processes write OUT again (once; a second call does nothing)."""
        import fcntl

        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
        if self.url is not None and self.token:
            target = objstore.join(self.url, LOCK_FILE)
            with contextlib.suppress(VlprepError):
                if (_read_lock(target) or {}).get("token") == self.token:
                    objstore.remove([target])
            self.token = ""


def lock_output(root: Path, tool: str = "vlprep") -> OutLock:
    """An exclusive flock on OUT/.vlprep.lock, held until its `release` or the process ends; one line if another
    process holds it. The kernel drops it when the holder dies (even kill -9), so there is no stale-lock clean-up."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if pid == str(os.getpid()):
            return OutLock()  # this process holds it already (the file names the holder's pid)
        raise VlprepError(f"OUT {root} is being written by another {tool} process (pid {pid}); wait for it to "
                          "finish or choose another folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return OutLock(fd=fd)


def lock_record() -> dict:
    from vlprep.lifeline import _start_time

    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()) or "",
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": uuid.uuid4().hex}


def _stale(holder: dict) -> bool:
    """A lock whose holder ran on this machine and is gone (its pid is dead or is another process now)."""
    from vlprep.lifeline import _start_time

    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    return _start_time(holder["pid"]) != holder.get("start")


def _read_lock(target: str) -> dict | None:
    """The lock object's record; None when it cannot be read or is not JSON, one line when it is JSON but not a
    record (a list, a string): someone else's object, which we neither trust nor delete."""
    try:
        holder = json.loads(objstore.read_bytes(target))
    except (objstore.RemoteError, ValueError):
        return None
    if not isinstance(holder, dict):
        raise VlprepError(f"{urls.redact(target)} is not a vlprep lock (a JSON {type(holder).__name__}, not an object "
                          f"naming host and pid); if no process writes OUT, delete it (aws s3 rm / gcloud storage rm "
                          f"{urls.redact(target)}) and run again")
    return holder


def _create_lock(fs, lpath: str, target: str, url: str, record: dict) -> None:
    """Write the lock object only where none is; FileExistsError where one is."""
    body = json.dumps(record).encode()
    try:
        objstore.retried(target, lambda: fs.pipe_file(lpath, body, mode="create"), doing="write")
    except objstore.RemoteNotFound:
        raise VlprepError(f"OUT {url}: cannot create {target}: not found (does the bucket exist?)") from None
    except objstore.RemoteError:  # a store whose refused create-only write is not FileExistsError (a 412)
        if objstore.exists(target):
            raise FileExistsError(target) from None
        raise
    except TypeError:  # a filesystem without create-only writes: check, write, read back (a narrow race)
        if objstore.exists(target):
            raise FileExistsError(target) from None
        objstore.retried(target, lambda: fs.pipe_file(lpath, body), doing="write")
        if (_read_lock(target) or {}).get("token") != record["token"]:
            raise FileExistsError(target) from None


def lock_url(url: str, tool: str = "vlprep") -> OutLock:
    """Create OUT's lock object, or a one-line refusal naming its holder. A lock left by a process of this machine
    that is gone (kill -9) is replaced; one from another machine is cleared by hand (docs/SCALE.md)."""
    url = objstore.norm(url)
    fs, path = objstore.filesystem(url)
    target = objstore.join(url, LOCK_FILE)
    lpath = f"{path.rstrip('/')}/{LOCK_FILE}"
    record = lock_record()
    for _ in range(2):
        try:
            _create_lock(fs, lpath, target, url, record)
            return OutLock(url=url, token=record["token"])
        except FileExistsError:
            pass
        holder = _read_lock(target) or {}
        if holder and all(holder.get(k) == record[k] for k in ("host", "pid", "start")):
            return OutLock()  # this process holds it already
        if holder and _stale(holder):
            objstore.remove([target])
            continue
        who = (f"pid {holder.get('pid', 'unknown')} on {holder.get('host', 'an unknown host')}, since "
               f"{holder.get('since', '?')}") if holder else "unknown"
        raise VlprepError(f"OUT {url} is being written by another {tool} process ({who}); wait for it to finish or "
                          f"choose another folder (the lock is advisory: if that process is gone, delete {target})")
    raise VlprepError(f"OUT {url}: cannot take the lock {target}; delete it if no process writes OUT, and run again")

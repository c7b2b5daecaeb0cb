"""A checkpoint given as a URL (s3://, gs://, http(s)://) to `vltrain eval`, `export`, `benchmark` and `gradcam`:
downloaded once, whole, into a private temporary folder (mode 0700, objstore's retries), read there as a local
checkpoint by vltrain.checkpoint.load (weights_only: the same safety as a local file), and removed afterwards, also
on an error, Ctrl-C or SIGTERM. Every message and record names the URL redacted (vlprep.urls), never the temporary
copy."""

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from vlprep import VlprepError, objstore
from vlprep.urls import redact
from vltrain.errors import CheckpointError, TrainError

# the run files beside a checkpoint that an export records (provenance, eval numbers): fetched with it when present
SIDECARS = ("result.json", "eval.json")


def is_url(checkpoint) -> bool:
    """Whether CHECKPOINT is a URL read through objstore (a local path or file:// is not)."""
    return objstore.is_remote(checkpoint if isinstance(checkpoint, str) else "")


def file_name(url: str) -> str:
    """The last segment of a URL's path (no query string): best.pt for https://host/run/best.pt?X-Amz-Signature=..."""
    return urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1] or "checkpoint.pt"


def beside(url: str, name: str) -> str:
    """The URL of file `name` in the folder of the file at `url` (s3:// or gs://: no query string)."""
    return objstore.join(url.rsplit("/", 1)[0], name)


def result_url(checkpoint: str, name: str, flag: str) -> str:
    """Where a command's result file goes by default for a checkpoint at a URL: `name` beside it, as for a local
    checkpoint (s3://, gs://); an http(s):// checkpoint's folder cannot be written, so `flag` must name a file."""
    if objstore.scheme(checkpoint) not in objstore.WRITABLE:
        raise TrainError(f"{redact(checkpoint)}: {objstore.scheme(checkpoint)}:// is read-only, so the result cannot "
                         f"go beside the checkpoint; give {flag} PATH")
    return beside(checkpoint, name)


def upload_result(local: Path, url: str, flag: str) -> None:
    """Put a result file whole at `url`. A refused or failed write (a bucket this user may only read) comes after the
    work that made the result, so the result is not lost with it: it is kept in a local file first (keep_copy), and
    the one-line error names that file and suggests `flag`."""
    try:
        objstore.put_file(local, url)
    except VlprepError as e:
        kept = keep_copy(local)
        where = f"the result is saved in {kept} instead" if kept else "the result could not be saved locally either"
        raise TrainError(f"{e}; {where} (give {flag} PATH to write it to a local file)") from None


def keep_copy(local: Path) -> Path | None:
    """A copy of the file `local` under its own name in the current folder (NAME-2.json, NAME-3.json ... when the
    name is taken: a file already there is never replaced), else in the temporary folder when the current one cannot
    be written; its absolute path, or None when neither can be written."""
    data = local.read_bytes()
    try:
        folders = [Path.cwd(), Path(tempfile.gettempdir())]
    except OSError:  # the current folder was removed
        folders = [Path(tempfile.gettempdir())]
    for folder in folders:
        for i in range(1, 1000):
            dest = folder / (local.name if i == 1 else f"{local.stem}-{i}{local.suffix}")
            try:
                f = open(dest, "xb")  # exclusive: a name taken meanwhile is left alone
            except FileExistsError:
                continue
            except OSError:  # not writable: the next folder
                break
            try:
                with f:
                    f.write(data)
            except OSError:  # a full disk: no partial result left behind
                dest.unlink(missing_ok=True)
                break
            return dest
    return None


@contextlib.contextmanager
def local_checkpoint(checkpoint, sidecars=()):
    """CHECKPOINT as a local Path: itself when it is local; for a URL, a downloaded copy of the file (and of those of
    `sidecars` found beside it), removed when the block ends, also by SIGTERM (unwound_on_sigterm). Inside the block,
    a one-line error that names the copy (vltrain.checkpoint's CheckpointError, a TrainError, gradcam's ValueError)
    names the URL, redacted, instead."""
    if not is_url(checkpoint):
        yield Path(checkpoint)
        return
    url, shown = checkpoint, redact(checkpoint)
    with unwound_on_sigterm():  # SIGTERM's default would end the process before the `finally` removing the copy
        folder = Path(tempfile.mkdtemp(prefix="vltrain-ckpt-"))  # 0700: the weights are readable by this user only
        try:
            local = folder / file_name(url)
            fetch(url, local)
            for name in sidecars:
                if name != local.name:
                    with contextlib.suppress(objstore.RemoteError):  # optional; a presigned URL signs one object
                        objstore.get_file(beside(url, name), folder / name)
            try:
                yield local
            except (ValueError, TrainError, VlprepError) as e:  # the one-line errors (CheckpointError is a ValueError)
                for where in (str(local.resolve()), str(local), str(folder)):
                    e.args = tuple(a.replace(where, shown) if isinstance(a, str) else a for a in e.args)
                raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class Terminated(BaseException):
    """SIGTERM inside unwound_on_sigterm's block: unwinds it (a BaseException: `except Exception` does not stop it)."""


@contextlib.contextmanager
def unwound_on_sigterm():
    """While the block runs, SIGTERM unwinds it (raises Terminated) so that its `finally` clauses run, then ends the
    process by SIGTERM as the default handler would (a shell reports 143); the handler found is restored when the block
    ends. Only over the default handler and from the main thread (the only one that may set handlers): a program with
    its own SIGTERM handler, or one ignoring SIGTERM, keeps it. A second SIGTERM while the block unwinds, or one
    reaching a process forked inside the block (a DataLoader worker inherits the handler), ends that process at once
    as the default would. (vlprep.lifeline.stop_on_signals turns SIGTERM into Ctrl-C and ignores later ones: right
    for a stage that stops its workers, not for a process that must end as SIGTERM ends it.)"""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    me = os.getpid()

    def unwind(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next one ends the process
        if os.getpid() != me:  # a forked child: nothing of its own to remove
            signal.raise_signal(signal.SIGTERM)
        raise Terminated

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # ends the process, as the signal would have
        raise  # not reached
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def fetch(url: str, local: Path) -> None:
    """Download the checkpoint file at `url` to `local`; one line naming CHECKPOINT (redacted) for a missing object,
    missing credentials or a read that fails after the retries, and for a folder (a prefix with objects under it)."""
    shown = redact(url)
    try:
        fs, path = objstore.filesystem(url)
        kind = objstore.retried(url, lambda: fs.info(path)).get("type", "file")
        if kind != "directory":
            objstore.get_file(url, local)
    except objstore.RemoteNotFound:
        raise CheckpointError(f"CHECKPOINT {shown}: not found") from None
    except VlprepError as e:  # its line starts with the URL, redacted
        raise CheckpointError(f"CHECKPOINT {e}") from None
    if kind == "directory":
        raise CheckpointError(f"CHECKPOINT {shown} is a folder, not a checkpoint file (last.pt or best.pt); an export "
                              "folder is read from a local copy only")

"""Remote I/O for datasets in object storage: a dataset folder given as an fsspec URL (s3://, gs://, http(s)://) is
read with bounded retries, listed, and written file by file (a URL OUT's staging, uploads and lock: vlprep.output).

- Reading. `open_read(url)` is a seekable file whose reads resume at their offset after a transient error
  (connection reset, 5xx, timeout): `VLPREP_REMOTE_TRIES` tries in all (default 5), waiting
  `VLPREP_REMOTE_BACKOFF` seconds (default 0.5) doubled after each, at most 8 s. A read that still fails, or a
  permanent error (404, 403), is one `RemoteError` line naming the URL.
- Writing. `put_file` uploads a whole file: a PUT (or a multipart upload) is visible under its key only once it is
  complete.

Credentials and endpoints come from the standard places of each library (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, ~/.aws, GOOGLE_APPLICATION_CREDENTIALS, fsspec's own config), never from an option of ours.
"""

import atexit
import contextlib
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from vlprep import VlprepError, cut, urls

# scheme -> the package fsspec needs for it (the [cloud] extra); ALIASES name the same stores (canonical)
SCHEMES = {"s3": "s3fs", "s3a": "s3fs", "s3n": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp",
           "https": "aiohttp"}
ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs"}
WRITABLE = ("s3", "s3a", "s3n", "gs", "gcs")
CLOUD_EXTRA = "pip install -e '.[cloud]'"
BLOCK = 8 << 20  # bytes per ranged read: one request per 8 MiB of a shard


class RemoteError(VlprepError):
    """A remote file that cannot be read or written (after the retries, for a transient fault)."""


class RemoteNotFound(RemoteError):
    """A remote file that does not exist (404, NoSuchKey)."""


class RemoteSrc(NamedTuple):
    """A remote input dataset folder in a `Work`'s arguments: the worker fetches the shard it processes from it."""

    url: str


def scheme(url: str) -> str:
    return urls.scheme(url)


def is_remote(value) -> bool:
    """Whether `value` is a URL read through fsspec (s3://, gs://, http(s)://); a file:// URL is a local path."""
    return isinstance(value, str) and scheme(value) in SCHEMES


def norm(url: str) -> str:
    """A dataset folder's URL in its one canonical form (vlprep.urls.canonical: s3a://b/ds/ -> s3://b/ds)."""
    return urls.canonical(url)


def join(url: str, name: str) -> str:
    """The URL of file `name` in folder `url`; a query string (a token) stays after the file name."""
    return urls.join(norm(url), name)


def filesystem(url: str):
    """(fsspec filesystem, path in it) for a URL (canonical first: fsspec knows no s3n://); one line when the
    [cloud] extra is missing. Errors name the URL redacted (vlprep.urls)."""
    url, shown = urls.canonical(url), cut(urls.redact(url))
    try:
        import fsspec
    except ImportError:
        raise VlprepError(f"{shown}: reading URLs needs fsspec and the [cloud] extra: {CLOUD_EXTRA}") from None
    kind = scheme(url)
    opts = {}
    if kind in ("http", "https"):
        # a server that stops sending is a timeout (a transient fault), not a read that waits forever
        try:
            import aiohttp
        except ImportError:
            raise VlprepError(f"{shown}: reading {kind}:// URLs needs aiohttp, in the [cloud] extra: "
                              f"{CLOUD_EXTRA}") from None
        limit = _env_float("VLPREP_REMOTE_TIMEOUT", 60.0)
        opts["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=limit, sock_read=limit)}
    try:
        return fsspec.core.url_to_fs(url, **opts)
    except ImportError:
        raise VlprepError(f"{shown}: {kind}:// URLs need {SCHEMES.get(kind, 'a package')}, in the [cloud] extra: "
                          f"{CLOUD_EXTRA}") from None
    except ValueError as e:
        raise VlprepError(f"{shown}: not a URL fsspec can open ({cut(urls.redact_text(str(e)), 120)})") from None


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        raise VlprepError(f"{name} must be a number") from None


def tries() -> int:
    return max(1, int(_env_float("VLPREP_REMOTE_TRIES", 5)))


def backoff(attempt: int) -> float:
    """The wait before retry number `attempt` + 1: VLPREP_REMOTE_BACKOFF doubled each time, at most 8 s."""
    return min(_env_float("VLPREP_REMOTE_BACKOFF", 0.5) * 2 ** attempt, 8.0)


_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSIENT_LIBS = ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "google", "gcsfs")


def transient(e: BaseException) -> bool:
    """Whether another try may succeed: a connection reset or refused, a timeout, a 5xx (or 408, 429) answer, a body
    cut short. A missing object or a refused permission is not retried."""
    if isinstance(e, FileNotFoundError) and e.__cause__ is not None and e.__cause__ is not e:
        return transient(e.__cause__)  # fsspec's http info() says "not found" for any failure, a 503 included
    if isinstance(e, _PERMANENT):
        return False
    status = getattr(e, "status", None) or getattr(e, "code", None)
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore's ClientError: NoSuchBucket, AccessDenied (4xx) or SlowDown (503)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or status
    if isinstance(status, int) and 400 <= status < 500:
        return status in (408, 429)
    if isinstance(status, int) and status >= 500:
        return True
    if isinstance(e, (ConnectionError, TimeoutError, OSError)):
        return True
    return type(e).__module__.split(".")[0] in _TRANSIENT_LIBS


def why(e: BaseException) -> str:
    """An exception as a short phrase for a one-line error (any URL in it redacted)."""
    text = urls.redact_text(next((ln.strip() for ln in str(e).splitlines() if ln.strip()), ""))
    return f"{type(e).__name__}: {cut(text, 160)}" if text else type(e).__name__


def missing_credentials(e: BaseException) -> bool:
    """botocore's NoCredentialsError / PartialCredentialsError (and the like): a configuration error, not a fault
    another try could mend."""
    return any(c.__module__.split(".")[0] in ("botocore", "google") and "Credentials" in c.__name__
               for c in type(e).__mro__)


def retried(url: str, call: Callable, on_retry: Callable[[], None] | None = None, doing: str = "read"):
    """call() with up to `tries()` attempts while it fails transiently; a RemoteError line naming `url` (redacted)
    after. Missing credentials are one line at once."""
    n = tries()
    shown = urls.redact(url)
    for attempt in range(n):
        try:
            return call()
        except Exception as e:
            if isinstance(e, (VlprepError, FileExistsError)):
                raise  # FileExistsError: a create-only write found the object (the lock's callers handle it)
            if missing_credentials(e) or missing_credentials(e.__cause__ or e):
                kind = scheme(url)
                raise RemoteError(f"{shown}: no credentials to {doing} it ({why(e)}); set "
                                  f"{urls.ENV_HINT.get(kind, 'the standard variables of its library')}") from None
            if not transient(e):
                if isinstance(e, FileNotFoundError):
                    raise RemoteNotFound(f"{shown}: not found") from None
                raise RemoteError(f"{shown}: cannot {doing} it ({why(e)})") from None
            if attempt == n - 1:
                cause = e.__cause__ if isinstance(e, FileNotFoundError) and e.__cause__ is not None else e
                raise RemoteError(f"{shown}: cannot {doing} it after {n} tries ({why(cause)})") from None
        if on_retry is not None:
            on_retry()
        time.sleep(backoff(attempt))


class RemoteFile(io.RawIOBase):
    """A remote file opened for reading, seekable, whose reads resume at their offset after a transient error.

    Hand-written: fsspec's files (HTTPFile, S3File) read in ranged blocks but give up on the first fault, and
    webdataset's `gopen` streams a whole URL with no resume, so a retry there would re-read samples already used.
    Here a failed read reopens the file at the same offset, so the samples come out exactly as without the fault.
    `on_retry` is called once per retry (vltrain counts them in its metrics).
    """

    def __init__(self, url: str, on_retry: Callable[[], None] | None = None, block: int = BLOCK):
        super().__init__()
        self.url, self.on_retry, self.block = url, on_retry, block
        self.fs, self.path = filesystem(url)
        self._f = None
        self.pos = 0
        self.size = retried(url, lambda: self._open().size, on_retry)

    def _open(self):
        if self._f is None:
            self._f = self.fs.open(self.path, "rb", block_size=self.block, cache_type="readahead")
        return self._f

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def readinto(self, buf) -> int:
        want = min(len(buf), max(0, self.size - self.pos))
        if want == 0:
            return 0

        def read() -> bytes:
            try:
                f = self._open()
                if f.tell() != self.pos:
                    f.seek(self.pos)
                data = f.read(want)
            except BaseException:
                self._drop()  # the next try opens the file afresh at self.pos
                raise
            if not data:
                self._drop()
                raise ConnectionError(f"no data at offset {self.pos} of {self.size}")
            return data

        data = retried(self.url, read, self.on_retry)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        self._drop()
        super().close()


def open_read(url: str, on_retry: Callable[[], None] | None = None, buffering: int = 1 << 16) -> io.BufferedReader:
    """A buffered, seekable reader of a remote file (RemoteFile); `.raw.size` is its length."""
    return io.BufferedReader(RemoteFile(url, on_retry), buffer_size=buffering)


def read_bytes(url: str, on_retry: Callable[[], None] | None = None) -> bytes:
    fs, path = filesystem(url)
    return retried(url, lambda: fs.cat_file(path), on_retry)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return retried(url, lambda: fs.exists(path))


def info(url: str) -> dict:
    """{'size', 'etag'} of a remote file: the ETag (S3, GCS, most HTTP servers) or '' when it has none."""
    fs, path = filesystem(url)
    got = retried(url, lambda: fs.info(path))
    etag = got.get("ETag") or got.get("etag") or got.get("md5Hash") or ""
    return {"size": int(got.get("size") or 0), "etag": str(etag).strip('"')}


def listing(url: str) -> dict[str, dict] | None:
    """The folder's entries {name: {'size', 'etag', 'type'}} (one LIST request); None where a server has no listing
    (http(s): a file's info is asked on its own)."""
    if scheme(url) not in WRITABLE:
        return None
    fs, path = filesystem(url)
    try:
        entries = retried(url, lambda: fs.ls(path, detail=True, refresh=True))
    except RemoteNotFound:
        return {}
    out = {}
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if name and e["name"].rstrip("/") != path.rstrip("/"):
            etag = e.get("ETag") or e.get("etag") or e.get("md5Hash") or ""
            out[name] = {"size": int(e.get("size") or 0), "etag": str(etag).strip('"'), "type": e.get("type", "file")}
    return out


def get_file(url: str, local: Path, on_retry: Callable[[], None] | None = None) -> None:
    """Download `url` to `local`, whole: through `local`.tmp, renamed when complete."""
    fs, path = filesystem(url)
    tmp = local.with_name(local.name + ".tmp")
    retried(url, lambda: fs.get_file(path, str(tmp)), on_retry)
    os.replace(tmp, local)


def put_file(local: Path, url: str) -> None:
    """Upload `local` to `url`: a PUT (or a multipart upload) is visible under its key only once it is complete."""
    fs, path = filesystem(url)
    retried(url, lambda: fs.put_file(str(local), path), doing="write")


def remove(urls: Iterable[str]) -> None:
    for url in urls:
        fs, path = filesystem(url)
        with contextlib.suppress(FileNotFoundError):
            retried(url, lambda: fs.rm_file(path), doing="delete")


# --- input datasets: a local mirror of the small files --------------------------------------------------------------

def mirror() -> Path:
    """A new local folder for an opened remote dataset's small files (its `Dataset.root`), removed when the process
    that made it ends (DataLoader workers forked from it share it)."""
    path = Path(tempfile.mkdtemp(prefix="vlprep-in-"))
    atexit.register(_remove, str(path), os.getpid())
    return path


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def fetched(src: RemoteSrc, names: Iterable[str]):
    """A local folder holding the files `names` of the remote dataset `src` (a shard and its sidecar), removed
    afterwards: what a stage's per-shard function reads (one shard at a time per worker, so local disk stays bounded
    by the shard)."""
    folder = Path(tempfile.mkdtemp(prefix="vlprep-shard-"))
    try:
        for name in names:
            get_file(join(src.url, name), folder / name)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)

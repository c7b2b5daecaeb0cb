"""The files `vlprep view` touches, none through a symbolic link: a dataset's files are read only when they are
regular files reached through no link (a dataset is data: a link in it may point anywhere, /proc/self/environ
included), OUT's own files are replaced rather than written through, and `--serve` answers only regular files under
OUT, and only requests whose Host header names the address it bound (a DNS-rebinding page names its own host)."""

import errno
import http.server
import os
import stat
from functools import partial
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from vlprep import VlprepError

LINK_ERRNOS = (errno.ELOOP, errno.EMLINK, errno.ENOTDIR)  # O_NOFOLLOW met a link (EMLINK: FreeBSD), or a file
SERVE_HOST = "127.0.0.1"


class NotRegular(Exception):
    """A step of the path is a symbolic link, or the file is no regular file (a folder, a FIFO, a device)."""


def open_regular(root: Path, *parts: str) -> BinaryIO | None:
    """`root/parts...` opened for reading, each step opened with O_NOFOLLOW below `root` (so no link is followed,
    whoever swaps one in); None when it is missing, NotRegular when a step is a link or the file is not regular."""
    if not parts or any(p in ("", ".", "..") or "/" in p or "\0" in p for p in parts):
        raise NotRegular("not a plain name")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            # O_NONBLOCK: a FIFO opens at once (then fails the regular-file check) instead of waiting for a writer
            kind = os.O_NONBLOCK if i == len(parts) - 1 else os.O_DIRECTORY
            try:
                step = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | kind, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno in LINK_ERRNOS:
                    raise NotRegular("a symbolic link") from None
                raise
            os.close(fd)
            fd = step
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular("not a regular file")
        f = os.fdopen(fd, "rb")
        fd = -1
        return f
    finally:
        if fd >= 0:
            os.close(fd)


def refuse_links(root: Path, names) -> None:
    """A one-line error when one of the files `names` of the dataset folder `root` is a symbolic link."""
    for name in names:
        if (root / name).is_symlink():
            raise VlprepError(f"{root / name} is a symbolic link: `vlprep view` follows no link in a dataset (it may "
                              "point anywhere); copy the file in its place")


def write_file(path: Path, data: bytes) -> None:
    """Write `path` (mode 0644) as a new file renamed over the old name: a link left there is replaced, never
    written through."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class OutHandler(http.server.SimpleHTTPRequestHandler):
    """http.server's file handler narrowed to regular files under OUT reached through no link: no folder listing
    (a folder is its index.html), 404 for anything else, 421 for a Host header other than the bound address."""

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        pass

    def send_head(self):
        if self.headers.get("Host", "").lower() not in self.server.hosts:
            self.send_error(421, "Misdirected Request", "the Host header does not name this server")
            return None
        path = unquote(urlsplit(self.path).path)
        parts = path.split("/")[1:]
        if not parts or not parts[-1]:
            parts = [*parts[:-1], "index.html"]
        try:
            f = open_regular(Path(self.directory), *parts)
        except (NotRegular, OSError):
            f = None
        if f is None:
            self.send_error(404, "File not found")
            return None
        size = os.fstat(f.fileno()).st_size
        self.send_response(200)
        self.send_header("Content-Type", self.guess_type(parts[-1]))
        self.send_header("Content-Length", str(size))
        self.end_headers()
        return f


def make_server(out: Path, port: int) -> http.server.ThreadingHTTPServer:
    """An http.server on 127.0.0.1 serving the regular files under `out` (port 0: any free port)."""
    try:
        server = http.server.ThreadingHTTPServer((SERVE_HOST, port), partial(OutHandler, directory=str(out)))
    except OSError as e:
        raise VlprepError(f"cannot serve on {SERVE_HOST}:{port} ({e.strerror or e}); give another --port, or --port "
                          "0 for any free one") from None
    bound = server.server_address[1]
    names = (SERVE_HOST, "localhost")
    server.hosts = frozenset(f"{n}:{bound}" for n in names) | (frozenset(names) if bound == 80 else frozenset())
    return server

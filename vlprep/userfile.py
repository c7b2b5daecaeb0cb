"""Reading a file a user names: a regular file only, never more than a size cap, and a path kept under its root.

A FIFO would block the reader forever and /dev/zero never ends; both are refused from a stat before any read, and the
file is opened with O_NONBLOCK and checked again on the opened descriptor (a rename in between cannot swap one in).
`read_user_file` is the one-line-error form for a file a command line names (--rescore, --from-file, --overrides);
`open_regular` streams one of any size (a Karpathy split .json, which may be a JSON Lines table); `read_regular` and
`under_root` raise OSErrors that `vlprep shards` counts as skipped images.
"""

import errno
import os
import stat
from typing import BinaryIO

from vlprep import VlprepError

KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


class NotARegularFile(OSError):
    """The path names a folder, FIFO, device or socket: `kind` says which."""

    def __init__(self, kind: str):
        super().__init__(errno.EINVAL, f"{kind}, not a regular file")
        self.kind = kind


class FileTooLarge(OSError):
    """The file holds more than the cap allows."""

    def __init__(self, size: int, max_bytes: int):
        super().__init__(errno.EFBIG, f"{size:,} bytes; at most {max_bytes:,} are read")
        self.size, self.max_bytes = size, max_bytes


class OutsideRoot(OSError):
    """A path that is absolute, climbs out with `..`, or goes through a symlink that leaves its root."""

    def __init__(self):
        super().__init__(errno.EACCES, "outside the root folder")


def _check(st: os.stat_result, max_bytes: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFile(KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
    if max_bytes is not None and st.st_size > max_bytes:
        raise FileTooLarge(st.st_size, max_bytes)


def _open_fd(path: str | os.PathLike, max_bytes: int | None, follow_symlinks: bool) -> tuple[int, int]:
    """(descriptor, size) of a regular file of at most max_bytes, opened without blocking; else OSError."""
    _check(os.stat(path, follow_symlinks=follow_symlinks), max_bytes)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        _check(st, max_bytes)  # what was opened, in case the path changed since the stat
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str | os.PathLike, max_bytes: int | None = None, follow_symlinks: bool = True) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file of at most max_bytes (None: any size), else OSError."""
    return os.fdopen(_open_fd(path, max_bytes, follow_symlinks)[0], "rb")


def read_regular(path: str | os.PathLike, max_bytes: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most max_bytes, else OSError (NotARegularFile, FileTooLarge, ...)."""
    fd, size = _open_fd(path, max_bytes, follow_symlinks)
    try:
        # os.read for the size the stat gave, then to EOF: read(n) would allocate n up front, and a buffered file
        # object costs more than the read itself on small images (vlprep shards reads every image this way)
        parts = []
        total = 0
        while chunk := os.read(fd, min(max(size + 1 - total, 1 << 16), max_bytes + 1 - total)):
            parts.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # it grew after the stat
                raise FileTooLarge(total, max_bytes)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_user_file(path: str | os.PathLike, max_bytes: int, what: str | None = None) -> bytes:
    """The bytes of a file a user named, or VlprepError in one line: missing, unreadable, not a regular file (a FIFO,
    a device, a folder) or over max_bytes. `what` names it in the message ("--templates t.txt"; default: the path)."""
    what = what or str(path)
    try:
        return read_regular(path, max_bytes)
    except FileNotFoundError:
        raise VlprepError(f"{what}: not found") from None
    except (NotARegularFile, FileTooLarge) as e:
        raise VlprepError(f"{what}: {e.strerror}") from None
    except OSError as e:
        raise VlprepError(f"cannot read {what}: {e.strerror or type(e).__name__}") from None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def under_root(root: str, parts: tuple[str, ...], follow_symlinks: bool = False) -> str:
    """root/parts... as a path to open, or OutsideRoot: no absolute part, no `..` out of root (as the kernel resolves
    it), and unless follow_symlinks no symlink whose target is outside root (the path returned is then resolved)."""
    if any(os.path.isabs(p) for p in parts):
        raise OutsideRoot()
    root = os.path.abspath(root)
    path = os.path.join(root, *parts)
    if not _within(os.path.normpath(path), root):
        raise OutsideRoot()
    if follow_symlinks:
        # `link/..` is the link target's parent for the kernel, not root: a `..` must land where normpath says
        if ".." in path.split(os.sep) and os.path.realpath(path) != os.path.realpath(os.path.normpath(path)):
            raise OutsideRoot()
        return path
    # realpath resolves `a/..` the way the kernel does (through a symlinked `a`), which normpath does not
    real = os.path.realpath(path)
    if not _within(real, os.path.realpath(root)):
        raise OutsideRoot()
    return real

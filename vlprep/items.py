"""The records a source yields (`Item`, `Source`) and the references an item may name its image by; shared by
vlprep/sources.py and vlprep/karpathy.py."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from vlprep.dataset import TarRef


class RootedPath(NamedTuple):
    """A Karpathy entry's image: `parts` (filepath, filename) under `root`, read only if it stays there
    (vlprep.userfile.under_root); str() is the joined path, as a plain path item would hold."""

    root: str
    parts: tuple[str, ...]
    follow_symlinks: bool = False

    @property
    def path(self) -> str:
        return str(Path(self.root, *self.parts))

    def __str__(self) -> str:
        return self.path


class RowRef(NamedTuple):
    """An image cell of a Parquet file (bytes, or a Hugging Face {bytes, path} struct), read by the worker."""

    path: str
    column: str
    row: int


@dataclass
class Item:
    """One source record before any checks: the image as a path, bytes or a reference, the caption as read.

    A multi-caption record (a Karpathy split file) also has `captions`, all of them in file order (`caption` is the
    first), and `meta`, extra json fields kept with the sample (cocoid, imgid, split).
    """

    uid: str
    image: str | bytes | TarRef | RowRef | RootedPath | None
    caption: str | bytes | None
    source: str
    url: str | None = None
    captions: list[str | None] | None = None
    meta: dict | None = None


@dataclass
class Source:
    kind: str                    # parquet | csv | tsv | jsonl | folder | webdataset | karpathy
    path: Path
    columns: dict[str, str | None]
    total: int | None            # number of items when cheap to know (for the progress bar)
    items: Iterator[Item]
    multi_caption: bool = False  # items carry `captions`: samples get json.captions and the sidecar a captions column


def json_error(e: Exception) -> str:
    """A JSON parse failure in words: the decoder's message, not UTF-8, or nesting past Python's recursion limit."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start:,})"
    return str(e).splitlines()[0].split("; use sys.")[0]  # (a 5,000-digit integer's advice is for programmers)

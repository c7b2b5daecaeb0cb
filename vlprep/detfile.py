"""A `detect --from-file` detections file, streamed once into a keyed index on disk that the driver queries per shard.

The file is JSON Lines, one {"key": KEY, "objects": [{"label", "score", "box"}]} per line; every key must be in the
dataset, once. The index is an SQLite file in a temporary folder (TMPDIR), removed when the stage ends: the dataset's
keys by shard, and each line's checked objects by key. SQLite is in the standard library and keeps a bounded page
cache, so reading the file, checking its keys and looking up one shard's detections take a constant amount of memory
whatever the size of the dataset (a sorted file with bisection would need an external sort written here).
"""

import contextlib
import hashlib
import json
import math
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from vlprep import VlprepError, cut
from vlprep.lifeline import stop_on_signals
from vlprep.userfile import NotARegularFile, open_regular

CACHE_KIB = 32 << 10  # SQLite's page cache: a constant, enough to keep the key indexes' upper levels in memory
SCHEMA = """
CREATE TABLE sample (shard INTEGER, key TEXT, PRIMARY KEY (shard, key)) WITHOUT ROWID;
CREATE TABLE det (key TEXT PRIMARY KEY, objects TEXT) WITHOUT ROWID;
"""


def _row(line: bytes, where: str) -> dict:
    """One line's JSON object with fields 'key' and 'objects', or a one-line error naming the line."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit integer
        why = e.__class__.__name__ if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else (
            "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0])
        raise VlprepError(f"{where}: malformed JSON ({why})") from None
    if not isinstance(row, dict) or "key" not in row or "objects" not in row:
        raise VlprepError(f"{where}: expected an object with fields 'key' and 'objects'")
    return row


def _finite(v) -> float | None:
    """A JSON number as a finite float; None for anything else: a bool, a string, NaN or an infinity (which json
    parses from `NaN`, `Infinity` and `1e400`), an integer no float holds."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _clean_objects(objs, where: str) -> list[dict]:
    """A line's objects checked and rounded as the shards store them, or a one-line error naming the line: every
    number finite (the sample's json must stay strict JSON), every box inside the image and not inverted."""
    if not isinstance(objs, list):
        raise VlprepError(f"{where}: 'objects' must be a list")
    clean = []
    for j, o in enumerate(objs):
        if not isinstance(o, dict) or not {"label", "score", "box"} <= set(o):
            raise VlprepError(f"{where}: object {j} needs fields label, score and box")
        box = o["box"]
        xy = [_finite(v) for v in box] if isinstance(box, list) and len(box) == 4 else [None]
        if None in xy or not all(0 <= v <= 1 for v in xy):
            raise VlprepError(f"{where}: object {j}: box must be 4 numbers in [0, 1] (x0, y0, x1, y1)")
        if xy[2] < xy[0] or xy[3] < xy[1]:
            raise VlprepError(f"{where}: object {j}: box {cut(repr(box), 60)} is inverted: (x0, y0, x1, y1) needs "
                              "x0 <= x1 and y0 <= y1")
        score = _finite(o["score"])
        if score is None or not isinstance(o["label"], str):
            raise VlprepError(f"{where}: object {j}: label must be a string and score a finite number")
        clean.append({"label": o["label"], "score": round(score, 4), "box": [round(v, 4) for v in xy]})
    return clean


def _has(con: sqlite3.Connection, sql: str, key: str) -> bool:
    try:
        return con.execute(sql, (key,)).fetchone() is not None
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") has no UTF-8 form: it is in no dataset and no index
        return False


def _open(path: Path, what: str) -> BinaryIO:
    """The file opened for reading, or a one-line error: missing, special (a FIFO, a device) or unreadable. Any size:
    it is streamed."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise VlprepError(f"{what}: not found") from None
    except NotARegularFile as e:
        raise VlprepError(f"{what}: {e.strerror}") from None
    except OSError as e:
        raise VlprepError(f"cannot read {what}: {e.strerror or type(e).__name__}") from None


class DetectionIndex:
    """An open index: `digest` (the file's blake2b, for the shards' fingerprints) and `shard(i)`."""

    def __init__(self, con: sqlite3.Connection, digest: bytes):
        self.con = con
        self.digest = digest

    def shard(self, i: int) -> dict[str, list[dict]]:
        """key -> objects for the keys of the dataset's i-th shard that the file has."""
        rows = self.con.execute("SELECT s.key, d.objects FROM sample s JOIN det d ON d.key = s.key WHERE s.shard = ?",
                                (i,))
        return {key: json.loads(objects) for key, objects in rows}


def _add(con: sqlite3.Connection, line: bytes, where: str) -> None:
    """Check one line (without its newline) and put its objects in the index; a one-line error naming it."""
    if not line.strip():
        return
    row = _row(line, where)
    key = row["key"]
    if not isinstance(key, str) or not _has(con, "SELECT 1 FROM sample WHERE key = ? LIMIT 1", key):
        raise VlprepError(f"{where}: unknown key {cut(repr(key), 60)} (not in the dataset)")
    if _has(con, "SELECT 1 FROM det WHERE key = ?", key):
        raise VlprepError(f"{where}: key {key!r} appears twice")
    objects = json.dumps(_clean_objects(row["objects"], where), separators=(",", ":"), allow_nan=False)
    con.execute("INSERT INTO det VALUES (?, ?)", (key, objects))


def _load(con: sqlite3.Connection, path: Path, shard_keys: Iterable[list[str]]) -> bytes:
    """Fill the index: the dataset's keys shard by shard, then the file's lines checked in order (the first bad line
    is the error, as a whole-file read would find it); returns the file's digest."""
    for i, keys in enumerate(shard_keys):
        # OR IGNORE: a key twice in one shard is one row (the shard's lookup returns a dict by key anyway)
        con.executemany("INSERT OR IGNORE INTO sample VALUES (?, ?)", ((i, k) for k in keys))
    con.execute("CREATE INDEX sample_key ON sample (key)")  # built once the keys are in: a sort, not random inserts
    digest = hashlib.blake2b(digest_size=16)
    what = f"detections file {path}"
    with _open(path, what) as f:
        try:
            for lineno, line in enumerate(f, 1):
                digest.update(line)
                _add(con, line[:-1] if line.endswith(b"\n") else line, f"{path.name}:{lineno}")
        except OSError as e:  # a read error halfway (the checks raise VlprepError)
            raise VlprepError(f"cannot read {what}: {e.strerror or type(e).__name__}") from None
    con.commit()
    return digest.digest()


@contextlib.contextmanager
def detection_index(path: Path, shard_keys: Iterable[list[str]]) -> Iterator[DetectionIndex]:
    """The index of detections file `path` against a dataset whose shards hold `shard_keys` (a list of keys per shard,
    in shard order, read one at a time); a one-line error naming the line for anything malformed. Removed after."""
    # SIGTERM as Ctrl-C (vlprep.lifeline's Stopped) while the index exists: the folder goes, not only on an error
    with stop_on_signals(), tempfile.TemporaryDirectory(prefix="vlprep-detect-") as folder:
        # a throwaway file: no journal and no fsync, since a crash only means building it again
        con = sqlite3.connect(Path(folder) / "detections.sqlite")
        try:
            con.execute("PRAGMA journal_mode = OFF")
            con.execute("PRAGMA synchronous = OFF")
            con.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            con.executescript(SCHEMA)
            yield DetectionIndex(con, _load(con, path, shard_keys))
        except sqlite3.Error as e:  # e.g. TMPDIR full: "database or disk is full"
            raise VlprepError(f"the detections index in {folder}: {e}") from None
        finally:
            con.close()

"""Image-caption sources for `vlprep shards`: tables, image folders, existing WebDatasets, and Karpathy split files
(read by vlprep/karpathy.py).

Each source is a generator of `Item`s in a fixed order; the item's position in that order is its
sample index, so keys depend only on the source, never on timing or the number of workers.
An item names its image (a file path, a TarRef into a tar, a RowRef into a Parquet file) rather than
holding its bytes, so that only paths travel to the workers (docs/SCALE.md); `load_images` reads them
where the shard is written.
"""

import bisect
import csv
import itertools
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import TarRef, iter_tar
from vlprep.items import Item, RootedPath, RowRef, Source, json_error
from vlprep.userfile import KINDS, read_regular

TABLE_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv",
                  ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
# Common names, most specific first; the first one present in the table wins.
IMAGE_COLUMNS = ("image", "image_path", "img", "img_path", "filepath", "file_name", "filename", "file",
                 "path", "jpg", "png")
CAPTION_COLUMNS = ("caption", "text", "txt", "caption_text", "sentence", "title", "alt", "description")
UID_COLUMNS = ("uid", "key", "id", "image_id")
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def _pick(columns: list[str], wanted: str | None, defaults: tuple[str, ...], what: str, path: Path,
          flag: str, required: bool = True) -> str | None:
    if wanted is not None:
        if wanted not in columns:
            raise VlprepError(f"{path.name}: no column {wanted!r}; columns are: {', '.join(columns)}")
        return wanted
    lower = {c.lower(): c for c in columns}
    for name in defaults:
        if name in lower:
            return lower[name]
    if not required:
        return None
    hint = ""
    if what == "image" and "url" in lower:
        hint = " (column 'url' holds URLs: download them first, e.g. with img2dataset, then re-shard its output)"
    raise VlprepError(f"{path.name}: no {what} column found (looked for {', '.join(defaults[:6])}, ...); "
                      f"columns are: {', '.join(columns)}; pass {flag}{hint}")


def _table_columns(path: Path, kind: str) -> list[str]:
    try:
        if kind == "parquet":
            return list(pq.read_schema(path).names)
        if kind in ("csv", "tsv"):
            with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
                return next(csv.reader(f, delimiter="\t" if kind == "tsv" else ","), [])
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise VlprepError(f"{path.name}:{lineno}: expected one JSON object per line")
                    return list(row)
            return []
    except VlprepError:
        raise
    except (OSError, ValueError, RecursionError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise VlprepError(f"cannot read {path}: {json_error(e)}") from None


def _cell_image(value, base: Path) -> str | bytes | None:
    if isinstance(value, dict):  # Hugging Face `datasets` stores images as {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if value is None or isinstance(value, bytes):
        return value
    value = str(value).strip()
    if not value:
        return None
    return str(base / value) if not os.path.isabs(value) else value


# Python's default field limit, 128 KiB, stopped a whole table at one long caption; 64 MiB still bounds the cell an
# unclosed quote runs on to the end of the file.
CSV_FIELD_BYTES = 64 << 20
csv.field_size_limit(CSV_FIELD_BYTES)


def _table_rows(path: Path, kind: str, cols: list[str]) -> Iterator[dict]:
    if kind == "parquet":
        pf = pq.ParquetFile(path)
        pool = pa.default_memory_pool()
        # A row group at a time, its memory handed back after it: one reader over the whole file, and pyarrow's
        # default allocator (mimalloc) keeping what a read freed, grew the driver by about 60 bytes per row over
        # a file of 1,000 row groups; this way it stays flat.
        for group in range(pf.num_row_groups):
            for batch in pf.iter_batches(batch_size=1024, columns=cols, row_groups=[group]):
                yield from batch.to_pylist()
            pool.release_unused()
    elif kind in ("csv", "tsv"):
        # surrogateescape keeps going past a non-UTF-8 cell; that row's caption is then skipped, counted.
        with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
            reader = csv.DictReader(f, delimiter="\t" if kind == "tsv" else ",")
            try:
                yield from reader
            except csv.Error as e:  # a cell past CSV_FIELD_BYTES: an unclosed quote, most likely
                raise VlprepError(f"{path.name}:{reader.line_num}: {e} ({CSV_FIELD_BYTES >> 20} MiB)") from None
    else:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit int
                    why = e.__class__.__name__ if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else (
                        json_error(e))
                    raise VlprepError(f"{path.name}:{lineno}: malformed JSON ({why})") from None
                if not isinstance(row, dict):
                    raise VlprepError(f"{path.name}:{lineno}: expected one JSON object per line")
                yield row


def table_source(path: Path, kind: str, image_col=None, caption_col=None, uid_col=None) -> Source:
    columns = _table_columns(path, kind)
    img = _pick(columns, image_col, IMAGE_COLUMNS, "image", path, "--image-col")
    cap = _pick(columns, caption_col, CAPTION_COLUMNS, "caption", path, "--caption-col")
    uid = _pick(columns, uid_col, UID_COLUMNS, "uid", path, "--uid-col", required=False)
    total = pq.ParquetFile(path).metadata.num_rows if kind == "parquet" else None
    base = path.parent
    # Image bytes stored in the table stay there: the item refers to its row, and the worker reads it.
    by_ref = kind == "parquet" and _holds_bytes(pq.read_schema(path).field(img).type)

    def items() -> Iterator[Item]:
        cols = [c for c in (cap, uid) if c] if by_ref else [c for c in (img, cap, uid) if c]
        for i, row in enumerate(_table_rows(path, kind, cols)):
            u = row.get(uid) if uid else None
            image = RowRef(str(path), img, i) if by_ref else _cell_image(row.get(img), base)
            yield Item(uid=str(u) if u is not None else str(i), image=image, caption=row.get(cap), source=path.name)

    return Source(kind, path, {"image": img, "caption": cap, "uid": uid}, total, items())


def _holds_bytes(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return any(_holds_bytes(t.field(i).type) for i in range(t.num_fields))
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def load_images(items: list[Item]) -> list[str | bytes | RootedPath | None]:
    """Each item's image as a path or bytes: TarRefs and RowRefs read here, Parquet row groups once per call."""
    out = []
    rows = {}
    for it in items:
        if isinstance(it.image, RowRef):
            rows.setdefault((it.image.path, it.image.column), set()).add(it.image.row)
    cells = {}
    for (path, column), wanted in rows.items():
        cells.update(((path, column, r), v) for r, v in _parquet_cells(path, column, sorted(wanted)))
    for it in items:
        image = it.image
        if isinstance(image, TarRef):
            image = image.read()
        elif isinstance(image, RowRef):
            image = _cell_image(cells[image], Path(image.path).parent)
        out.append(image)
    return out


def _parquet_cells(path: str, column: str, wanted: list[int]):
    """(row, value) of the sorted `wanted` rows of one column: each row group that holds some is read once, found by
    bisecting the groups' first rows (not by testing every row against every group: that grew with the square of
    the file's size), and only the wanted rows of it become Python values (a single-group file of a million rows
    is then read, but not converted whole, for every shard)."""
    pf = pq.ParquetFile(path)
    meta = pf.metadata
    starts = list(itertools.accumulate((meta.row_group(g).num_rows for g in range(meta.num_row_groups)), initial=0))
    by_group = {}
    for r in wanted:
        by_group.setdefault(bisect.bisect_right(starts, r) - 1, []).append(r)
    for g, group_rows in by_group.items():
        values = pf.read_row_group(g, columns=[column]).column(0)
        picked = values.take(pa.array([r - starts[g] for r in group_rows], type=pa.int64())).to_pylist()
        yield from zip(group_rows, picked)


def _suffix(name: str) -> str:
    """pathlib's PurePath.suffix of a file name (a leading dot does not start a suffix)."""
    i = name.rfind(".")
    return name[i:] if 0 < i < len(name) - 1 else ""


def _list_images(root: str) -> list[tuple[tuple[str, ...], str]]:
    """(relative path parts, image file name) of every image under root, in sorted(Path.rglob) order.

    os.scandir rather than Path.rglob("*") + is_file(): DirEntry.is_file() answers from the
    directory listing (no stat per file) and no Path object is built per entry; rglob was a large
    share of a pass-through `vlprep shards` run. Same walk as rglob: symlinked
    folders are not entered, symlinked files are followed, unreadable folders are skipped.
    """
    found = []

    def walk(folder: str, parts: tuple[str, ...]) -> None:
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except PermissionError:
            return
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    walk(e.path, parts + (e.name,))
                    continue
                is_file = e.is_file()
            except OSError:
                continue
            if is_file and _suffix(e.name).lower() in IMAGE_SUFFIXES:
                found.append((parts + (e.name,), e.name))

    walk(root, ())
    found.sort()  # Path order: part by part, so "a/x" sorts before "a-b" as it does for pathlib
    return found


def folder_source(path: Path) -> Source:
    images = _list_images(str(path))
    base = "" if str(path) == "." else str(path).rstrip("/") + "/"  # str(path / rel), without building Paths

    def items() -> Iterator[Item]:
        for parts, name in images:
            rel = "/".join(parts)
            stem = rel[: len(rel) - len(_suffix(name))]
            try:  # a missing caption is counted, not an error; opening it tells us as well as exists() would
                caption = read_regular(base + stem + ".txt", CSV_FIELD_BYTES)  # never a FIFO: it would block
            except OSError:
                caption = None
            yield Item(uid=stem, image=base + rel, caption=caption, source=path.name)

    return Source("folder", path, {}, len(images), items())


def webdataset_source(path: Path) -> Source:
    if path.is_file():
        tars = [path]
        root = path.parent
    else:
        root = path
        sizes_file = path / "sizes.json"
        tars = None
        if sizes_file.exists():
            try:
                tars = [path / name for name in json.loads(sizes_file.read_text())]
            except (ValueError, TypeError, RecursionError):
                tars = None
        if tars is None or not all(t.exists() for t in tars):
            tars = sorted(path.glob("*.tar"))
    total = None
    if (root / "sizes.json").exists():
        try:
            total = sum(json.loads((root / "sizes.json").read_text()).values())
        except Exception:
            total = None

    def items() -> Iterator[Item]:
        for tar in tars:
            for s in iter_tar(tar, refs=WDS_IMAGE_EXTS):
                meta = {}
                if "json" in s:
                    try:
                        meta = json.loads(s["json"])
                    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                        meta = {}
                image = next((s[e] for e in WDS_IMAGE_EXTS if e in s), None)
                yield Item(uid=s["__key__"], image=image, caption=s.get("txt"), source=tar.name,
                           url=meta.get("url") if isinstance(meta, dict) else None)

    return Source("webdataset", path, {}, total, items())


def open_source(src: str | os.PathLike, image_col=None, caption_col=None, uid_col=None, image_root=None,
                splits: list[str] | None = None, follow_symlinks: bool = False) -> Source:
    """Pick the source type from the path: a table file (or a Karpathy split .json), a .tar / folder of .tar shards,
    or an image folder. `image_root`, `splits` and `follow_symlinks` apply to a Karpathy split file only."""
    path = Path(src)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise VlprepError(f"source not found: {path}") from None
    except (OSError, ValueError) as e:
        raise VlprepError(f"cannot read source {path}: {getattr(e, 'strerror', None) or e}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a FIFO would block the first read forever
        raise VlprepError(f"source {path}: {KINDS.get(stat.S_IFMT(mode), 'a special file')}, not a file or folder")
    from vlprep.karpathy import karpathy_source, single_object  # (it imports this module's Item and Source)

    karpathy = image_root is not None or splits is not None or follow_symlinks
    data = single_object(path, karpathy) if path.is_file() and path.suffix.lower() == ".json" else None
    if data is not None:  # one JSON object rather than JSON Lines: a Karpathy split file, or a one-line error
        return karpathy_source(path, data, image_root, splits, follow_symlinks)
    if karpathy:
        given = [f for f, v in (("--image-root", image_root), ("--split", splits),
                                ("--follow-symlinks", follow_symlinks or None)) if v is not None]
        raise VlprepError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only to a Karpathy split "
                          f"file (one JSON object with an 'images' list), not to {path.name}")
    if path.is_file():
        if path.suffix == ".tar":
            return webdataset_source(path)
        kind = TABLE_SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise VlprepError(f"unknown source type {path.suffix!r}: expected a table "
                              f"({', '.join(sorted(TABLE_SUFFIXES))}), a .tar shard, or a folder")
        return table_source(path, kind, image_col, caption_col, uid_col)
    if not os.access(path, os.R_OK | os.X_OK):
        raise VlprepError(f"cannot read folder {path}: permission denied")
    # What path.glob("*.tar") would find first, without its per-name pattern match (1.6 ms on a 2,000-image folder)
    if any(n.endswith(".tar") and not n.startswith(".") for n in os.listdir(path)):
        return webdataset_source(path)
    src_ = folder_source(path)
    if not src_.total:
        raise VlprepError(f"{path}: no .tar shards and no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    return src_

"""Image-caption sources for `vlprep shards`: tables, image folders, existing WebDatasets, and Karpathy split files.

Each source is a generator of `Item`s in a fixed order; the item's position in that order is its
sample index, so keys depend only on the source, never on timing or the number of workers.
An item names its image (a file path, a TarRef into a tar, a RowRef into a Parquet file) rather than
holding its bytes, so that only paths travel to the workers (docs/SCALE.md); `load_images` reads them
where the shard is written.
"""

import csv
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError, cut
from vlprep.dataset import TarRef, iter_tar
from vlprep.userfile import KINDS, FileTooLarge, NotARegularFile, open_regular, read_regular

TABLE_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv",
                  ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
# Common names, most specific first; the first one present in the table wins.
IMAGE_COLUMNS = ("image", "image_path", "img", "img_path", "filepath", "file_name", "filename", "file",
                 "path", "jpg", "png")
CAPTION_COLUMNS = ("caption", "text", "txt", "caption_text", "sentence", "title", "alt", "description")
UID_COLUMNS = ("uid", "key", "id", "image_id")
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
KARPATHY_SPLITS = ("train", "restval", "val", "test")  # the values of `split` in dataset_coco.json / _flickr30k.json


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
        for batch in pf.iter_batches(batch_size=1024, columns=cols):
            yield from batch.to_pylist()
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
    out, rows = [], {}
    for it in items:
        if isinstance(it.image, RowRef):
            rows.setdefault((it.image.path, it.image.column), set()).add(it.image.row)
    cells = {}
    for (path, column), wanted in rows.items():
        pf = pq.ParquetFile(path)
        start = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if any(start <= r < start + n for r in wanted):
                values = pf.read_row_group(g, columns=[column]).column(0).to_pylist()
                cells.update(((path, column, start + j), v) for j, v in enumerate(values) if start + j in wanted)
            start += n
    for it in items:
        image = it.image
        if isinstance(image, TarRef):
            image = image.read()
        elif isinstance(image, RowRef):
            image = _cell_image(cells[image], Path(image.path).parent)
        out.append(image)
    return out


def _suffix(name: str) -> str:
    """pathlib's PurePath.suffix of a file name (a leading dot does not start a suffix)."""
    i = name.rfind(".")
    return name[i:] if 0 < i < len(name) - 1 else ""


def _list_images(root: str) -> list[tuple[tuple[str, ...], str]]:
    """(relative path parts, image file name) of every image under root, in sorted(Path.rglob) order.

    os.scandir rather than Path.rglob("*") + is_file(): DirEntry.is_file() answers from the
    directory listing (no stat per file) and no Path object is built per entry; rglob was ~18% of
    a pass-through `vlprep shards` run (benchmarks/shards.py). Same walk as rglob: symlinked
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
        tars, root = [path], path.parent
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


def parse_splits(values: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """--split values (repeated and/or comma-separated) -> the chosen splits in KARPATHY_SPLITS order, or None (all).

    One canonical list, so that `--split test,val` and `--split val --split test` record the same options.
    """
    if values is None:
        return None
    if isinstance(values, str):  # a library caller's split="test,val"
        values = [values]
    names = [v.strip() for value in values for v in str(value).split(",")]
    bad = [n for n in names if n not in KARPATHY_SPLITS]
    if bad or not names:
        raise VlprepError(f"unknown --split {bad[0] if bad else ''!r}; splits are: {', '.join(KARPATHY_SPLITS)}")
    return [s for s in KARPATHY_SPLITS if s in names]


NOT_KARPATHY = ("a JSON object without an 'images' list of entries with 'sentences': not a Karpathy split file; "
                "a table must be JSON Lines (one object per line)")
# dataset_coco.json is about 150 MB; json.load holds several times a file's size in objects, so a cap bounds that.
KARPATHY_BYTES = 1 << 30
BOM = b"\xef\xbb\xbf"  # legal at the start of UTF-8 text; json.loads of bytes skips it, a startswith check does not


def json_error(e: Exception) -> str:
    """A JSON parse failure in words: the decoder's message, not UTF-8, or nesting past Python's recursion limit."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start:,})"
    return str(e).splitlines()[0].split("; use sys.")[0]  # (a 5,000-digit integer's advice is for programmers)


def _single_object(path: Path, karpathy: bool = False) -> dict | None:
    """The object a `.json` file holds when it is one JSON object rather than JSON Lines, else None.

    Cheap for JSON Lines: only the first line is parsed (and the next one looked at). A file whose one object spans
    several lines (pretty-printed) is parsed whole. A one-line file of one object is JSON Lines of one record, as it
    always was, unless that object has an 'images' key (a Karpathy file is one line; so is COCO's own annotation
    file, which is refused by the caller). None also for anything malformed: the JSON Lines reader names the line;
    but with `karpathy` (--split or --image-root given) an object that does not parse is that one-line error.
    """
    try:
        with open_regular(path) as f:  # no cap here: a JSON Lines table may be any size; an object is capped below
            first = b""
            while not first.strip():
                first = f.readline(KARPATHY_BYTES + 1)
                if not first or len(first) > KARPATHY_BYTES:
                    break
            if not first.removeprefix(BOM).lstrip().startswith(b"{"):
                return None
            try:
                if len(first) > KARPATHY_BYTES:
                    raise _TooLarge()
                obj = json.loads(first)
            except (ValueError, RecursionError):  # several lines, or a bad first line (JSONDecodeError, UnicodeError)
                size = os.fstat(f.fileno()).st_size
                if size > KARPATHY_BYTES:
                    if karpathy:
                        raise VlprepError(f"{path.name}: {size:,} bytes; a Karpathy split file is read whole, and at "
                                          f"most {KARPATHY_BYTES:,}") from None
                    return None
                f.seek(0)
                try:
                    obj = json.loads(f.read())
                except (ValueError, RecursionError) as e:
                    if karpathy:
                        raise VlprepError(f"{path.name}: malformed JSON: {json_error(e)}") from None
                    return None
                return obj if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or "images" not in obj or any(line.strip() for line in f):
                return None
            return obj
    except (NotARegularFile, FileTooLarge) as e:
        raise VlprepError(f"{path.name}: {e.strerror}") from None
    except OSError as e:
        raise VlprepError(f"cannot read {path}: {e.strerror or e}") from None


class _TooLarge(ValueError):
    """A first line past KARPATHY_BYTES: handled as a line that does not parse alone."""


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    names = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _check_entry(name: str, i: int, e) -> None:
    """One line naming the entry and its field when an entry's structure is not a Karpathy entry's (docs/FORMAT.md):
    filepath, filename and split are strings without NUL, cocoid and imgid integers; each may be absent or null."""
    where = f"{name}: images[{i}]"
    if not isinstance(e, dict):
        raise VlprepError(f"{where}: expected an object, not {_json_type(e)}")
    for key in ("filepath", "filename", "split", "cocoid", "imgid"):
        v = e.get(key)
        if v is None:
            continue
        want = "an integer" if key in ("cocoid", "imgid") else "a string"
        if want == "an integer" and (type(v) is not int) or want == "a string" and not isinstance(v, str):
            raise VlprepError(f"{where}.{key}: expected {want}, not {_json_type(v)} {cut(repr(v), 40)}")
        if isinstance(v, str) and "\0" in v:
            raise VlprepError(f"{where}.{key}: holds a NUL character")
        if isinstance(v, str) and not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:  # a JSON "\ud800" escape: no file can have that name
                raise VlprepError(f"{where}.{key}: holds a lone surrogate, not text") from None


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def karpathy_source(path: Path, data: dict, image_root: str | os.PathLike | None = None,
                    splits: list[str] | None = None, follow_symlinks: bool = False) -> Source:
    """A Karpathy split file (dataset_coco.json, dataset_flickr30k.json): one multi-caption item per image entry.

    The image is image_root / filepath / filename (filepath only when present: COCO has it, Flickr30k does not);
    image_root defaults to the file's folder, and an image outside it (an absolute name, `..`, a symlink leaving it
    unless follow_symlinks) is a counted skip. The captions are the entry's sentences' `raw` texts, in file order.
    uid is the cocoid, else the imgid, else the file name. `splits` keeps the entries of those splits (file order
    kept); None keeps all. An entry whose fields have the wrong JSON types is a one-line error before anything is
    read; a missing image or caption is an item that `vlprep shards` skips and counts.
    """
    images = data.get("images")
    if not isinstance(images, list) or not any(isinstance(e, dict) and "sentences" in e for e in images):
        raise VlprepError(f"{path.name}: {NOT_KARPATHY}")
    for i, e in enumerate(images):
        _check_entry(path.name, i, e)
    root = Path(image_root) if image_root is not None else path.parent
    if image_root is not None and not root.is_dir():
        raise VlprepError(f"--image-root {root}: not a folder")
    chosen = None if splits is None else set(splits)
    entries = [e for e in images if chosen is None or e.get("split") in chosen]

    def items() -> Iterator[Item]:
        for i, e in enumerate(entries):
            name, folder = e.get("filename"), e.get("filepath")
            image = None if not name else RootedPath(str(root), (folder, name) if folder else (name,), follow_symlinks)
            sentences = e.get("sentences")
            captions = [_text(s.get("raw")) if isinstance(s, dict) else None
                        for s in (sentences if isinstance(sentences, list) else [])]
            meta = {k: e[k] for k in ("cocoid", "imgid", "split") if e.get(k) is not None}
            uid = next((str(e[k]) for k in ("cocoid", "imgid") if e.get(k) is not None), name or str(i))
            yield Item(uid=uid, image=image, caption=captions[0] if captions else None, source=path.name,
                       captions=captions, meta=meta)

    return Source("karpathy", path, {}, len(entries), items(), multi_caption=True)


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
    karpathy = image_root is not None or splits is not None or follow_symlinks
    data = _single_object(path, karpathy) if path.is_file() and path.suffix.lower() == ".json" else None
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

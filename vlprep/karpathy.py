"""Karpathy split files (dataset_coco.json, dataset_flickr30k.json) as a `vlprep shards` source (docs/FORMAT.md,
"Karpathy split input"): one multi-caption item per image entry, its image read only from under the image root."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

from vlprep import VlprepError, cut
from vlprep.items import Item, RootedPath, Source, json_error
from vlprep.userfile import FileTooLarge, NotARegularFile, open_regular

KARPATHY_SPLITS = ("train", "restval", "val", "test")  # the values of `split` in dataset_coco.json / _flickr30k.json


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


def single_object(path: Path, karpathy: bool = False) -> dict | None:
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
            name = e.get("filename")
            folder = e.get("filepath")
            image = None if not name else RootedPath(str(root), (folder, name) if folder else (name,), follow_symlinks)
            sentences = e.get("sentences")
            captions = [_text(s.get("raw")) if isinstance(s, dict) else None
                        for s in (sentences if isinstance(sentences, list) else [])]
            meta = {k: e[k] for k in ("cocoid", "imgid", "split") if e.get(k) is not None}
            uid = next((str(e[k]) for k in ("cocoid", "imgid") if e.get(k) is not None), name or str(i))
            yield Item(uid=uid, image=image, caption=captions[0] if captions else None, source=path.name,
                       captions=captions, meta=meta)

    return Source("karpathy", path, {}, len(entries), items(), multi_caption=True)

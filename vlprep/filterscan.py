"""`vlprep filter`'s scan pass: each sample's cheap attributes, one table per input shard under OUT/_scan/.

docs/FILTER.md is the contract. A worker reads one input shard and writes OUT/_scan/SHARD.parquet: per sample its
key, the image's width and height from its header (PIL opens lazily: no decode), why it is a bad sample (no image,
a header that does not open, pixels that do not decode), its caption's word count, and for each hash the scan was
asked for a 64-bit hash (what the driver holds per sample) beside the full 256-bit one (what settles a collision),
and with --phash the image's 64-bit perceptual hash (`phash_h64`, nothing beside it: near is not equal).
A table is complete when its parquet is there and holds the shard's fingerprint, so a stopped scan resumes.
"""

import hashlib
import io
import json
import os
import string
import unicodedata
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vlprep import VlprepError
from vlprep.dataset import as_rgb, image_ext, iter_aligned, sidecar_name
from vlprep.engine import Work
from vlprep.output import Out, publish, pull
from vlprep.text import words

SCAN_DIR = "_scan"
HASHES = ("image", "caption", "pair")  # what `--dedup` compares
SCAN_KINDS = HASHES + ("phash",)  # what a scan may be asked for, in its columns' order
_ASCII_PUNCT = frozenset(string.punctuation)  # symbols such as + = $ too: "a+b" is "a b"


def normalise_caption(text: str) -> str:
    """The caption `--dedup caption` compares: NFKC, casefolded, punctuation (Unicode P* and ASCII's
    string.punctuation) replaced by spaces, whitespace collapsed."""
    s = unicodedata.normalize("NFKC", text).casefold()
    s = "".join(" " if c in _ASCII_PUNCT or unicodedata.category(c)[0] == "P" else c for c in s)
    return " ".join(s.split())


def full_hash(data: bytes) -> bytes:
    """The 256-bit blake2b that decides whether two samples are equal."""
    return hashlib.blake2b(data, digest_size=32).digest()


def short_hash(full: bytes) -> int:
    """The 64-bit hash the driver holds per sample: the full hash's first 8 bytes, little-endian."""
    return int.from_bytes(full[:8], "little")


def rgb_hash(rgb: Image.Image) -> bytes:
    """full_hash of 'WxH:' and the decoded RGB pixels (transparency on white, as every stage decodes)."""
    return full_hash(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes())


def perceptual_hash(rgb: Image.Image) -> int:
    """imagehash.phash of the decoded RGB image as a 64-bit integer: its 8x8 bits row by row, the first the highest."""
    import imagehash  # imported here: it brings scipy, which only --phash needs

    bits = imagehash.phash(rgb).hash.reshape(-1)
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def caption_hash(text: str) -> bytes:
    return full_hash(normalise_caption(text).encode())


def pair_hash(image_full: bytes, caption_full: bytes) -> bytes:
    return full_hash(image_full + caption_full)


def image_attributes(data: bytes | None, pixels: bool) -> tuple[int, int, str | None, bytes | None]:
    """(width, height, why it is bad or None, the pixel hash when `pixels`) of one image member."""
    width, height, why, rgb = decode_image(data, pixels)
    return width, height, why, None if rgb is None else rgb_hash(rgb)


def decode_image(data: bytes | None, pixels: bool) -> tuple[int, int, str | None, Image.Image | None]:
    """(width, height, why it is bad or None, the decoded RGB image when `pixels`) of one image member."""
    if data is None:
        return -1, -1, "no_image", None
    with warnings.catch_warnings():
        # as vlprep.shards: Pillow warns above 89M pixels (printed raw, with its source line) and refuses above
        # 179M; the refusal is a counted bad sample below, the warning says nothing more
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))  # reads the header only
            width, height = im.size
        except Exception:  # any failure to open is a counted bad sample, never fatal
            return -1, -1, "undecodable", None
        if not pixels:
            return width, height, None, None
        try:
            im.load()
            return width, height, None, as_rgb(im)
        except Exception:
            return width, height, "undecodable", None


def scan_path(out: Out, shard: str) -> Path:
    return out.root / SCAN_DIR / sidecar_name(shard)


def scan_schema(hashes: tuple[str, ...]) -> pa.Schema:
    fields = [("key", pa.string()), ("width", pa.int32()), ("height", pa.int32()), ("bad", pa.string()),
              ("words", pa.int32())]
    for name in hashes:
        fields += [(f"{name}_h64", pa.uint64())] + ([] if name == "phash" else [(f"{name}_full", pa.binary(32))])
    return pa.schema(fields)


def scan_shard(out: Out, src: Path, shard: str, hashes: tuple[str, ...], fp: str) -> dict:
    """One input shard's attributes -> OUT/_scan/SHARD.parquet (its fingerprint in the schema metadata)."""
    side = pq.ParquetFile(src / sidecar_name(shard)).read(columns=["key", "caption"])
    keys = side.column("key").to_pylist()
    captions = side.column("caption").to_pylist()
    pixels = "image" in hashes or "pair" in hashes or "phash" in hashes
    cols: dict[str, list] = {f.name: [] for f in scan_schema(hashes)}
    bad = Counter()
    for i, raw in iter_aligned(src / shard, keys):
        ext = image_ext(raw)
        width, height, why, rgb = decode_image(raw[ext] if ext else None, pixels)
        image_full = None if rgb is None else rgb_hash(rgb)
        if why is not None:
            bad[why] += 1
        caption = captions[i] or ""
        caption_full = caption_hash(caption)
        cols["key"].append(keys[i])
        cols["width"].append(width)
        cols["height"].append(height)
        cols["bad"].append(why)
        cols["words"].append(len(words(caption)))
        found = {"image": image_full, "caption": caption_full,
                 "pair": pair_hash(image_full, caption_full) if image_full else None}
        if "phash" in hashes:  # a bad sample's placeholder 0: the driver drops it before the rule runs
            cols["phash_h64"].append(0 if rgb is None else perceptual_hash(rgb))
        for name in (h for h in hashes if h != "phash"):
            full = found[name] or bytes(32)  # a bad sample's placeholder: the driver drops it before any dedup
            cols[f"{name}_h64"].append(short_hash(full))
            cols[f"{name}_full"].append(full)
    stats = {"in": len(keys), "bad": dict(sorted(bad.items()))}
    table = pa.table(cols, schema=scan_schema(hashes))
    table = table.replace_schema_metadata({b"fingerprint": fp.encode(), b"stats": json.dumps(stats, allow_nan=False).encode()})
    path = scan_path(out, shard)
    path.parent.mkdir(exist_ok=True)  # a worker on another machine than the driver's: its staging folder has none
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    name = f"{SCAN_DIR}/{path.name}"
    publish(out, [name], keep=[name])  # a URL OUT keeps its scan beside the shards, so a re-run resumes
    return stats


def scan_done(out: Out, work: Work) -> dict | None:
    """The stored counts of a complete scan table built from the same fingerprint, else None."""
    path = scan_path(out, work.shard)
    if not pull(out, f"{SCAN_DIR}/{path.name}"):
        return None
    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception:
        return None  # unreadable: scan the shard again
    if meta.get(b"fingerprint") != work.fingerprint.encode():
        return None
    return json.loads(meta[b"stats"])


def read_scan(out: Out, shard: str, columns: list[str]) -> pa.Table:
    """Some columns of a shard's scan table (made on another machine for a URL OUT: fetched first)."""
    pull(out, f"{SCAN_DIR}/{sidecar_name(shard)}")
    return pq.ParquetFile(scan_path(out, shard)).read(columns=columns)


def h64_column(table: pa.Table, name: str) -> np.ndarray:
    """A scan table's 64-bit hash column as a uint64 array."""
    return table.column(f"{name}_h64").to_numpy().astype(np.uint64, copy=False)


def check_sidecars(ds) -> None:
    """A one-line error unless every shard has its sidecar, with the columns the scan reads (a WebDataset from another
    tool has sizes.json and tars, but no sidecars)."""
    for shard in ds.shards:
        side = ds.sidecar(shard)
        if not side.exists():
            raise VlprepError(f"SRC {ds.location}: missing sidecar {side.name} (every vlprep stage writes one; "
                              "re-shard it with `vlprep shards`)")
        try:
            names = pq.read_schema(side).names
        except Exception:  # any Arrow failure: not a Parquet file
            raise VlprepError(f"SRC {ds.location}: sidecar {side.name} is not a readable Parquet file") from None
        lacking = [c for c in ("key", "caption") if c not in names]
        if lacking:
            raise VlprepError(f"SRC {ds.location}: sidecar {side.name} has no {lacking[0]!r} column (every vlprep "
                              "stage writes one; re-shard it with `vlprep shards`)")


def check_unique_keys(ds) -> None:
    """A one-line error naming a key that two of the dataset's samples share, and the shards that hold them (keys are
    unique: a repeated one would get another sample's vector, and --keys would keep both). Reads the sidecars' key
    columns; holds 8 bytes a sample while it runs (a 64-bit hash of each key), and reads the keys of colliding hashes
    back from the sidecars to compare them in full."""
    from vlprep.shards import uid_hashes

    hashes = [uid_hashes(ds.column(s, "key")) for s in ds.shards]
    every = np.sort(np.concatenate(hashes)) if hashes else np.zeros(0, np.uint64)
    suspect = np.unique(every[1:][every[1:] == every[:-1]])
    del every
    if not suspect.size:
        return
    first: dict[str, str] = {}
    for shard, h in zip(ds.shards, hashes):
        rows = np.flatnonzero(np.isin(h, suspect))
        if not rows.size:
            continue
        keys = ds.column(shard, "key")
        for r in rows.tolist():
            if keys[r] in first:
                where = f"twice in shard {shard}" if first[keys[r]] == shard else \
                    f"in shards {first[keys[r]]} and {shard}"
                raise VlprepError(f"SRC {ds.location}: key {keys[r]!r} is {where}; a dataset's keys are "
                                  "unique (re-shard it with `vlprep shards`, which numbers them)")
            first[keys[r]] = shard


def input_signature(ds) -> tuple[dict[str, str], str]:
    """Per input shard its fingerprint (its sidecar's bytes and its tar's size), and the whole input's."""
    fps = {s: ds.fingerprint(s, f"filter:{ds.tar_size(s)}:".encode()) for s in ds.shards}
    whole = hashlib.blake2b("".join(f"{s}={fp};" for s, fp in fps.items()).encode(), digest_size=16).hexdigest()
    return fps, whole

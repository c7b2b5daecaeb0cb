"""`vlprep shards`: any image-caption source -> a WebDataset shard dataset (docs/FORMAT.md).

Plan: source item i goes to shard i // samples_per_shard and gets key `{prefix}_{i:09d}`, whether
or not earlier items were skipped. Each shard is therefore a pure function of its slice of the
source: shards are built independently (vlprep.engine: --workers on a process pool or Ray), a re-run skips the shards that
are complete and whose records are unchanged (see `fingerprint`), and the result is byte-identical
to an uninterrupted run. A shard holds at most
samples_per_shard samples (fewer when some are skipped), as with img2dataset.

A multi-caption source (a Karpathy split file) gives one sample per image with all its captions: `txt` is the first,
json.captions all of them in file order, and the sidecar gains a `captions` column (docs/FORMAT.md, "Multi-caption
samples").

Images pass through untouched unless --resize or --format asks for a re-encode. Pass-through checks
the header and the end-of-image marker (JPEG EOI, PNG IEND, WebP RIFF length) without decoding, which
catches truncated files at copy speed; --decode-check decodes every image as well, and checks the CRC of
every PNG chunk, IDAT included (vlprep/imagecheck.py).
"""

import hashlib
import io
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps, UnidentifiedImageError

from vlprep import VlprepError, urls
from vlprep.dataset import KEY_RE, local_or_url, sidecar_name
from vlprep.engine import Work, check_engine, default_workers, map_shards, merged_skips
from vlprep.imagecheck import looks_complete, png_chunks_ok, probe  # noqa: F401 (png_chunks_ok: API)
from vlprep.karpathy import parse_splits
from vlprep.output import (Out, check_out, finish_dataset, remove_extra_shards, shard_name, write_json_atomic,
                           write_shard, writing_output)
from vlprep.sources import Item, RootedPath, load_images, open_source
from vlprep.userfile import FileTooLarge, OutsideRoot, read_regular, under_root

FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
PIL_TO_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "MPO": "jpg"}
SIDECAR_SCHEMA = pa.schema([("key", pa.string()), ("uid", pa.string()), ("caption", pa.string()),
                            ("source", pa.string()), ("image_ext", pa.string()), ("width", pa.int32()),
                            ("height", pa.int32()), ("image_bytes", pa.int64())])
# A multi-caption source's sidecars have one more column: every caption of the sample (`caption` is the first).
MULTI_SIDECAR_SCHEMA = SIDECAR_SCHEMA.append(pa.field("captions", pa.list_(pa.string())))
MAX_EXAMPLES = 5  # skipped uids kept per reason and shard, to point the user at bad records


@dataclass
class ShardsConfig:
    src: Path
    out: Path
    samples_per_shard: int = 1000
    resize: int | None = None         # shorter side -> N (never upscales); None passes bytes through
    format: str | None = None         # re-encode format; None keeps the source format when possible
    quality: int = 95
    workers: int = field(default_factory=default_workers)
    distributor: str = "local"        # local | ray (docs/SCALE.md)
    prefix: str = "shard"
    image_col: str | None = None
    caption_col: str | None = None
    uid_col: str | None = None
    image_root: Path | None = None    # Karpathy split file: the folder its filepath/filename are relative to
    split: list[str] | None = None    # Karpathy split file: the splits kept (None: all); normalised by validate()
    follow_symlinks: bool = False     # Karpathy split file: read images through symlinks that leave the image root
    decode_check: bool = False
    overwrite: bool = False

    def validate(self) -> None:
        if self.samples_per_shard < 1:
            raise VlprepError("--samples-per-shard must be at least 1")
        if self.resize is not None and self.resize < 1:
            raise VlprepError("--resize must be a positive number of pixels")
        if self.format is not None and self.format not in FORMATS:
            raise VlprepError(f"--format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if not 1 <= self.quality <= 100:
            raise VlprepError("--quality must be between 1 and 100")
        check_engine(self.distributor, self.workers)
        if not KEY_RE.match(self.prefix):
            raise VlprepError(f"--prefix may hold only letters, digits, '_' and '-', not {self.prefix!r}")
        self.split = parse_splits(self.split)


class Skip(Exception):
    """A bad sample: counted under `reason`, never fatal."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --- per-sample work ---------------------------------------------------------------------------


def clean_caption(caption: str | bytes | None) -> str:
    """One-line UTF-8 caption with runs of whitespace collapsed, or Skip."""
    if isinstance(caption, bytes):  # (strict UTF-8 decoding leaves no lone surrogate to check for)
        try:
            caption = caption.decode("utf-8")
        except UnicodeDecodeError:
            raise Skip("caption_not_utf8") from None
    elif caption is None:
        raise Skip("missing_caption")
    else:
        try:
            caption.encode("utf-8")  # lone surrogates: a CSV cell that was not UTF-8 (read with surrogateescape)
        except UnicodeEncodeError:
            raise Skip("caption_not_utf8") from None
    caption = " ".join(caption.split())  # = re.sub(r"\s+", " ", c).strip(): the same whitespace set
    if not caption:
        raise Skip("empty_caption")
    return caption


def clean_captions(captions: list) -> list[str]:
    """A multi-caption record's captions, each cleaned as `clean_caption`, in order; an unusable one is left out.

    Skip (the first caption's reason, e.g. empty_caption) when none is left, `missing_caption` for an empty list.
    """
    kept = []
    reason = "missing_caption"
    for i, caption in enumerate(captions):
        try:
            kept.append(clean_caption(caption))
        except Skip as s:
            if i == 0:
                reason = s.reason
    if not kept:
        raise Skip(reason)
    return kept


# An image file is read whole into memory: past this it is the counted skip image_too_large, as a decoded image past
# Pillow's pixel limit is. 256 MiB holds an uncompressed RGB bitmap of Pillow's 89M-pixel warning size.
MAX_IMAGE_BYTES = 256 << 20


def read_image(image: str | bytes | RootedPath | None) -> bytes:
    """An image's bytes, or Skip: only a regular file (a FIFO or a device is never read) of at most MAX_IMAGE_BYTES,
    and a Karpathy entry's only from under its image root."""
    if image is None:
        raise Skip("missing_image")
    if isinstance(image, bytes):
        return image
    follow = True
    try:
        if isinstance(image, RootedPath):
            follow = image.follow_symlinks
            image = under_root(image.root, image.parts, follow)
        return read_regular(image, MAX_IMAGE_BYTES, follow_symlinks=follow)
    except OutsideRoot:
        raise Skip("image_outside_root") from None
    except FileTooLarge:
        raise Skip("image_too_large") from None
    except FileNotFoundError:
        raise Skip("missing_image") from None
    except (OSError, ValueError):  # not a regular file, permission denied, an I/O error; a NUL in a table's path
        raise Skip("unreadable_image") from None


def to_mode(im: Image.Image, fmt: str) -> Image.Image:
    """Modes each format can store; transparency is composited on white for JPEG."""
    if fmt == "JPEG":
        if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(bg, rgba).convert("RGB")
        return im if im.mode in ("RGB", "L") else im.convert("RGB")
    if fmt == "PNG":
        return im if im.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16") else im.convert("RGBA")
    return im if im.mode in ("RGB", "RGBA") else im.convert("RGBA" if "A" in im.mode else "RGB")


def _decode_failure(e: Exception) -> str:
    return "truncated_image" if "truncated" in str(e) else "corrupt_image"


def prepare_image(data: bytes, resize: int | None = None, fmt: str | None = None, quality: int = 95,
                  decode_check: bool = False) -> tuple[bytes, str, int, int]:
    """Check (and optionally resize / re-encode) one image -> (bytes, ext, width, height), or Skip."""
    head = None if decode_check else probe(data)
    if head is not None:  # a plain PNG or JPEG, complete: what Pillow would say, without Pillow (imagecheck.py)
        src_ext = PIL_TO_EXT[head[0]]
        w = head[1]
        h = head[2]
        if (resize is None or min(w, h) <= resize) and (fmt or src_ext) == src_ext:
            return data, src_ext, w, h
    try:
        with warnings.catch_warnings():
            # Pillow warns above 89M pixels and refuses above 179M (decompression bombs); the refusal
            # is counted as image_too_large, the warning would only clutter the progress bar.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
        src_fmt, (w, h) = im.format, im.size
    except Image.DecompressionBombError:
        raise Skip("image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise Skip("corrupt_image") from None
    src_ext = PIL_TO_EXT.get(src_fmt)
    out_ext = fmt or src_ext or "png"
    small = resize is None or min(w, h) <= resize
    if small and src_ext == out_ext:  # pass-through: same format, nothing to shrink
        if not looks_complete(data, src_fmt, idat_crc=decode_check):  # --decode-check: every PNG CRC too
            raise Skip("truncated_image")
        if decode_check:
            try:
                im.load()
            except (OSError, ValueError, SyntaxError) as e:
                raise Skip(_decode_failure(e)) from None
        return data, src_ext, w, h
    try:
        if not small and src_fmt == "JPEG":
            im.draft("RGB", (max(1, w * resize // min(w, h)), max(1, h * resize // min(w, h))))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im.load()
        im = ImageOps.exif_transpose(im)
    except (OSError, ValueError, SyntaxError) as e:
        raise Skip(_decode_failure(e)) from None
    w, h = im.size
    if not small and min(w, h) > resize:
        s = resize / min(w, h)
        im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC, reducing_gap=3.0)
    pil_fmt = FORMATS[out_ext]
    im = to_mode(im, pil_fmt)
    buf = io.BytesIO()
    kwargs = {"quality": quality} if pil_fmt in ("JPEG", "WEBP") else {}
    im.save(buf, format=pil_fmt, **kwargs)
    return buf.getvalue(), out_ext, im.size[0], im.size[1]


# --- per-shard work (runs in a worker process) ---------------------------------------------------


def build_shard(out: Out, first_index: int, items: list[Item], cfg: dict, fp: str = "") -> dict:
    """Write one planned shard; returns its stats {in, written, skipped, examples, fingerprint}."""
    skipped = Counter()
    examples = {}
    samples = []
    multi = cfg.get("multi_caption", False)  # every shard of a multi-caption source has the captions column
    schema = MULTI_SIDECAR_SCHEMA if multi else SIDECAR_SCHEMA
    rows = []  # the sidecar: a tuple per row (transposed into columns below), and the captions column
    all_lists = []
    shard = shard_name(cfg["prefix"], first_index // cfg["samples_per_shard"])
    prefix = cfg["prefix"]
    opts = (cfg["resize"], cfg["format"], cfg["quality"], cfg["decode_check"])
    for i, (item, image) in enumerate(zip(items, load_images(items))):
        key = f"{prefix}_{first_index + i:09d}"
        try:
            if item.captions is None:
                caption = clean_caption(item.caption)
            else:
                all_captions = clean_captions(item.captions)
                caption = all_captions[0]
            data, ext, w, h = prepare_image(read_image(image), *opts)
        except Skip as s:
            skipped[s.reason] += 1
            ex = examples.setdefault(s.reason, [])
            if len(ex) < MAX_EXAMPLES:
                ex.append(item.uid)
            continue
        uid = item.uid
        source = item.source
        meta = {"uid": uid, "source": source, "width": w, "height": h}
        if item.meta:  # (json members are written with sorted keys: the order here does not show)
            meta = {**item.meta, **meta}
        if item.url:
            meta["url"] = item.url
        if item.captions is not None:
            meta["captions"] = all_captions
        if multi:
            all_lists.append(all_captions if item.captions is not None else [caption])
        samples.append({"__key__": key, ext: data, "txt": caption, "json": meta})
        rows.append((key, uid, caption, source, ext, w, h, len(data)))
    columns = dict(zip(SIDECAR_SCHEMA.names, map(list, zip(*rows)))) if rows else {n: [] for n in SIDECAR_SCHEMA.names}
    if multi:
        columns["captions"] = all_lists
    stats = {"in": len(items), "written": len(samples), "skipped": dict(skipped), "examples": examples,
             "fingerprint": fp}
    write_shard(out, shard, samples, pa.Table.from_pydict(columns, schema=schema), stats=stats)
    # The written uids travel back with the counts for the duplicate-uid scan, but are not stored with them (a
    # resumed shard's are read from its sidecar): that scan then reads no sidecar back.
    return {**stats, "uids": columns["uid"]}


# --- the stage ---------------------------------------------------------------------------------


def fingerprint(items: list[Item]) -> str:
    """What a shard was built from: ids, captions, and image bytes (hashed) or where they are + size + mtime.

    A resumed run reuses a finished shard only when this matches, so an edited source is rebuilt. A multi-caption
    item adds all its captions and its extra json fields; other items hash exactly as they always have.
    """
    parts = []  # hashed in one update: the same digest as one update per part, with less call overhead
    for it in items:
        record = (it.uid, it.caption, it.source, it.url)
        if it.captions is not None or it.meta:
            record += (it.captions, sorted((it.meta or {}).items()))
        parts.append(repr(record).encode("utf-8", "surrogatepass"))
        image = it.image
        if isinstance(image, bytes):
            parts.append(hashlib.blake2b(image, digest_size=16).digest())
        elif image is not None:
            path = image if type(image) is str else image.path
            try:
                st = os.stat(path)
                parts.append(f"{image}|{st.st_size}|{st.st_mtime_ns}".encode("utf-8", "surrogatepass"))
            except (OSError, ValueError):  # ValueError: a NUL or a lone surrogate in a name (read_image skips it)
                parts.append(f"{image}|missing".encode("utf-8", "surrogatepass"))
    return hashlib.blake2b(b"".join(parts), digest_size=16).hexdigest()


def build_shards(cfg: ShardsConfig, progress=None) -> dict:
    """Run the stage (plan source chunks -> map_shards -> summarise); returns the report (also OUT/report.json)."""
    cfg.validate()
    t0 = time.perf_counter()
    out = check_out(cfg.out, cfg.src)
    source = open_source(cfg.src, cfg.image_col, cfg.caption_col, cfg.uid_col, cfg.image_root, cfg.split,
                         cfg.follow_symlinks)
    # After open_source, which says first when --image-root does not apply. OUT may lie inside the image root
    # (`coco/shards` beside `coco/images`): the stage reads only the files the split names, never lists the root.
    if cfg.image_root is not None and urls.overlap(local_or_url(cfg.out), cfg.image_root) != "inside":
        check_out(cfg.out, cfg.image_root)
    options = {k: v for k, v in asdict(cfg).items() if k not in ("src", "out", "workers", "distributor", "overwrite")}
    options["src"] = str(Path(cfg.src).resolve())
    # Karpathy options are recorded only when given, so every other source's options stay what they were.
    for name in ("image_root", "split", "follow_symlinks"):
        if options[name] in (None, False):
            del options[name]
    if cfg.image_root is not None:
        options["image_root"] = str(Path(cfg.image_root).resolve())
    with writing_output(out, "shards", options, cfg.overwrite) as out:
        job = {k: options[k] for k in ("prefix", "samples_per_shard", "resize", "format", "quality", "decode_check")}
        if source.multi_caption:
            job["multi_caption"] = True

        planned: list[str] = []

        def plan() -> Iterator[Work]:  # streamed: the source is read one shard ahead of the workers
            n = cfg.samples_per_shard
            for idx, chunk in enumerate(_chunks(source.items, n)):
                planned.append(shard_name(cfg.prefix, idx))
                yield Work(planned[-1], (idx * n, chunk, job), fingerprint(chunk), len(chunk))

        scan = UidScan(out)
        stats, resumed = map_shards(out, plan(), build_shard, workers=cfg.workers, distributor=cfg.distributor,
                                    progress=progress, label="shards", total=source.total, fold=scan.add)
        remove_extra_shards(out, cfg.prefix, set(planned))
        sizes = {s: stats[s]["written"] for s in planned}
        skipped, examples = merged_skips((stats[s] for s in planned), "examples", MAX_EXAMPLES)
        n_in = sum(stats[s]["in"] for s in planned)
        written = sum(sizes.values())
        if n_in == 0:
            raise VlprepError(f"{cfg.src}: the source has no records")
        finish_dataset(out, sizes, {
            "stage": "shards", "input": str(cfg.src), "source_kind": source.kind, "columns": source.columns,
            "options": options, "counts": {"in": n_in, "written": written, "skipped": dict(sorted(skipped.items()))},
        })
        dups = scan.result()
        elapsed = time.perf_counter() - t0
        report = {
            "stage": "shards", "source": str(cfg.src), "source_kind": source.kind, "columns": source.columns,
            "samples_in": n_in, "written": written, "skipped_total": sum(skipped.values()),
            "skipped": dict(sorted(skipped.items())), "skipped_examples": dict(sorted(examples.items())),
            "duplicate_uids": dups["rows"], "duplicate_uid_examples": dups["examples"],
            "shards": len(planned), "shards_resumed": len(resumed), "elapsed_s": round(elapsed, 3),
            "samples_per_s": round(n_in / elapsed, 1) if elapsed > 0 else None,
        }
        write_json_atomic(out.root / "report.json", report)
    return report


def _chunks(items: Iterator[Item], n: int) -> Iterator[list[Item]]:
    while chunk := list(islice(items, n)):
        yield chunk


def shard_uids(out: Out, shard: str) -> list[str]:
    """A written shard's uids, from its sidecar."""
    # ParquetFile.read, not pq.read_table: the same column without the dataset machinery (~3x less CPU)
    return pq.ParquetFile(out.root / sidecar_name(shard)).read(columns=["uid"]).column(0).to_pylist()


def uid_hashes(uids: list[str]) -> np.ndarray:
    """A 64-bit hash of each uid (blake2b: the same on every machine and Python, unlike hash())."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(u.encode(), digest_size=8).digest(), "little") for u in uids),
                       dtype=np.uint64, count=len(uids))


class UidScan:
    """The duplicate-uid scan, fed a shard at a time in plan order (map_shards' fold): written rows whose uid an
    earlier row already has. It keeps 8 bytes per row (a hash of the uid), not the uids, so the driver does not
    hold a string per sample of the dataset; the rows whose hash an earlier row has are then checked against the
    uids themselves, read back from the sidecars of the shards that hold them, so a hash collision is no duplicate.
    """

    def __init__(self, out: Out):
        self.out = out
        self.shards: list[str] = []
        self.hashes: list[np.ndarray] = []

    def add(self, shard: str, stats: dict) -> dict:
        """Take a finished shard's uids (this run's, travelling with its counts; a resumed shard's, from its
        sidecar) and return the counts without them."""
        uids = stats.pop("uids", None)
        self.shards.append(shard)
        self.hashes.append(uid_hashes(shard_uids(self.out, shard) if uids is None else uids))
        return stats

    def result(self) -> dict:
        """{'rows': duplicate rows, 'examples': the first MAX_EXAMPLES repeated uids in row order}."""
        h = np.concatenate(self.hashes) if self.hashes else np.zeros(0, np.uint64)
        h.sort()
        suspect = set(h[1:][h[1:] == h[:-1]].tolist())  # hashes that more than one row has
        del h  # 8 bytes a row: the sorted copy, freed before the uids are read back
        if not suspect:
            return {"rows": 0, "examples": []}
        seen: dict[int, set[str]] = {}  # the uids of the suspect hashes, in row order
        dup = 0
        examples = []
        for shard, hashes in zip(self.shards, self.hashes):
            rows = [(i, v) for i, v in enumerate(hashes.tolist()) if v in suspect]
            if not rows:
                continue
            uids = shard_uids(self.out, shard)
            for i, v in rows:
                bucket = seen.setdefault(v, set())
                if uids[i] in bucket:
                    dup += 1
                    if len(examples) < MAX_EXAMPLES and uids[i] not in examples:
                        examples.append(uids[i])
                bucket.add(uids[i])
        return {"rows": dup, "examples": examples}

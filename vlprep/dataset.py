"""The shard contract in code: read a dataset folder safely, write shards atomically, write the index files.

Every stage reads through `iter_samples` / `iter_tar` and writes through `write_shard` + `finish_dataset`,
so the rules of docs/FORMAT.md live in one place.
"""

import io
import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vlprep import VlprepError, __version__, objstore, urls, versions
from vlprep.tarread import TarReader

IMAGE_EXTS = ("jpg", "png", "webp")
# Extensions whose payload webdataset would unpickle; we never read them (docs/FORMAT.md, "Safety").
PICKLE_EXTS = ("pyd", "pickle", "pkl")
# Fixed tar metadata so a shard's bytes depend only on its samples (re-runs and resumes are identical).
TAR_MTIME = 0
KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members


class ShardFormatError(VlprepError):
    """A tar member breaks the contract (pickle payload, unsafe name)."""


class BadShardError(VlprepError):
    """A shard whose tar does not hold the samples its sidecar and sizes.json list (a corrupt or cut tar)."""


SKIP_HINT = "re-create it, or pass --skip-bad-shards to leave bad shards out"
REMAKE_HINT = "re-create it with the vlprep stage that wrote it"


def short_shard(path, n: int, says: str, expected: int, hint: str = SKIP_HINT) -> BadShardError:
    """The one-line error for a tar holding n samples where `says` (e.g. "sizes.json says") gives `expected`."""
    return BadShardError(f"{urls.redact(str(path))}: the tar holds {n} samples, {says} {expected} (a corrupt or cut "
                         f"tar); {hint}")


def reraise(exn: Exception) -> bool:
    raise exn


@dataclass
class Dataset:
    """A finished dataset folder: its shard files (in order), their sample counts, and any shards left out as bad.

    A remote dataset (`url` set: s3://, gs://, http(s)://) has as `root` a local mirror of its small files
    (sizes.json, index.json, meta.json, and each sidecar once asked for); its tars are read by URL (`tar`).
    """

    root: Path
    shards: list[str]
    sizes: dict[str, int]
    bad: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    listed: dict[str, dict] | None = None  # a remote folder's entries {name: {size, etag}} (None: no listing, http)

    @property
    def num_samples(self) -> int:
        return sum(self.sizes.values())

    @property
    def location(self) -> str:
        """The folder for the records (meta.json, the run marker): its canonical URL, redacted (vlprep.urls), or
        absolute path."""
        return urls.redact(self.url) if self.url else str(self.root.resolve())

    def tar(self, shard: str) -> Path | str:
        """A shard's tar: a local path, or a URL that iter_tar reads."""
        return objstore.join(self.url, shard) if self.url else self.root / shard

    def sidecar(self, shard: str) -> Path:
        """A shard's sidecar as a local file (a remote one is fetched into the mirror the first time; a missing one
        is a path that does not exist, as for a local folder)."""
        path = self.root / sidecar_name(shard)
        if self.url and not path.exists():
            with contextlib.suppress(objstore.RemoteNotFound):
                objstore.get_file(objstore.join(self.url, path.name), path)
        return path

    def stat(self, shard: str) -> dict:
        """{'size', 'etag'} of a shard's tar (etag '' for a local file or a server that gives none)."""
        if not self.url:
            return {"size": (self.root / shard).stat().st_size, "etag": ""}
        if self.listed is not None and shard in self.listed:
            return self.listed[shard]
        return objstore.info(self.tar(shard))

    def tar_size(self, shard: str) -> int:
        return self.stat(shard)["size"]

    def fingerprint(self, shard: str, salt: bytes = b"") -> str:
        """What a derived stage's output shard depends on: its input sidecar (keys, captions, stage columns) and
        `salt`, the stage's options and models; `map_shards` redoes a shard whose fingerprint changed."""
        return hashlib.blake2b(salt + self.sidecar(shard).read_bytes(), digest_size=16).hexdigest()


def sidecar_name(shard: str) -> str:
    return shard[: -len(".tar")] + ".parquet"


def plain_shard_name(name) -> bool:
    """A shard name is a plain `*.tar` file name: never a path, so stages cannot be steered to write elsewhere."""
    return (isinstance(name, str) and name.endswith(".tar") and len(name) > 4 and not name.startswith(".")
            and "/" not in name and "\\" not in name and "\0" not in name)


def open_dataset(path: str | os.PathLike) -> Dataset:
    """Open a finished dataset folder (it must have sizes.json); one-line errors for everything else.

    `path` may be a URL: s3://, gs://, http(s):// (see `open_remote`), or file:///path for a local folder."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        path = urls.file_url_path(path)
    if objstore.is_remote(path):
        return open_remote(path)
    root = Path(path)
    if not root.exists():
        raise VlprepError(f"dataset not found: {root}")
    if not root.is_dir():
        raise VlprepError(f"not a dataset folder (expected a folder of .tar shards with sizes.json): {root}")
    sizes_file = root / "sizes.json"
    if not sizes_file.exists():
        tars = sorted(root.glob("*.tar"))
        if tars:
            raise VlprepError(
                f"{root} has {len(tars)} .tar files but no sizes.json: it is not a finished vlprep dataset "
                "(re-run the stage that writes it to resume, or re-shard it with `vlprep shards`)"
            )
        raise VlprepError(f"not a shard dataset (no sizes.json and no .tar shards): {root}")
    sizes = read_sizes(sizes_file, sizes_file)
    missing, odd = [], []
    for s in sizes:
        try:
            (odd if not stat.S_ISREG(os.stat(root / s).st_mode) else []).append(s)
        except FileNotFoundError:
            missing.append(s)
    if missing:
        raise VlprepError(f"{root}: {len(missing)} shard(s) listed in sizes.json are missing, e.g. {missing[0]}")
    if odd:  # a FIFO would block its reader until some writer came, and no tar reader can seek in it
        raise VlprepError(f"{root / odd[0]}: not a regular file (a folder, FIFO or device); a shard must be a tar "
                          "file")
    return Dataset(root=root, shards=list(sizes), sizes=sizes)


def read_sizes(path: Path, shown) -> dict[str, int]:
    """A sizes.json file's {shard name: count}; one-line errors naming it as `shown` (a path or a URL)."""
    try:
        sizes = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VlprepError(f"{shown}: not valid JSON ({e})") from None
    if not isinstance(sizes, dict) or not all(isinstance(v, int) and v >= 0 for v in sizes.values()):
        raise VlprepError(f"{shown}: expected {{shard name: sample count}}")
    unsafe = [s for s in sizes if not plain_shard_name(s)]
    if unsafe:  # derived stages write OUT/<name>: a path here would write outside OUT
        raise VlprepError(f"{shown}: shard name {unsafe[0]!r} is not a plain .tar file name in the folder")
    return sizes


def open_remote(url: str) -> Dataset:
    """A finished dataset at a URL: its sizes.json, index.json and meta.json fetched into a local mirror (sidecars on
    demand), its listing (one LIST request on s3:// and gs://) checked for every shard sizes.json names."""
    url = objstore.norm(url)
    shown = urls.redact(url)
    listed = objstore.listing(url)
    if listed is not None and "sizes.json" not in listed:
        tars = [n for n in listed if n.endswith(".tar")]
        if tars:
            raise VlprepError(f"{shown} has {len(tars)} .tar files but no sizes.json: it is not a finished vlprep "
                              "dataset (re-run the stage that writes it to resume)")
        raise VlprepError(f"not a shard dataset (no sizes.json and no .tar shards): {shown}")
    root = objstore.mirror(url)
    try:
        objstore.get_file(objstore.join(url, "sizes.json"), root / "sizes.json")
    except objstore.RemoteNotFound:
        raise VlprepError(f"not a shard dataset (no sizes.json): {shown}") from None
    for name in ("index.json", "meta.json"):
        (root / name).unlink(missing_ok=True)
        with contextlib.suppress(objstore.RemoteNotFound):
            objstore.get_file(objstore.join(url, name), root / name)
    sizes = read_sizes(root / "sizes.json", urls.redact(objstore.join(url, "sizes.json")))
    missing = [s for s in sizes if listed is not None and s not in listed]
    if missing:
        raise VlprepError(f"{shown}: {len(missing)} shard(s) listed in sizes.json are missing, e.g. {missing[0]}")
    return Dataset(root=root, shards=list(sizes), sizes=sizes, url=url, listed=listed)


def _check_member(name: str) -> str:
    if name.startswith("/") or ".." in name.split("/"):
        raise ShardFormatError(f"unsafe member name {name!r} (absolute or containing '..')")
    ext = name.rsplit("/", 1)[-1].split(".", 1)[-1].lower()
    if ext.rsplit(".", 1)[-1] in PICKLE_EXTS:
        raise ShardFormatError(f"refusing pickled member {name!r}")
    return name


class TarRef(NamedTuple):
    """Where a member's bytes sit in a tar: what travels to the worker that reads them (never the bytes)."""

    path: str
    offset: int
    size: int

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


def iter_tar(path: str | os.PathLike, handler: Callable[[Exception], bool] = reraise,
             refs: tuple[str, ...] = (), on_retry: Callable[[], None] | None = None) -> Iterator[dict]:
    """Samples of one tar, raw: {'__key__', '__url__', ext: bytes, ...}; unsafe or pickled members raise.

    Members whose extension is in `refs` are not read: they come as a TarRef to their bytes. `path` may be a URL,
    read in ranged blocks with retries (vlprep.objstore; `on_retry` is called per retry); a read that still fails is
    a RemoteError naming the URL.

    Grouping follows webdataset: the key is the member path up to the first dot of its file name,
    consecutive members with one key form a sample, `__*__` metadata members are skipped. Read with
    vlprep.tarread rather than webdataset's tar_file_iterator + group_by_keys or tarfile: it parses our
    plain ustar headers about 6x faster than tarfile, which was half of what the text-only stages spent
    (benchmarks/bow.py), and hands any other tar to tarfile, so members and errors are tarfile's.
    """
    url = str(path)
    sample = None
    try:
        with TarReader(path, on_retry=on_retry) as tar:
            for name, offset, size in tar:
                try:
                    # _check_member's tests, inlined with their cheap part first (this loop runs per member)
                    if name[:1] == "/" or (".." in name and ".." in name.split("/")):
                        _check_member(name)
                    dirname, _, base = name.rpartition("/")
                    stem, dot, ext = base.partition(".")
                    if (ext or base).rsplit(".", 1)[-1].lower() in PICKLE_EXTS:
                        _check_member(name)
                    if not dot or name[:2] == "__" and _META.match(name):
                        continue
                    key = f"{dirname}/{stem}" if dirname else stem
                    ext = ext.lower()
                    if sample is not None and key == sample["__key__"] and ext in sample:
                        raise ShardFormatError(f"duplicate member {name!r}")
                    data = TarRef(url, offset, size) if ext in refs else tar.read(offset, size)
                except Exception as exn:
                    if hasattr(exn, "args") and exn.args and isinstance(exn.args[0], str) and not isinstance(
                            exn, objstore.RemoteError):  # (which names the URL already)
                        exn.args = (f"{exn.args[0]} @ {urls.redact(url)}",) + exn.args[1:]
                    if handler(exn):
                        continue
                    break
                if sample is None or key != sample["__key__"]:
                    if sample is not None:
                        yield sample
                    sample = {"__key__": key, "__url__": url}
                sample[ext] = data
        if sample is not None:
            yield sample
    except tarfile.ReadError as e:
        # BadShardError: --skip-bad-shards leaves it out (an http server's HTML error page where a tar should be)
        raise BadShardError(f"{urls.redact(url)}: not a readable tar file ({e})") from None


def iter_aligned(tar_path: Path, keys: list[str]) -> Iterator[tuple[int, dict]]:
    """(sidecar row index, raw sample) for one shard; a sidecar out of step with its tar is an error.

    A tar that ends early is a BadShardError: tarfile takes a corrupt header for the end of the archive, so
    without this count a damaged shard would be read half and the stage would exit 0.
    """
    n = 0
    for i, raw in enumerate(iter_tar(tar_path)):
        if i >= len(keys) or keys[i] != raw["__key__"]:
            raise VlprepError(f"{tar_path}: sidecar does not match the tar at sample {i} ({raw['__key__']})")
        n = i + 1
        yield i, raw
    if n != len(keys):
        raise short_shard(tar_path, n, "its sidecar lists", len(keys))


def count_tar_samples(path: Path | str) -> int:
    """Samples in a tar by its member headers alone (no payload reads), grouped as `iter_tar` groups them."""
    n, last = 0, None
    try:
        with TarReader(path) as tar:
            for name, _, _ in tar:
                dirname, _, base = name.rpartition("/")
                stem, dot, _ = base.partition(".")
                if not dot or _META.match(name):
                    continue
                key = f"{dirname}/{stem}"
                if key != last:
                    n, last = n + 1, key
    except tarfile.ReadError:
        return -1
    return n


def check_shards(ds: Dataset) -> Dataset:
    """`ds` without its bad shards (tar, sidecar and sizes.json disagree on the count), which go to `ds.bad`.

    For --skip-bad-shards: a scan of every tar's headers first (about as long as reading the headers once more);
    without it, stages find a bad shard for free when they reach its end, and stop there.
    """
    bad = {}
    for shard in ds.shards:
        side = ds.sidecar(shard)
        try:
            rows = pq.read_metadata(side).num_rows
        except Exception:  # missing or unreadable sidecar
            rows = -1
        n = count_tar_samples(ds.tar(shard))
        if not n == rows == ds.sizes[shard]:
            bad[shard] = (f"the tar holds {n if n >= 0 else 'no readable'} samples, its sidecar "
                          f"{'is unreadable' if rows < 0 else f'lists {rows}'}, sizes.json says {ds.sizes[shard]}")
    keep = [s for s in ds.shards if s not in bad]
    return dataclasses.replace(ds, shards=keep, sizes={s: ds.sizes[s] for s in keep}, bad={**ds.bad, **bad})


def batches(it: Iterable, n: int) -> Iterator[list]:
    """Consecutive lists of n items (the last one shorter); itertools.batched needs Python 3.12."""
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def check_out(out, *inputs) -> Path:
    """OUT as a Path; a one-line error when it is an input, holds one, or lies inside one.

    `--overwrite` clears vlprep's files in OUT and a run removes its stale `*.tmp`, so an OUT that overlaps an
    input could delete that input (`vlprep shards imgdir imgdir --overwrite` once deleted every image). Both sides
    are compared in their canonical form (vlprep.urls: s3a:// is s3://, file:///x is /x, symlinks and `..`
    resolved). A URL OUT (s3://, gs://) gives its local staging folder (vlprep.objstore), where the stage writes.
    """
    remote = isinstance(out, str) and "://" in out and objstore.scheme(out) != "file"
    if remote and objstore.scheme(out) not in objstore.WRITABLE:
        kind = objstore.scheme(out)
        why = "is read-only here" if kind in objstore.SCHEMES else "is not a supported URL scheme"
        raise VlprepError(f"OUT {urls.redact(out)}: {kind}:// {why}; write to s3://, gs:// or a local folder")
    if isinstance(out, str) and not remote and "://" in out:
        out = urls.file_url_path(out)
    for src in inputs:
        src = objstore.mirrored(src) or src  # a remote input's mirror folder stands for its URL
        shown, where = urls.redact(str(out)), urls.redact(str(src))
        relation = urls.overlap(out, src)
        if relation == "same":
            raise VlprepError(f"OUT {shown} is the input {where}; choose another folder")
        if relation == "contains":
            raise VlprepError(f"OUT {shown} contains the input {where}; choose a folder outside it")
        if relation == "inside":
            raise VlprepError(f"OUT {shown} lies inside the input {where}; choose a folder outside it")
    return objstore.staging(objstore.norm(out)) if remote else Path(out)


def open_derived(src, out, skip_bad_shards: bool = False) -> tuple[Dataset, Path]:
    """A derived stage's input dataset (its bad shards left out when asked) and output folder, kept apart."""
    ds = open_dataset(src)
    out = check_out(out, ds.root)
    return (check_shards(ds) if skip_bad_shards else ds), out


def to_rgb(data: bytes) -> Image.Image:
    """Decode image bytes to RGB for a model; transparency is composited on white (clip art is mostly transparent)."""
    return rgb(Image.open(io.BytesIO(data)))


def rgb(im: Image.Image) -> Image.Image:
    """A PIL image as RGB for a model, transparency composited on white (to_rgb's rule, for an image in memory)."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im.convert("RGB")


def decode_sample(raw: dict) -> dict:
    """Decode `txt` to str and `json` to a dict; leave image and other payloads as bytes."""
    sample = dict(raw)
    if "txt" in sample:
        sample["txt"] = sample["txt"].decode("utf-8")
    if "json" in sample:
        sample["json"] = json.loads(sample["json"])
    return sample


def image_ext(sample: dict) -> str | None:
    return next((e for e in IMAGE_EXTS if e in sample), None)


def iter_samples(path: str | os.PathLike | Dataset, decode: bool = True,
                 handler: Callable[[Exception], bool] = reraise) -> Iterator[dict]:
    """Every sample of a finished dataset folder, in shard order, with '__shard__' set."""
    ds = path if isinstance(path, Dataset) else open_dataset(path)
    for shard in ds.shards:
        n = 0
        for raw in iter_tar(ds.tar(shard), handler=handler):
            raw["__shard__"] = shard
            n += 1
            yield decode_sample(raw) if decode else raw
        if n != ds.sizes[shard] and handler is reraise:
            raise short_shard(ds.tar(shard), n, "sizes.json says", ds.sizes[shard])


# --- writing -----------------------------------------------------------------------------------


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


# json.dumps(v, ensure_ascii=False, sort_keys=True) builds a new JSONEncoder per call (about half of its cost on
# our 4-key metadata); one encoder with the same options writes the same text.
_json_encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True).encode


def _payload(v):
    """A member's payload as written: str as UTF-8, dict as our JSON; anything else as it is."""
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, dict):
        return _json_encode(v).encode("utf-8")
    return v


def encode_sample(sample: dict) -> dict:
    """Sample dict with str/dict payloads -> bytes payloads in a fixed member order."""
    out = {"__key__": sample["__key__"]}
    for k in sorted(sample):
        if not k.startswith("__"):
            out[k] = _payload(sample[k])
    return out


class ShardTarWriter:
    """Plain USTAR tar writer for our shards, byte for byte what `webdataset.TarWriter(f, encoder=False,
    mtime=TAR_MTIME, user="", group="", mode=0o644)` writes with its tarfile stream set to USTAR_FORMAT.

    The project prefers webdataset's TarWriter, and this class was that until it was measured: in
    `vlprep shards` (pass-through) and `vlprep bow` the writing is nearly all of the work, and
    TarWriter.write -> tarfile.addfile spends ~37 us per member against ~12 us for the bytes
    themselves (benchmarks/shards.py, part A). Most of it is TarInfo.tobuf rebuilding all 17 header
    fields and summing 512 bytes, plus copy.copy(tarinfo) and a copy through BytesIO. In our
    members only the name, the size and the checksum vary, so the header is a template built once
    by tarfile itself with those three fields patched in (~2 us). Anything outside the fast path (a
    name over 100 bytes, which ustar splits into prefix + name or refuses; a size of 8 GiB or more)
    goes through TarInfo.tobuf, so it gets exactly tarfile's header or tarfile's error.
    tests/vlprep/test_dataset.py checks the bytes against TarWriter on names and sizes around every limit.
    """

    def __init__(self, f):
        self.f = f
        self.offset = 0

    def _slow_header(self, name: str, size: int) -> bytes:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uname, ti.gname = size, TAR_MTIME, 0o644, "", ""
        return ti.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")

    def header(self, name: str, size: int) -> bytes:
        raw = name.encode(tarfile.ENCODING, "surrogateescape")
        if len(raw) > 100 or size >= _SIZE_LIMIT:
            return self._slow_header(name, size)
        size_field = b"%011o\0" % size
        chksum = _HDR_SUM + sum(raw) + sum(size_field)
        return b"".join((raw, bytes(100 - len(raw)), _HDR_MODE_IDS, size_field, _HDR_MTIME,
                         b"%06o\0 " % chksum, _HDR_TAIL))

    def add(self, name: str, data: bytes) -> None:
        """One member `name` holding `data` (tarfile.addfile with our fixed metadata)."""
        size = len(data)
        self.f.write(self.header(name, size))
        self.f.write(data)
        pad = -size % 512
        if pad:
            self.f.write(bytes(pad))
        self.offset += 512 + size + pad

    def write(self, sample: dict) -> None:
        """One encoded sample (see encode_sample), with TarWriter.write's checks and member order."""
        if "__key__" not in sample:
            raise ValueError("object must contain a __key__")
        members = [(k, v) for k, v in sorted(sample.items()) if k[0] != "_"]
        for k, v in members:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
        key = sample["__key__"] + "."
        for k, v in members:
            self.add(key + k, v)

    def write_sample(self, sample: dict) -> None:
        """write(encode_sample(sample)) in one pass over the sample (write_shard calls it for every sample)."""
        key = sample["__key__"] + "."
        members = []
        for k in sorted(sample):
            if k[0] == "_":  # encode_sample drops "__*", write "_*"
                continue
            v = _payload(sample[k])
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
            members.append((k, v))
        for k, v in members:
            self.add(key + k, v)

    def close(self) -> None:
        """The end of the archive as tarfile writes it: two zero blocks, then zeros up to a 10240-byte record."""
        end = 1024 + (-(self.offset + 1024) % tarfile.RECORDSIZE)
        self.f.write(bytes(end))
        self.offset += end

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header_template() -> tuple[bytes, bytes, bytes, int]:
    """The fixed parts of our member headers, built by tarfile: (mode/uid/gid, mtime, tail, checksum of them)."""
    ti = tarfile.TarInfo("")
    ti.mtime, ti.mode, ti.uname, ti.gname = TAR_MTIME, 0o644, "", ""
    buf = ti.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")
    mode_ids, mtime, tail = buf[100:124], buf[136:148], buf[156:512]
    # the checksum is the byte sum of the header with its own 8-byte field read as spaces
    return mode_ids, mtime, tail, sum(mode_ids) + sum(mtime) + 8 * ord(" ") + sum(tail)


_HDR_MODE_IDS, _HDR_MTIME, _HDR_TAIL, _HDR_SUM = _header_template()
_SIZE_LIMIT = 8**11  # ustar's 11 octal digits


def write_shard(root: Path, shard: str, samples: Iterable[dict], rows: list[dict] | pa.Table,
                schema: pa.Schema | None = None, stats: dict | None = None) -> int:
    """Write one shard and its Parquet sidecar under temporary names, then rename both into place.

    The tar is renamed last, so a visible `NAME.tar` always has its sidecar next to it; an
    interrupted write leaves only `*.tmp` files, which the next run overwrites.
    `stats` (e.g. skip counts) is stored in the sidecar's schema metadata so a resumed run can
    rebuild the report without reprocessing the shard.
    """
    tmp_tar = root / (shard + ".tmp")
    n = 0
    # One writer per shard rather than webdataset's ShardWriter: each worker owns exactly one shard
    # whose name and contents are fixed by the plan, and ShardWriter's rollover-by-count has no
    # temporary-name step. A 1 MiB buffer: a member is three writes (header, data, padding).
    with open(tmp_tar, "wb", buffering=1 << 20) as f, ShardTarWriter(f) as tw:
        for sample in samples:
            tw.write_sample(sample)
            n += 1
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    meta = {b"vlprep": json.dumps({"shard": shard, "stats": stats or {}}).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    sidecar = sidecar_name(shard)
    tmp_pq = root / (sidecar + ".tmp")
    pq.write_table(table, tmp_pq)
    os.replace(tmp_pq, root / sidecar)
    os.replace(tmp_tar, root / shard)
    # A URL OUT: upload both under their final keys, the tar last, and keep only the (small) sidecar here
    objstore.publish(root, [sidecar, shard], keep=[sidecar])
    return n


def shard_done(root: Path, shard: str) -> dict | None:
    """The stored stats of a completed shard, or None when it must be (re)written."""
    tar, side = root / shard, root / sidecar_name(shard)
    if objstore.remote_of(root) is not None:  # a URL OUT: complete when its listing has both (the tar goes last)
        listed = _out_listings.get(str(root), {})
        if shard not in listed or side.name not in listed or not objstore.pull(root, side.name):
            return None
    elif not (tar.exists() and side.exists()):
        return None
    try:
        meta = pq.read_schema(side).metadata or {}
        info = json.loads(meta[b"vlprep"])
    except Exception:
        return None  # unreadable sidecar: rewrite the shard
    return info.get("stats", {})


def read_sidecars(ds: Dataset, columns: list[str] | None = None) -> pa.Table:
    """All sidecars of a dataset concatenated in shard order (one row per sample)."""
    tables = []
    for shard in ds.shards:
        side = ds.sidecar(shard)
        if not side.exists():
            raise VlprepError(f"{ds.root}: missing sidecar {side.name} (written by every vlprep stage)")
        t = pq.read_table(side, columns=columns)
        tables.append(t.replace_schema_metadata(None))
    if not tables:
        return pa.table({c: [] for c in columns or []})
    return pa.concat_tables(tables, promote_options="default")


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n")
    os.replace(tmp, path)


def carried_features(src: str | os.PathLike) -> dict:
    """{"features": record} from SRC's meta.json, for a stage that copies the npy members untouched (bow, detect,
    ontology), so that its output still trains on the cached tokens; {} for a pixel dataset. (Read here rather
    than through `encoders.features_spec`, which would import torch into every light stage.)"""
    try:
        spec = json.loads((local_root(src) / "meta.json").read_text()).get("features")
    except (OSError, ValueError, AttributeError, VlprepError):
        return {}
    return {"features": spec} if isinstance(spec, dict) else {}


def local_root(folder) -> Path:
    """A dataset folder's local path: the folder itself, or a remote dataset's mirror (sizes, index and meta.json)."""
    if isinstance(folder, str) and folder.lower().startswith("file://"):
        return Path(urls.file_url_path(folder))
    if objstore.is_remote(folder):
        url = objstore.norm(folder)
        return objstore.mirror(url) if url in objstore._mirrors else open_remote(url).root
    return Path(folder)


def finish_dataset(root: Path, sizes: dict[str, int], meta: dict) -> None:
    """Write sizes.json (open_clip), index.json (wids) and meta.json once every shard is in place."""
    write_json_atomic(root / "sizes.json", sizes)
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": name, "nsamples": n} for name, n in sizes.items()],
    }
    write_json_atomic(root / "index.json", index)
    write_json_atomic(root / "meta.json", {"vlprep_version": __version__, "versions": versions(), **meta})


RUN_MARKER = ".vlprep-run.json"
LOCK_FILE = objstore.LOCK_NAME
_locks: dict[Path, int] = {}  # OUT (resolved) -> the open lock file this process holds
_out_listings: dict[str, dict] = {}  # a URL OUT's staging folder -> its remote entries when the stage began
SUMMARY_FILES = ("index.json", "meta.json", "sizes.json")  # uploaded last, in this order: sizes.json marks done


def lock_output(root: Path, tool: str = "vlprep") -> None:
    """Hold an exclusive lock on OUT until `release_output` or the process ends; one line if another holds it.

    fcntl.flock on OUT/.vlprep.lock: the kernel drops it when the holder dies (even kill -9), so there is no
    stale-lock clean-up. Re-entrant within a process (a library user may run stages one after another).
    """
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    key = root.resolve()
    if key in _locks:
        return
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise VlprepError(f"OUT {root} is being written by another {tool} process (pid {pid}); wait for it to "
                          "finish or choose another folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _locks[key] = fd


def release_output(root: Path) -> None:
    """Let other processes write OUT again (the stage has finished with it)."""
    import fcntl

    if objstore.remote_of(root) is not None:  # the staging folder goes too: OUT's listing is what a re-run reads
        import shutil

        _out_listings.pop(str(root), None)
        objstore.unlock(objstore.remote_of(root))
        shutil.rmtree(root, ignore_errors=True)
        return
    fd = _locks.pop(Path(root).resolve(), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def prepare_output(root: Path, stage: str, options: dict, overwrite: bool = False) -> None:
    """Make `root` ready for a stage: new, a resumable earlier run with the same options, or refused.

    Takes OUT's lock first, so two writers never clean up each other's files. A folder with anything else in
    it is never modified without `--overwrite`, and even then only if an earlier vlprep run wrote it (it has the
    run marker, sizes.json or the lock file), so a typo in OUT cannot delete a user's files; only files a stage
    writes (*.tar, *.parquet, *.json, *.tmp, *.png, *.npy, *.faiss) are removed.
    """
    marker = root / RUN_MARKER
    run = {"stage": stage, "options": options}
    if objstore.remote_of(root) is not None:
        return _prepare_remote(root, objstore.remote_of(root), run, overwrite)
    if root.exists() and not root.is_dir():
        raise VlprepError(f"output exists and is not a folder: {root}")
    existing = [p for p in root.iterdir() if p.name != LOCK_FILE] if root.exists() else []
    # A lock file means a vlprep run started here (perhaps stopped before its marker): skip straight to the lock,
    # so a live writer is what gets reported.
    ours = (root / LOCK_FILE).exists()
    if existing and not ours and not marker.exists() and not (root / "sizes.json").exists():
        raise VlprepError(f"output folder {root} is not empty and was not written by vlprep; choose a new or "
                          "empty folder (--overwrite only clears vlprep's own output)")
    lock_output(root)
    if existing:
        previous = None
        try:
            previous = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            previous = None
        if previous != run:
            if not overwrite:
                release_output(root)
                why = "was written with other options" if previous else "is not empty"
                raise VlprepError(f"output folder {root} {why}; choose another folder or pass --overwrite")
            for p in root.iterdir():
                if p.is_file() and p.suffix in (".tar", ".parquet", ".json", ".tmp", ".png", ".npy", ".faiss"):
                    p.unlink()
    for p in root.glob("*.tmp"):
        p.unlink()  # half-written shards of an interrupted run: safe to remove only while holding the lock
    write_json_atomic(marker, run)


@contextlib.contextmanager
def writing_output(root: Path, stage: str, options: dict, overwrite: bool = False) -> Iterator[Path]:
    """`prepare_output`, the body, then `release_output`, also when the body raises: a library user's process
    goes on after an error, and another process may then write OUT. A URL OUT gets the files the body left in its
    staging folder uploaded when the body ends without an error, sizes.json last."""
    prepare_output(root, stage, options, overwrite)
    try:
        yield root
        if objstore.remote_of(root) is not None:
            _upload_rest(root, objstore.remote_of(root))
    finally:
        release_output(root)


def remove_extra_shards(root: Path, prefix: str, keep: set[str]) -> None:
    """Drop shards named like ours that the current plan does not produce (e.g. a shorter source)."""
    for p in list(root.glob(f"{prefix}-*.tar")) + list(root.glob(f"{prefix}-*.parquet")):
        if p.with_suffix(".tar").name not in keep:
            p.unlink()
    url = objstore.remote_of(root)
    if url is not None:
        listed = objstore.listing(url) or {}
        objstore.remove(objstore.join(url, n) for n in listed if n.startswith(f"{prefix}-")
                        and n.endswith((".tar", ".parquet")) and Path(n).with_suffix(".tar").name not in keep)


# --- a URL OUT (vlprep.objstore): the staging folder's counterpart of prepare_output and the final upload ------------

_STAGE_FILES = (".tar", ".parquet", ".json", ".tmp", ".png", ".npy", ".faiss")


def _prepare_remote(root: Path, url: str, run: dict, overwrite: bool) -> None:
    """prepare_output for a URL OUT: the same rules on its listing, the lock object instead of flock, and an empty
    staging folder (a completed shard is known by its remote tar and sidecar, whose schema metadata holds its
    fingerprint: resume works from the listing)."""
    import shutil

    listed = objstore.listing(url)
    existing = [n for n in listed if n != LOCK_FILE]
    if existing and LOCK_FILE not in listed and RUN_MARKER not in listed and "sizes.json" not in listed:
        raise VlprepError(f"output folder {url} is not empty and was not written by vlprep; choose a new or "
                          "empty folder (--overwrite only clears vlprep's own output)")
    objstore.lock(url)
    try:
        previous = None
        if RUN_MARKER in listed:
            with contextlib.suppress(VlprepError, ValueError):
                previous = json.loads(objstore.read_bytes(objstore.join(url, RUN_MARKER)))
        if existing and previous != run:
            if not overwrite:
                why = "was written with other options" if previous else "is not empty"
                raise VlprepError(f"output folder {url} {why}; choose another folder or pass --overwrite")
            objstore.remove(objstore.join(url, n) for n, e in listed.items()
                            if e["type"] == "file" and n != LOCK_FILE and n.endswith(_STAGE_FILES))
            listed = objstore.listing(url)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        write_json_atomic(root / RUN_MARKER, run)
        objstore.publish(root, [RUN_MARKER], keep=[RUN_MARKER])
        _out_listings[str(root)] = listed
    except BaseException:
        objstore.unlock(url)
        raise


def _upload_rest(root: Path, url: str) -> None:
    """What the stage left in its staging folder besides the shards (already uploaded as they completed): report,
    plots, indexes, then index.json, meta.json and sizes.json, the last one marking the dataset finished."""
    listed = objstore.listing(url)
    rest, summary = [], []
    for p in sorted(root.iterdir()):
        if not p.is_file() or p.name.endswith(".tmp") or p.name in (RUN_MARKER, LOCK_FILE):
            continue
        if p.suffix == ".parquet" and p.with_suffix(".tar").name in listed and not p.with_suffix(".tar").exists():
            continue  # a shard's sidecar, uploaded with its tar
        (summary if p.name in SUMMARY_FILES else rest).append(p.name)
    objstore.publish(root, rest + sorted(summary, key=SUMMARY_FILES.index), keep=rest + summary)

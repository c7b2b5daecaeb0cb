"""The shard contract's read side in code: open a dataset folder (local or a URL) and read its shards safely.

Every stage reads through `iter_samples` / `iter_tar`, so the rules of docs/FORMAT.md live in one place; the
write side is vlprep.output (and both tar codecs are vlprep.tario).
"""

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import stat
import tarfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vlprep import VlprepError, objstore, urls
from vlprep.tario import TarReader

IMAGE_EXTS = ("jpg", "png", "webp")
# Extensions whose payload webdataset would unpickle; we never read them (docs/FORMAT.md, "Safety").
PICKLE_EXTS = ("pyd", "pickle", "pkl")
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

    A remote dataset (`url` set: s3://, gs://, http(s)://) has as `root` its own local mirror of its small files
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

    @property
    def source(self) -> "Path | objstore.RemoteSrc":
        """The input folder a stage's Work names: the local folder, or the URL a worker fetches each shard from."""
        return objstore.RemoteSrc(self.url) if self.url else self.root

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

    def column(self, shard: str, name: str) -> list:
        """One column of a shard's sidecar as Python values (ParquetFile.read: the column without pq.read_table's
        dataset machinery)."""
        return pq.ParquetFile(self.sidecar(shard)).read(columns=[name]).column(0).to_pylist()

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
    root = local_or_url(path)
    if isinstance(root, str):
        return open_remote(root)
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
    missing = []
    odd = []
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


def local_or_url(path) -> Path | str:
    """A dataset argument as read: a URL in its canonical form (s3://, gs://, http(s)://), else a local Path
    (file:///path is that path; the one place file:// is handled)."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        return Path(urls.file_url_path(path))
    if objstore.is_remote(path):
        return objstore.norm(path)
    return Path(path)


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
    root = objstore.mirror()
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
    vlprep.tario's TarReader rather than webdataset's tar_file_iterator + group_by_keys or tarfile: tarfile's
    header parsing was half of what the text-only stages spent, and TarReader hands any tar but our plain ustar
    ones to tarfile, so members and errors are tarfile's.
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
    n = 0
    last = None
    try:
        with TarReader(path) as tar:
            for name, _, _ in tar:
                dirname, _, base = name.rpartition("/")
                stem, dot, _ = base.partition(".")
                if not dot or _META.match(name):
                    continue
                key = f"{dirname}/{stem}"
                if key != last:
                    n = n + 1
                    last = key
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


def decode_rgb(data: bytes, draft: Callable[[int, int], int] | None = None) -> Image.Image:
    """Decode image bytes to RGB for a model; transparency is composited on white (clip art is mostly transparent).

    `draft` (width, height) -> k in 1, 2, 4, 8: a JPEG is decoded at 1/k of its size by libjpeg's scaled inverse DCT
    (PIL's Image.draft), ceil(width / k) x ceil(height / k), much cheaper than a full decode and a resize; other
    formats, and every caller that gives no `draft`, decode at full size.
    """
    with warnings.catch_warnings():
        # as vlprep.shards: Pillow warns above 89M pixels (printed raw, with its source line) and refuses above 179M;
        # every caller counts the refusal as a skip, the warning says nothing more
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        im = Image.open(io.BytesIO(data))
        if draft is not None and im.format == "JPEG":
            k = draft(*im.size)
            if k > 1:
                # draft picks the largest DCT scale (8, 4, 2) whose result is at least the requested size, and
                # width // (width // k) lies in [k, 2k): the request below gets exactly k
                im.draft("RGB", (max(1, im.width // k), max(1, im.height // k)))
        return as_rgb(im)


def as_rgb(im: Image.Image) -> Image.Image:
    """A PIL image as RGB for a model, transparency composited on white (decode_rgb's rule, for an image in memory)."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im.convert("RGB")


class BadJson(VlprepError, ValueError):
    """A sample's `json` member that is not a strict JSON object; stages count the sample as `bad_json`."""


MAX_JSON_DEPTH = 64  # far above any stage's metadata (json.objects is 4 deep); JSON libraries recurse per level


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0:  # 1e400 parses as an infinity
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth(value) -> int:
    """How deep lists and dicts nest in a parsed value (1 for a flat one), counted without recursion, up to just past
    MAX_JSON_DEPTH."""
    deepest = 0
    stack = [(value, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        v, d = stack.pop()
        deepest = max(deepest, d)
        inner = v.values() if isinstance(v, dict) else v
        stack.extend((c, d + 1) for c in inner if isinstance(c, (dict, list)))
    return deepest


def decode_json(data: bytes) -> dict:
    """A sample's `json` member as a dict, or BadJson (one line) when it is no strict JSON object: not UTF-8,
    malformed, NaN or an infinity (which strict parsers refuse, and vlprep never writes), or nested deeper than
    MAX_JSON_DEPTH (a 100,000-deep one is a RecursionError in any recursive reader or writer)."""
    try:
        value = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise BadJson("json member: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit integer, NaN/Infinity
        raise BadJson(f"json member: malformed ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(value, dict):
        raise BadJson(f"json member: not a JSON object but {type(value).__name__}")
    # bytes.count runs in C: only a member with many brackets is walked
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise BadJson(f"json member: nested more than {MAX_JSON_DEPTH} deep")
    return value


def bad_json_warning(n: int, outcome: str = "they were left out") -> list[str]:
    """The report's warning line for n samples whose json member is no strict JSON object (none when n is 0)."""
    return [f"{n:,} samples' json member is not strict JSON (malformed, NaN or Infinity, or nested too deeply): "
            f"{outcome} (report.json: bad_json)"] if n else []


def decode_sample(raw: dict) -> dict:
    """Decode `txt` to str and `json` to a dict (decode_json: BadJson naming the sample when it is no strict JSON
    object); leave image and other payloads as bytes."""
    sample = dict(raw)
    if "txt" in sample:
        sample["txt"] = sample["txt"].decode("utf-8")
    if "json" in sample:
        try:
            sample["json"] = decode_json(sample["json"])
        except BadJson as e:
            raise BadJson(f"{sample.get('__key__')}: {e}") from None
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


def carried_features(ds: Dataset) -> dict:
    """{"features": record} from the input's meta.json, for a stage that copies the npy members untouched (bow, detect,
    ontology), so that its output still trains on the cached tokens; {} for a pixel dataset. (Read here rather
    than through `encoders.features_spec`, which would import torch into every light stage.)"""
    try:
        spec = json.loads((ds.root / "meta.json").read_text()).get("features")
    except (OSError, ValueError, AttributeError, VlprepError):
        return {}
    return {"features": spec} if isinstance(spec, dict) else {}


def local_root(folder) -> Path:
    """A dataset folder's local path: the folder itself, or a remote dataset's mirror (sizes, index and meta.json)."""
    where = local_or_url(folder)
    return open_remote(where).root if isinstance(where, str) else where

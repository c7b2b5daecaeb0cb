"""A stage's output from start to end: OUT checked against the inputs (`check_out`), prepared and locked
(`writing_output`), shards written atomically (`write_shard`), the index files written last (`finish_dataset`).

Every function here is given the `Out` it works on: where OUT is, and in the driver the lock it holds
(vlprep.outlock). Nothing is remembered between calls, so one process may write two OUTs at once.

A URL OUT (s3://, gs://) has a local staging folder: the stage writes there as it writes a local OUT, and each
completed file is uploaded under its final key (`publish`), the shard's tar after its sidecar; a PUT becomes visible
only once complete, so a stopped stage leaves no final-named partial object. The summary files go last, `sizes.json`
the very last.
"""

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError, __version__, objstore, urls, versions
from vlprep.dataset import Dataset, check_shards, local_or_url, open_dataset, sidecar_name
from vlprep.outlock import LOCK_FILE, OutLock, lock_output, lock_url
from vlprep.tario import ShardTarWriter

RUN_MARKER = ".vlprep-run.json"
SUMMARY_FILES = ("index.json", "meta.json", "sizes.json")  # uploaded last, in this order: sizes.json marks done
STAGE_FILES = (".tar", ".parquet", ".json", ".tmp", ".png", ".npy", ".faiss")  # what --overwrite may remove


@dataclass(frozen=True)
class Out:
    """Where a stage writes: `root`, a local folder (a URL OUT's staging folder), and `url` (None for a local OUT).

    Workers get this much (`portable`). The driver's Out, from `writing_output`, also holds OUT's `lock` and, for a
    URL OUT, `listed`: its remote entries when the stage began, from which a re-run resumes. `sent` records the
    files `publish` uploaded and kept in the staging folder (name -> size and mtime), so the final upload skips those
    unchanged since (pseudolabel's index, uploaded early for the workers, is not sent twice)."""

    root: Path
    url: str | None = None
    lock: OutLock | None = field(default=None, compare=False, repr=False)
    listed: dict[str, dict] | None = field(default=None, compare=False, repr=False)
    sent: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    def portable(self) -> "Out":
        """The picklable part a worker needs: the folder and the URL, without the lock and the listing."""
        return Out(self.root, self.url)


# --- OUT and the inputs -----------------------------------------------------------------------------------------------


def staging(url: str) -> Path:
    """The local folder a stage writes for OUT `url` (the same path in the driver and every worker, so a Ray actor
    on another machine makes its own)."""
    digest = hashlib.blake2b(objstore.norm(url).encode(), digest_size=8).hexdigest()
    return Path(tempfile.gettempdir()) / f"vlprep-out-{os.getuid() if hasattr(os, 'getuid') else 0}" / digest


def check_out(out, *inputs) -> Out:
    """OUT as an `Out`; a one-line error when it is an input, holds one, or lies inside one.

    `--overwrite` clears vlprep's files in OUT and a run removes its stale `*.tmp`, so an OUT that overlaps an
    input could delete that input (`vlprep shards imgdir imgdir --overwrite` once deleted every image). Every input
    a stage reads is given (datasets, embeddings folders, keys and detections files, checkpoints; None for an option
    not given). Both sides are compared in their canonical form (vlprep.urls: s3a:// is s3://, file:///x is /x,
    symlinks and `..` resolved); an input may be a `Dataset` (a remote one stands for its URL). A URL OUT (s3://,
    gs://) is written in its local staging folder.
    """
    remote = isinstance(out, str) and "://" in out and objstore.scheme(out) != "file"
    if remote and objstore.scheme(out) not in objstore.WRITABLE:
        kind = objstore.scheme(out)
        why = "is read-only here" if kind in objstore.SCHEMES else "is not a supported URL scheme"
        raise VlprepError(f"OUT {urls.redact(out)}: {kind}:// {why}; write to s3://, gs:// or a local folder")
    if not remote:
        out = local_or_url(out)  # file:///x is the folder /x
    for src in inputs:
        if src is None:
            continue
        if isinstance(src, Dataset):
            src = src.url or src.root
        shown = urls.redact(str(out))
        where = urls.redact(str(src))
        relation = urls.overlap(out, src)
        if relation == "same":
            raise VlprepError(f"OUT {shown} is the input {where}; choose another folder")
        if relation == "contains":
            raise VlprepError(f"OUT {shown} contains the input {where}; choose a folder outside it")
        if relation == "inside":
            raise VlprepError(f"OUT {shown} lies inside the input {where}; choose a folder outside it")
    if remote:
        url = objstore.norm(out)
        return Out(staging(url), url)
    return Out(out)


def open_derived(src, out, skip_bad_shards: bool = False, inputs: Iterable = ()) -> tuple[Dataset, Out]:
    """A derived stage's input dataset (its bad shards left out when asked) and output, kept apart from it and from
    the stage's other `inputs` (check_out)."""
    ds = open_dataset(src)
    place = check_out(out, ds, *inputs)
    return (check_shards(ds) if skip_bad_shards else ds), place


# --- the stage's lifetime ---------------------------------------------------------------------------------------------


def prepare_output(out: Out, stage: str, options: dict, overwrite: bool = False) -> Out:
    """`out` made ready for a stage and locked: new, a resumable earlier run with the same options, or refused.

    Takes OUT's lock first, so two writers never clean up each other's files. A folder with anything else in
    it is never modified without `--overwrite`, and even then only if an earlier vlprep run wrote it (it has the
    run marker, sizes.json or the lock file), so a typo in OUT cannot delete a user's files; only files a stage
    writes (STAGE_FILES) are removed.
    """
    run = {"stage": stage, "options": options}
    if out.url is not None:
        return _prepare_remote(out, run, overwrite)
    root = out.root
    marker = root / RUN_MARKER
    if root.exists() and not root.is_dir():
        raise VlprepError(f"output exists and is not a folder: {root}")
    existing = [p for p in root.iterdir() if p.name != LOCK_FILE] if root.exists() else []
    # A lock file means a vlprep run started here (perhaps stopped before its marker): skip straight to the lock,
    # so a live writer is what gets reported.
    ours = (root / LOCK_FILE).exists()
    if existing and not ours and not marker.exists() and not (root / "sizes.json").exists():
        raise VlprepError(f"output folder {root} is not empty and was not written by vlprep; choose a new or "
                          "empty folder (--overwrite only clears vlprep's own output)")
    lock = lock_output(root)
    if existing:
        previous = None
        try:
            previous = json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            previous = None
        if previous != run:
            if not overwrite:
                lock.release()
                why = "was written with other options" if previous else "is not empty"
                raise VlprepError(f"output folder {root} {why}; choose another folder or pass --overwrite")
            for p in root.iterdir():
                if p.is_file() and p.suffix in STAGE_FILES:
                    p.unlink()
    for p in root.glob("*.tmp"):
        p.unlink()  # half-written shards of an interrupted run: safe to remove only while holding the lock
    write_json_atomic(marker, run)
    return Out(root, None, lock)


@contextlib.contextmanager
def writing_output(out: Out, stage: str, options: dict, overwrite: bool = False) -> Iterator[Out]:
    """`prepare_output`, the body (given the locked Out), then the lock released, also when the body raises: a
    library user's process goes on after an error, and another process may then write OUT. A URL OUT gets the
    files the body left in its staging folder uploaded when the body ends without an error, sizes.json last; its
    staging folder goes in the end (OUT's listing is what a re-run reads)."""
    held = prepare_output(out, stage, options, overwrite)
    try:
        yield held
        if held.url is not None:
            _upload_rest(held)
    finally:
        held.lock.release()
        if held.url is not None:
            shutil.rmtree(held.root, ignore_errors=True)


def _prepare_remote(out: Out, run: dict, overwrite: bool) -> Out:
    """prepare_output for a URL OUT: the same rules on its listing, the lock object instead of flock, and an empty
    staging folder (a completed shard is known by its remote tar and sidecar, whose schema metadata holds its
    fingerprint: resume works from the listing)."""
    url = out.url
    listed = objstore.listing(url)
    existing = [n for n in listed if n != LOCK_FILE]
    if existing and LOCK_FILE not in listed and RUN_MARKER not in listed and "sizes.json" not in listed:
        raise VlprepError(f"output folder {url} is not empty and was not written by vlprep; choose a new or "
                          "empty folder (--overwrite only clears vlprep's own output)")
    lock = lock_url(url)
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
                            if e["type"] == "file" and n != LOCK_FILE and n.endswith(STAGE_FILES))
            listed = objstore.listing(url)
        shutil.rmtree(out.root, ignore_errors=True)
        out.root.mkdir(parents=True)
        write_json_atomic(out.root / RUN_MARKER, run)
        held = Out(out.root, url, lock, listed)
        publish(held, [RUN_MARKER], keep=[RUN_MARKER])
        return held
    except BaseException:
        lock.release()
        raise


def _upload_rest(out: Out) -> None:
    """What the stage left in its staging folder besides the shards (already uploaded as they completed): report,
    plots, indexes, then index.json, meta.json and sizes.json, the last one marking the dataset finished."""
    listed = objstore.listing(out.url)
    rest = []
    summary = []
    for p in sorted(out.root.iterdir()):
        if not p.is_file() or p.name.endswith(".tmp") or p.name in (RUN_MARKER, LOCK_FILE):
            continue
        if p.suffix == ".parquet" and p.with_suffix(".tar").name in listed and not p.with_suffix(".tar").exists():
            continue  # a shard's sidecar, uploaded with its tar
        if out.sent.get(p.name) == _stamp(p):
            continue  # uploaded during the stage and not changed since
        (summary if p.name in SUMMARY_FILES else rest).append(p.name)
    publish(out, rest + sorted(summary, key=SUMMARY_FILES.index), keep=rest + summary)


# --- files in OUT -----------------------------------------------------------------------------------------------------


def publish(out: Out, names: Iterable[str], keep: Iterable[str] = ()) -> None:
    """Upload the completed files `names` of a URL OUT's staging folder, in order (the one that marks completion
    last), then remove the local copies of those not in `keep`; nothing for a local OUT."""
    if out.url is None:
        return
    names = list(names)
    keep = set(keep)
    for name in names:
        sys.audit("vlprep.upload", name)  # vlprep.lifeline: a worker whose driver is gone exits instead
        stamp = _stamp(out.root / name)
        objstore.put_file(out.root / name, objstore.join(out.url, name))
        if name in keep:
            out.sent[name] = stamp
    for name in names:
        if name not in keep:
            (out.root / name).unlink(missing_ok=True)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def pull(out: Out, name: str) -> bool:
    """Whether `out.root / name` exists locally, downloading it first from a URL OUT that has it."""
    local = out.root / name
    if local.exists():
        return True
    if out.url is None:
        return False
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        objstore.get_file(objstore.join(out.url, name), local)
    except objstore.RemoteNotFound:
        return False
    return True


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


def write_shard(out: Out, shard: str, samples: Iterable[dict], rows: list[dict] | pa.Table,
                schema: pa.Schema | None = None, stats: dict | None = None) -> int:
    """Write one shard and its Parquet sidecar under temporary names, then rename both into place.

    The tar is renamed last, so a visible `NAME.tar` always has its sidecar next to it; an
    interrupted write leaves only `*.tmp` files, which the next run overwrites.
    `stats` (e.g. skip counts) is stored in the sidecar's schema metadata so a resumed run can
    rebuild the report without reprocessing the shard.
    """
    root = out.root
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
    meta = {b"vlprep": json.dumps({"shard": shard, "stats": stats or {}}, allow_nan=False).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    sidecar = sidecar_name(shard)
    tmp_pq = root / (sidecar + ".tmp")
    pq.write_table(table, tmp_pq)
    os.replace(tmp_pq, root / sidecar)
    os.replace(tmp_tar, root / shard)
    # A URL OUT: upload both under their final keys, the tar last, and keep only the (small) sidecar here
    publish(out, [sidecar, shard], keep=[sidecar])
    return n


def shard_done(out: Out, shard: str) -> dict | None:
    """The stored stats of a completed shard, or None when it must be (re)written."""
    side = out.root / sidecar_name(shard)
    if out.url is not None:  # a URL OUT: complete when its listing has both (the tar goes last)
        listed = out.listed or {}
        if shard not in listed or side.name not in listed or not pull(out, side.name):
            return None
    elif not ((out.root / shard).exists() and side.exists()):
        return None
    try:
        meta = pq.read_schema(side).metadata or {}
        info = json.loads(meta[b"vlprep"])
    except Exception:
        return None  # unreadable sidecar: rewrite the shard
    return info.get("stats", {})


def remove_extra_shards(out: Out, prefix: str, keep: set[str]) -> None:
    """Drop shards named like ours that the current plan does not produce (e.g. a shorter source)."""
    for p in list(out.root.glob(f"{prefix}-*.tar")) + list(out.root.glob(f"{prefix}-*.parquet")):
        if p.with_suffix(".tar").name not in keep:
            p.unlink()
    if out.url is not None:
        listed = objstore.listing(out.url) or {}
        objstore.remove(objstore.join(out.url, n) for n in listed if n.startswith(f"{prefix}-")
                        and n.endswith((".tar", ".parquet")) and Path(n).with_suffix(".tar").name not in keep)


def write_json_atomic(path: Path, obj) -> None:
    """`obj` as strict JSON (a NaN or an infinity is a ValueError, never `NaN` in the file), written atomically."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False, allow_nan=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def finish_dataset(out: Out, sizes: dict[str, int], meta: dict) -> None:
    """Write sizes.json (open_clip), index.json (wids) and meta.json once every shard is in place."""
    write_json_atomic(out.root / "sizes.json", sizes)
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": name, "nsamples": n} for name, n in sizes.items()],
    }
    write_json_atomic(out.root / "index.json", index)
    write_json_atomic(out.root / "meta.json", {"vlprep_version": __version__, "versions": versions(), **meta})

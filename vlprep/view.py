"""`vlprep view`: a static HTML page of N samples of a dataset, drawn across its shards by a seeded, stratified draw
and read alone (member headers are scanned up to the last drawn sample of a shard; no other payload is read)."""

import contextlib
import hashlib
import io
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from vlprep import VlprepError, objstore, urls
from vlprep.dataset import (IMAGE_EXTS, _META, Dataset, _check_member, as_rgb, local_or_url, open_dataset,
                            short_shard, sidecar_name)
from vlprep.tario import TarReader
from vlprep.viewfiles import NotRegular, make_server, open_regular, refuse_links, write_file
from vlprep.viewpage import MAX_JSON_DEPTH, lineage, load_json, render_page, sample_record, shown

__all__ = ["ViewConfig", "build_view", "make_server"]  # the command's entry points (make_server: vlprep.viewfiles)

MAX_SAMPLES = 100_000  # every drawn sample is a card and a thumbnail in one page
READ_EXTS = frozenset(("txt", "json") + IMAGE_EXTS)
MARKER = ".vlprep-view"  # marks a folder `vlprep view` wrote, which a later view may replace
FIGURE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.png")  # a plain file name, safe in a URL and a folder
MAX_FIGURE_BYTES = 32 << 20
MAX_JSON_BYTES = 64 << 20  # meta.json, report.json, ontology.json: far above any stage's
DROPPED_COLUMNS = ("key", "shard", "rule", "detail")  # of a filter's dropped.parquet (docs/FILTER.md)


@dataclass
class ViewConfig:
    dataset: Path | str
    out: Path | None = None  # default: DATASET/view (a URL DATASET needs one)
    samples: int = 200
    seed: int = 0
    thumb: int = 256  # the longer side of a thumbnail, in pixels
    port: int | None = None  # --serve's port, checked before anything is written
    input: Path | str | None = None  # --input: the filter's input, for its dropped samples (and the lineage)
    aligned: Path | str | None = None  # --aligned: the pseudolabel's aligned dataset, for the neighbours' captions

    def validate(self) -> None:
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise VlprepError(f"--samples must be between 1 and {MAX_SAMPLES:,}, not {self.samples}")
        if self.seed < 0:
            raise VlprepError(f"--seed must be >= 0, not {self.seed}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise VlprepError(f"--port must be between 0 and 65535, not {self.port}")
        if self.out is None and isinstance(local_or_url(self.dataset), str):
            raise VlprepError(f"DATASET {urls.redact(str(self.dataset))} is a URL: give --out, a local folder for the "
                              "page")


def allocate(sizes: list[int], n: int, rng: np.random.Generator) -> list[int]:
    """Samples to draw from each shard: n split in proportion to the sizes by largest remainder, ties broken at
    random (so that 200 of 1,000 equal shards are a random 200, not the first ones); every sample when n >= total."""
    total = sum(sizes)
    if n >= total:
        return list(sizes)
    base = [n * s // total for s in sizes]
    rest = [n * s % total for s in sizes]
    tie = rng.permutation(len(sizes))
    order = sorted(range(len(sizes)), key=lambda i: (-rest[i], tie[i]))
    for i in order[: n - sum(base)]:
        base[i] += 1
    return base


def draw(ds: Dataset, n: int, seed: int) -> dict[str, list[int]]:
    """{shard: sorted sample positions} of a seeded stratified draw of n samples (shards drawing none left out)."""
    rng = np.random.default_rng(seed)
    counts = allocate([ds.sizes[s] for s in ds.shards], n, rng)
    picks = {}
    for shard, k in zip(ds.shards, counts):
        if k:
            picks[shard] = sorted(int(i) for i in rng.choice(ds.sizes[shard], size=k, replace=False))
    return picks


def read_picked(tar_path, positions: list[int], expected: int) -> Iterator[tuple[int, dict]]:
    """(position, raw sample) for the drawn positions of one shard: the tar's member headers are scanned up to the
    last of them, and only their txt, json and image members are read (the reading rules of iter_tar)."""
    want = set(positions)
    last = positions[-1]
    index = -1
    key = None
    sample: dict = {}
    buffering = 1 << 16 if isinstance(tar_path, str) else 1 << 12  # local: a page per header, not 64 KiB of payload
    with TarReader(tar_path, buffering=buffering) as tar:
        for name, offset, size in tar:
            _check_member(name)
            dirname, _, base = name.rpartition("/")
            stem, dot, ext = base.partition(".")
            if not dot or _META.match(name):
                continue
            k = f"{dirname}/{stem}" if dirname else stem
            if k != key:
                if index in want:
                    yield index, sample
                index += 1
                key = k
                sample = {"__key__": k}
                if index > last:
                    return
            if index in want and ext.lower() in READ_EXTS:
                sample[ext.lower()] = tar.read(offset, size)
    if index in want:
        yield index, sample
    if index < last:
        raise short_shard(tar_path, index + 1, "sizes.json says", expected)


def thumb_name(key: str) -> str:
    """A thumbnail's file name: a hash of the key, never the key (a key may look like a path)."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest() + ".jpg"


def write_thumb(data: bytes, path: Path, side: int) -> tuple[int, int] | None:
    """Save a JPEG thumbnail of image bytes (longer side at most `side`); its (width, height), None if undecodable."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.thumbnail((side, side))
            rgb = as_rgb(im)
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    rgb.save(path, format="JPEG", quality=85)
    return rgb.size


def prepare_out(out: Path, ds: Dataset) -> None:
    """Make OUT ready: new, empty, or a page `vlprep view` wrote (its thumbnails are replaced); never the dataset, and
    never a link inside it (the default DATASET/view may have come with a downloaded dataset)."""
    root = ds.root.resolve()
    if not ds.url and (out.resolve() == root or root.is_relative_to(out.resolve())):
        raise VlprepError(f"--out {out} is (or holds) the dataset folder; give another folder")
    if not ds.url and out.absolute().is_relative_to(ds.root.absolute()):
        step = ds.root
        for part in out.absolute().relative_to(ds.root.absolute()).parts:
            step = step / part
            if step.is_symlink():
                raise VlprepError(f"--out {out} is a symbolic link inside the dataset (or lies under one); give "
                                  "another folder")
    if out.exists() and not out.is_dir():
        raise VlprepError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise VlprepError(f"--out {out} holds files that `vlprep view` did not write; give an empty or new folder")
    for old in (out / "thumbs", out / "figures"):
        if old.is_symlink() or old.is_file():  # a link is removed, never followed
            old.unlink()
        elif old.is_dir():
            shutil.rmtree(old)
    (out / "thumbs").mkdir(parents=True, exist_ok=True)
    write_file(out / MARKER, b"written by vlprep view\n")


def open_file(root: Path, parts: tuple[str, ...], not_read: list[str]):
    """The dataset's file root/parts opened for reading (open_regular: no link followed); None when it is missing,
    or, with `name (why)` added to `not_read`, when it is a link, no regular file or unreadable."""
    try:
        return open_regular(root, *parts)
    except NotRegular as e:
        not_read.append(f"{'/'.join(parts)} ({e})")
    except OSError as e:
        not_read.append(f"{'/'.join(parts)} ({(e.strerror or type(e).__name__).lower()})")
    return None


def read_json(root: Path, name: str, not_read: list[str]) -> dict:
    """A small JSON file of the dataset folder (meta.json, report.json, ontology.json) as a dict; {} when it is
    missing, and {} with `name (why)` added to `not_read` when it is a link, too large or no JSON object."""
    f = open_file(root, (name,), not_read)
    if f is None:
        return {}
    with f:
        data = f.read(MAX_JSON_BYTES + 1)
    value = load_json(data) if len(data) <= MAX_JSON_BYTES else None
    if value is None:
        why = f"over {MAX_JSON_BYTES >> 20} MiB" if len(data) > MAX_JSON_BYTES else \
            f"not a JSON object nested at most {MAX_JSON_DEPTH} deep"
        not_read.append(f"{name} ({why})")
    return value or {}


def small_file(ds: Dataset, name: str, not_read: list[str]) -> dict:
    """A small JSON file beside the shards (report.json, ontology.json) as a dict, fetched into a remote dataset's
    mirror first; {} when there is none (read_json)."""
    if ds.url and not (ds.root / name).exists():
        with contextlib.suppress(objstore.RemoteNotFound):
            objstore.get_file(objstore.join(ds.url, name), ds.root / name)
    return read_json(ds.root, name, not_read)


def given(where, flag: str, out: Path) -> Dataset | None:
    """A dataset the user named (--input, --aligned), opened; a one-line error when it cannot be, when its shards or
    sidecars hold a link, or when OUT is it or holds it (OUT's thumbnails are replaced)."""
    if where is None:
        return None
    try:
        ds = open_dataset(where)
    except VlprepError as e:
        raise VlprepError(f"{flag}: {e}") from None
    if urls.overlap(out, ds.url or ds.root) in ("same", "contains"):
        raise VlprepError(f"--out {out} is (or holds) the {flag} dataset {ds.location}; give another folder")
    if not ds.url:
        refuse_links(ds.root, ["sizes.json", *ds.shards, *map(sidecar_name, ds.shards)])
    return ds


def neighbour_captions(aligned: Dataset | Path | str, keys: set[str]) -> dict[str, str]:
    """{key: caption} of the aligned samples named in `keys`, read from the sidecars whose key range (the Parquet
    footer's statistics) can hold one of them: the pseudo-captions' neighbours. `aligned` is the dataset the user
    gave (--aligned); {} when a folder given by path cannot be opened."""
    if not isinstance(aligned, Dataset):
        try:
            aligned = open_dataset(aligned)
        except VlprepError:
            return {}
    ds = aligned
    found = {}
    for shard in ds.shards:
        if len(found) == len(keys):
            break
        side = ds.sidecar(shard)
        if not side.exists():
            continue
        pf = pq.ParquetFile(side)
        if not any(key_range_may_hold(pf, i, keys) for i in range(pf.metadata.num_row_groups)):
            continue
        table = pf.read(columns=["key", "caption"])
        for key, caption in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
            if key in keys:
                found[key] = caption
    return found


def key_range_may_hold(pf: pq.ParquetFile, group: int, keys: set[str]) -> bool:
    """Whether row group `group`'s key column may hold one of `keys` (True without statistics)."""
    column = pf.metadata.row_group(group).column(pf.schema_arrow.get_field_index("key"))
    stats = column.statistics
    if stats is None or not stats.has_min_max:
        return True
    return any(stats.min <= k <= stats.max for k in keys)


def drawn_drops(source, n: int, seed: int) -> list[dict]:
    """A seeded draw of up to n rows of a filter's dropped.parquet (`source`: its path or open file; {key, shard,
    rule, detail}, in file order), streamed a batch at a time."""
    pf = pq.ParquetFile(source)
    if not set(DROPPED_COLUMNS) <= set(pf.schema_arrow.names):
        return []
    total = pf.metadata.num_rows
    picks = set(int(i) for i in np.random.default_rng(seed).choice(total, size=min(n, total), replace=False))
    rows = []
    start = 0
    for batch in pf.iter_batches(batch_size=1 << 16, columns=list(DROPPED_COLUMNS)):
        for i in sorted(p - start for p in picks if start <= p < start + batch.num_rows):
            rows.append({c: batch.column(c)[i].as_py() for c in DROPPED_COLUMNS})
        start += batch.num_rows
    return rows


def dropped_records(ds: Dataset, source: Dataset | None, n: int, seed: int, out: Path, side: int,
                    not_read: list[str]) -> list[dict]:
    """Cards of a draw of the samples a filter dropped, each with its `dropped` rule and detail, read from `source`,
    the filter's input as the user gave it (--input; None: cards without image or caption)."""
    if ds.url and not (ds.root / "dropped.parquet").exists():
        with contextlib.suppress(objstore.RemoteNotFound):
            objstore.get_file(objstore.join(ds.url, "dropped.parquet"), ds.root / "dropped.parquet")
    f = open_file(ds.root, ("dropped.parquet",), not_read)
    if f is None:
        return []
    with f:
        rows = drawn_drops(f, n, seed)
    samples = {}
    for shard in dict.fromkeys(r["shard"] for r in rows):
        if source is None or shard not in source.sizes:  # a shard name of the given dataset, never a path of the rows
            continue
        wanted = {r["key"] for r in rows if r["shard"] == shard}
        keys = source.column(shard, "key")
        positions = [i for i, k in enumerate(keys) if k in wanted]
        for index, raw in read_picked(source.tar(shard), positions, source.sizes[shard]) if positions else ():
            samples[raw["__key__"]] = (shard, index, raw)
    records = []
    for r in rows:
        shard, index, raw = samples.get(r["key"], (r["shard"], -1, {"__key__": r["key"]}))
        rec = card(raw, shard, index, out, side, {})
        rec["dropped"] = {"rule": r["rule"], "detail": r["detail"]}
        records.append(rec)
    return records


def card(raw: dict, shard: str, index: int, out: Path, side: int, onto: dict) -> dict:
    """A sample's record for the page, its thumbnail written to OUT/thumbs/ (`thumb` None when it has no image
    that decodes); `onto` is an ontology stage's ontology.json, else {}."""
    ext = next((e for e in IMAGE_EXTS if e in raw), None)
    thumb = None
    if ext is not None:
        name = thumb_name(raw["__key__"])
        size = write_thumb(raw[ext], out / "thumbs" / name, side)
        thumb = size and {"src": f"thumbs/{name}", "w": size[0], "h": size[1]}
    return sample_record(raw, shard, index, thumb, onto)


def copy_figures(ds: Dataset, out: Path, not_read: list[str]) -> list[dict]:
    """The stages' PNG figures of a local dataset (pmi_heatmap.png, clip_score.png, ...) and `vlprep stats`' default
    stats/stats.png, copied into OUT/figures/ when they are regular files reached through no link (the others named in
    `not_read`): [{src, name}] for the page."""
    if ds.url:
        return []
    found = [(p.name,) for p in sorted(ds.root.glob("*.png"))] + [("stats", "stats.png")]
    figures = []
    (out / "figures").mkdir(exist_ok=True)
    for parts in found:
        name = parts[-1]
        if not FIGURE_NAME.fullmatch(name) or (out / "figures" / name).exists():
            continue
        f = open_file(ds.root, parts, not_read)
        if f is None:
            continue
        with f:
            data = f.read(MAX_FIGURE_BYTES + 1)
        if len(data) > MAX_FIGURE_BYTES:
            not_read.append(f"{'/'.join(parts)} (over {MAX_FIGURE_BYTES >> 20} MiB)")
            continue
        write_file(out / "figures" / name, data)
        figures.append({"src": f"figures/{name}", "name": "/".join(parts)})
    return figures


def named(meta: dict, field: str) -> str:
    """What meta.json names as `field` (a location, never opened), as shown."""
    return shown(meta[field]) if isinstance(meta.get(field), str) else "none"


def build_view(cfg: ViewConfig) -> dict:
    """Write OUT/index.html and OUT/thumbs/ for a draw of cfg.samples samples; the summary (counts, OUT, and what was
    left out: `not_read`, the dataset's files not read as `name (why)`, and `notes`, the options that would show
    more)."""
    cfg.validate()
    ds = open_dataset(cfg.dataset)
    out = Path(cfg.out) if cfg.out is not None else local_or_url(cfg.dataset) / "view"
    if not ds.url:
        refuse_links(ds.root, ["sizes.json", *ds.shards])
    upstream = given(cfg.input, "--input", out)
    aligned = given(cfg.aligned, "--aligned", out)
    not_read: list[str] = []
    meta = read_json(ds.root, "meta.json", not_read)
    stage = meta.get("stage", "")
    if aligned is not None and stage != "pseudolabel":
        what = f"a {shown(stage)} output" if isinstance(stage, str) and stage else "of no known stage"
        raise VlprepError(f"--aligned is for a pseudolabel output; {ds.location} is {what}")
    prepare_out(out, ds)
    onto = small_file(ds, "ontology.json", not_read) if stage == "ontology" else {}
    records = []
    undecodable = 0
    for shard, positions in draw(ds, cfg.samples, cfg.seed).items():
        for index, raw in read_picked(ds.tar(shard), positions, ds.sizes[shard]):
            records.append(card(raw, shard, index, out, cfg.thumb, onto))
            undecodable += records[-1]["thumb"] is None
    bad_json = sum(1 for r in records if r.get("bad_json"))
    notes = []
    wanted = {k for r in records for k in r.get("neighbours") or () if isinstance(k, str)}
    if wanted and aligned is not None:
        captions = neighbour_captions(aligned, wanted)
        for r in records:
            r["neighbour_captions"] = [captions.get(k) for k in r.get("neighbours") or ()]
    elif wanted:
        notes.append("the neighbours' captions are not shown: pass --aligned DATASET, the pseudolabel's aligned "
                     f"dataset (meta.json names {named(meta, 'aligned')})")
    shown_n = len(records)
    if stage == "filter":
        records += dropped_records(ds, upstream, cfg.samples, cfg.seed, out, cfg.thumb, not_read)
        if upstream is None and len(records) > shown_n:
            notes.append("the dropped samples are shown without image or caption: pass --input DATASET, the "
                         f"filter's input (meta.json names {named(meta, 'input')})")
    figures = copy_figures(ds, out, not_read)
    report = small_file(ds, "report.json", not_read)
    up = (upstream.location, read_json(upstream.root, "meta.json", [])) if upstream is not None else None
    info = {"dataset": ds.location, "stage": stage, "total": ds.num_samples,
            "shown": shown_n, "dropped_shown": len(records) - shown_n, "seed": cfg.seed, "shards": len(ds.shards),
            "lineage": lineage(ds.location, meta, up), "report": report, "figures": figures,
            "notes": ([f"left out: {', '.join(not_read)}"] if not_read else []) + notes}
    write_file(out / "index.html", render_page(info, records).encode("utf-8"))
    return {"out": str(out), "samples": shown_n, "dropped": len(records) - shown_n, "total": ds.num_samples,
            "no_image": undecodable, "bad_json": bad_json, "not_read": not_read, "notes": notes}

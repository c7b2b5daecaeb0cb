"""`vlprep view`: a static HTML page of N samples of a dataset, drawn across its shards by a seeded, stratified draw
and read alone (member headers are scanned up to the last drawn sample of a shard; no other payload is read)."""

import contextlib
import hashlib
import http.server
import io
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from PIL import Image

from vlprep import VlprepError, objstore, urls
from vlprep.dataset import (IMAGE_EXTS, _META, Dataset, _check_member, as_rgb, local_or_url, open_dataset,
                            short_shard)
from vlprep.tario import TarReader
from vlprep.viewpage import lineage, render_page, sample_record

MAX_SAMPLES = 100_000  # every drawn sample is a card and a thumbnail in one page
READ_EXTS = frozenset(("txt", "json") + IMAGE_EXTS)
MARKER = ".vlprep-view"  # marks a folder `vlprep view` wrote, which a later view may replace
FIGURE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.png")  # a plain file name, safe in a URL and a folder
MAX_FIGURE_BYTES = 32 << 20
DROPPED_COLUMNS = ("key", "shard", "rule", "detail")  # of a filter's dropped.parquet (docs/FILTER.md)


@dataclass
class ViewConfig:
    dataset: Path | str
    out: Path | None = None  # default: DATASET/view (a URL DATASET needs one)
    samples: int = 200
    seed: int = 0
    thumb: int = 256  # the longer side of a thumbnail, in pixels
    port: int | None = None  # --serve's port, checked before anything is written

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
    """Make OUT ready: new, empty, or a page `vlprep view` wrote (its thumbnails are replaced); never the dataset."""
    root = ds.root.resolve()
    if not ds.url and (out.resolve() == root or root.is_relative_to(out.resolve())):
        raise VlprepError(f"--out {out} is (or holds) the dataset folder; give another folder")
    if out.exists() and not out.is_dir():
        raise VlprepError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise VlprepError(f"--out {out} holds files that `vlprep view` did not write; give an empty or new folder")
    for old in ("thumbs", "figures"):
        if (out / old).is_dir():
            shutil.rmtree(out / old)
    (out / "thumbs").mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by vlprep view\n")


def read_json(path: Path) -> dict:
    """A small JSON file of the dataset as a dict; {} when it is missing or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def small_file(ds: Dataset, name: str) -> dict:
    """A small JSON file beside the shards (report.json, ontology.json) as a dict, fetched into a remote dataset's
    mirror first; {} when there is none."""
    if ds.url and not (ds.root / name).exists():
        with contextlib.suppress(objstore.RemoteNotFound):
            objstore.get_file(objstore.join(ds.url, name), ds.root / name)
    return read_json(ds.root / name)


def neighbour_captions(aligned, keys: set[str]) -> dict[str, str]:
    """{key: caption} of the aligned samples named in `keys`, read from the sidecars whose key range (the Parquet
    footer's statistics) can hold one of them: the pseudo-captions' neighbours. {} when the folder cannot be read."""
    try:
        ds = open_dataset(aligned)
    except VlprepError:
        return {}
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


def drawn_drops(path: Path, n: int, seed: int) -> list[dict]:
    """A seeded draw of up to n rows of a filter's dropped.parquet ({key, shard, rule, detail}, in file order),
    streamed a batch at a time."""
    pf = pq.ParquetFile(path)
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


def dropped_records(ds: Dataset, src, n: int, seed: int, out: Path, side: int) -> list[dict]:
    """Cards of a draw of the samples a filter dropped, read from its input `src` (without thumbnails when the input
    cannot be opened), each with its `dropped` rule and detail."""
    if ds.url and not (ds.root / "dropped.parquet").exists():
        with contextlib.suppress(objstore.RemoteNotFound):
            objstore.get_file(objstore.join(ds.url, "dropped.parquet"), ds.root / "dropped.parquet")
    if not (ds.root / "dropped.parquet").is_file():
        return []
    rows = drawn_drops(ds.root / "dropped.parquet", n, seed)
    try:
        source = open_dataset(src) if isinstance(src, str) else None
    except VlprepError:
        source = None
    samples = {}
    for shard in dict.fromkeys(r["shard"] for r in rows):
        if source is None or shard not in source.sizes:
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


def copy_figures(ds: Dataset, out: Path) -> list[dict]:
    """The stages' PNG figures of a local dataset (pmi_heatmap.png, clip_score.png, ...) and `vlprep stats`' default
    stats/stats.png, copied into OUT/figures/: [{src, name}] for the page."""
    if ds.url:
        return []
    found = sorted(ds.root.glob("*.png")) + [ds.root / "stats" / "stats.png"]
    figures = []
    (out / "figures").mkdir(exist_ok=True)
    for path in found:
        name = "stats.png" if path.parent.name == "stats" else path.name
        if not FIGURE_NAME.fullmatch(name) or not path.is_file() or path.stat().st_size > MAX_FIGURE_BYTES:
            continue
        shutil.copyfile(path, out / "figures" / name)
        figures.append({"src": f"figures/{name}", "name": str(path.relative_to(ds.root))})
    return figures


def build_view(cfg: ViewConfig) -> dict:
    """Write OUT/index.html and OUT/thumbs/ for a draw of cfg.samples samples; the summary (counts, OUT)."""
    cfg.validate()
    ds = open_dataset(cfg.dataset)
    out = Path(cfg.out) if cfg.out is not None else local_or_url(cfg.dataset) / "view"
    prepare_out(out, ds)
    meta = read_json(ds.root / "meta.json")
    onto = small_file(ds, "ontology.json") if meta.get("stage") == "ontology" else {}
    records = []
    undecodable = 0
    for shard, positions in draw(ds, cfg.samples, cfg.seed).items():
        for index, raw in read_picked(ds.tar(shard), positions, ds.sizes[shard]):
            records.append(card(raw, shard, index, out, cfg.thumb, onto))
            undecodable += records[-1]["thumb"] is None
    wanted = {k for r in records for k in r.get("neighbours") or () if isinstance(k, str)}
    if wanted and isinstance(meta.get("aligned"), str):
        captions = neighbour_captions(meta["aligned"], wanted)
        for r in records:
            r["neighbour_captions"] = [captions.get(k) for k in r.get("neighbours") or ()]
    shown = len(records)
    if meta.get("stage") == "filter":
        records += dropped_records(ds, meta.get("input"), cfg.samples, cfg.seed, out, cfg.thumb)
    info = {"dataset": ds.location, "stage": meta.get("stage", ""), "total": ds.num_samples,
            "shown": shown, "dropped_shown": len(records) - shown, "seed": cfg.seed, "shards": len(ds.shards),
            "lineage": lineage(ds.location, meta, ds.url is None), "report": small_file(ds, "report.json"),
            "figures": copy_figures(ds, out)}
    (out / "index.html").write_text(render_page(info, records), encoding="utf-8")
    return {"out": str(out), "samples": shown, "dropped": len(records) - shown, "total": ds.num_samples,
            "no_image": undecodable}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """http.server's file handler without a log line per request."""

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        pass


def make_server(out: Path, port: int) -> http.server.ThreadingHTTPServer:
    """An http.server on 127.0.0.1 serving the folder `out` (port 0: any free port)."""
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", port), partial(QuietHandler, directory=str(out)))
    except OSError as e:
        raise VlprepError(f"cannot serve on 127.0.0.1:{port} ({e.strerror or e}); give another --port, or --port 0 "
                          "for any free one") from None

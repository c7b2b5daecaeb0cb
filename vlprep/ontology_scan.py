"""`vlprep ontology`'s passes over the dataset in the driver, one shard at a time (docs/ONTOLOGY.md).

The driver never holds a list with an entry per sample of the dataset: each pass reads one shard's keys, detections
and cached nouns, folds them into counts the size of the vocabulary (PMI, triplets per class) or into the triplet
index's current row group, and moves on. Passes that need an earlier pass's result (the mapping needs the PMI of
every pair; the kept classes need every triplet's class) read the shards again instead of keeping them.
"""

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import Dataset, sidecar_name
from vlprep.output import Out, pull

# pq.write_table's default row group: triplets.parquet written one group at a time has the same
# bytes as the whole table written at once
ROW_GROUP_ROWS = 1024 * 1024
TRIPLET_SCHEMA = pa.schema([("key", pa.string()), ("index", pa.int64()), ("noun", pa.string()), ("start", pa.int32()),
                            ("end", pa.int32()), ("class", pa.string()), ("detected", pa.bool_())])


class Triplet(NamedTuple):
    """One row of triplets.parquet: a sample (key, index), a noun span of its caption, the noun's class."""

    key: str
    index: int
    noun: str
    start: int
    end: int
    cls: str          # the column `class`
    detected: bool    # the detector found `cls` in this image


def make_triplets(nouns: list[tuple[str, int, int]], mapping: dict[str, str],
                  labels: set[str] | None = None) -> list[tuple]:
    """(noun, start, end, class) per distinct mapped noun; with `labels`, only those whose class is among them."""
    out = []
    seen = set()
    for noun, start, end in nouns:
        cls = mapping.get(noun)
        if cls is not None and (labels is None or cls in labels) and noun not in seen:
            seen.add(noun)
            out.append((noun, start, end, cls))
    return out


def labels_of(objects: list[dict] | None, min_score: float) -> set[str]:
    """An image's object classes: the labels of its detections with score >= min_score."""
    return {o["label"] for o in (objects or []) if o["score"] >= min_score}


def nouns_file(out: Out, shard: str) -> Path:
    return out.root / "_nouns" / sidecar_name(shard)


def read_nouns(out: Out, shard: str) -> list[list[tuple[str, int, int]]]:
    pull(out, f"_nouns/{nouns_file(out, shard).name}")  # made on another machine (a URL OUT)
    return [[tuple(d.values()) for d in row] for row in pq.read_table(nouns_file(out, shard)).column(0).to_pylist()]


def check_detections(ds: Dataset) -> None:
    """A one-line error unless every sidecar has the detections column (its schema only is read)."""
    for shard in ds.shards:
        if "objects" not in pq.read_schema(ds.sidecar(shard)).names:
            raise VlprepError(f"{ds.root} has no detections (sidecar column 'objects'); run `vlprep detect` first")


def detected_labels(ds: Dataset, min_score: float) -> set[str]:
    """Every class detected with score >= min_score anywhere in the dataset."""
    found = set()
    for shard in ds.shards:
        for row in ds.column(shard, "objects"):
            found |= labels_of(row, min_score)
    return found


def shard_rows(ds: Dataset, out: Out, min_score: float) -> Iterator[tuple[list[str], list, list[set[str]]]]:
    """Per shard, in order: its sample keys, each caption's nouns and each image's classes (one shard in memory)."""
    for shard in ds.shards:
        t = pq.read_table(ds.sidecar(shard), columns=["key", "objects"])
        labels = [labels_of(row, min_score) for row in t.column("objects").to_pylist()]
        yield t.column("key").to_pylist(), read_nouns(out, shard), labels


def noun_label_pairs(ds: Dataset, out: Out, min_score: float) -> Iterator[tuple[list[str], set[str]]]:
    """(the caption's nouns, the image's classes) per sample, shard by shard: pmi_table's input."""
    for _, nouns, labels in shard_rows(ds, out, min_score):
        for ns, ls in zip(nouns, labels):
            yield [n for n, _, _ in ns], ls


def tally_triplets(ds: Dataset, out: Out, mapping: dict[str, str], min_score: float) -> tuple[Counter, Counter]:
    """Triplets per class under the rule `all` (every one) and `detected` (those whose class the image has)."""
    every = Counter()
    detected = Counter()
    for _, nouns, labels in shard_rows(ds, out, min_score):
        for ns, ls in zip(nouns, labels):
            for t in make_triplets(ns, mapping):
                every[t[3]] += 1
                if t[3] in ls:
                    detected[t[3]] += 1
    return every, detected


def write_triplets(path: Path, ds: Dataset, out: Out, mapping: dict[str, str], min_score: float,
                   detected_only: bool) -> int:
    """triplets.parquet from the (kept) mapping, shard by shard; returns how many samples have a triplet."""
    covered = 0
    index = 0
    with TripletWriter(path) as writer:
        for keys, nouns, labels in shard_rows(ds, out, min_score):
            rows = []
            for key, ns, ls in zip(keys, nouns, labels):
                mine = [Triplet(key, index, *t, t[3] in ls) for t in make_triplets(ns, mapping, ls if detected_only
                                                                                    else None)]
                covered += bool(mine)
                rows.extend(mine)
                index += 1
            writer.add(rows)
    return covered


class TripletWriter:
    """Triplet rows into a Parquet file in row groups of ROW_GROUP_ROWS, the bytes pq.write_table gives the whole."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.writer = pq.ParquetWriter(self.tmp, TRIPLET_SCHEMA)
        self.parts = [TRIPLET_SCHEMA.empty_table()]
        self.buffered = 0
        self.groups = 0

    def add(self, rows: list[Triplet]) -> None:
        cols = list(zip(*rows)) if rows else [[]] * len(TRIPLET_SCHEMA)
        self.parts.append(pa.table([pa.array(c, f.type) for c, f in zip(cols, TRIPLET_SCHEMA)], schema=TRIPLET_SCHEMA))
        self.buffered += len(rows)
        while self.buffered >= ROW_GROUP_ROWS:
            self._flush(ROW_GROUP_ROWS)

    def _flush(self, n: int) -> None:
        # one contiguous chunk per row group: the page splits then match a table built whole
        table = pa.concat_tables(self.parts).combine_chunks()
        self.writer.write_table(table.slice(0, n))
        self.parts = [table.slice(n)]
        self.buffered -= n
        self.groups += 1

    def __enter__(self) -> "TripletWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:
            self.writer.close()
            self.tmp.unlink(missing_ok=True)
            return
        if self.buffered or not self.groups:  # an empty index is one empty row group, as pq.write_table makes it
            self._flush(self.buffered)
        self.writer.close()
        self.tmp.replace(self.path)

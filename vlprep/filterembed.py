"""`vlprep filter`'s embedding rules: near duplicates, decontamination against eval sets, and the CLIP score.

docs/FILTER.md is the contract. Each rule is a dataset rule of vlprep.filter (`run(decision, code)`), run after the
exact dedups on the samples still kept, in this order: `NearDup`, `Exclude`, `ClipScore`. Their vectors come from
vlprep.filtervec (a `vlprep embed` output given, or made under OUT/_embed/ with the encoder object).
"""

import hashlib
import json
import math
import os
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa

from vlprep import VlprepError
from vlprep.dataset import image_ext, iter_samples, open_dataset
from vlprep.filterphash import eval_matches
from vlprep.filterscan import decode_image, input_signature, perceptual_hash, read_scan, rgb_hash
from vlprep.filtervec import (EMBED_DIR, QUERY_BATCH, Alive, Source, Vectors, check_exclude_embeddings,
                              check_given_vectors, embed_under, index_over, near_dup_greedy, places, range_hits)
from vlprep.output import write_json_atomic
from vlprep.urls import redact, redact_text


class NearDup:
    """--near-dup T: a sample within cosine T of an earlier kept sample is dropped (the greedy rule)."""

    name = "near_dup"
    scan = ("image",)  # the pixel decode finds the images embed could not read: bad_image drops them first

    def __init__(self, threshold: float, images: Source, kind: str = "auto"):
        self.threshold = threshold
        self.images = images
        self.kind = kind
        self.pairs: list[tuple[str, str, float]] = []  # (dropped key, kept key, cosine): the report's examples

    def run(self, d, code: int) -> None:
        vec = self.images.open(d.out, d.progress)
        alive = Alive(d, vec)
        dropped, partner, cos = near_dup_greedy(vec, alive.rows, self.threshold, self.kind)
        keys = vec.keys
        where = dict(zip(dropped.tolist(), zip(partner.tolist(), cos.tolist())))
        for (i, r), j in zip(alive.place(d, np.sort(dropped)), np.sort(dropped).tolist()):
            p, c = where[j]
            other = keys[int(alive.rows[p])].as_py()
            d.codes[i][r] = code
            d.details[(i, r)] = {"detail": f"cosine {c:.4f} with {other}", "match_key": other, "cosine": c}
            if len(self.pairs) < 24:
                self.pairs.append((keys[int(alive.rows[j])].as_py(), other, c))


def eval_hashes(evals: list[str], phash: bool = False) -> tuple[dict[bytes, tuple[int, str]], list]:
    """Every eval image's pixel hash (as --dedup image computes it) -> (which eval set, its key), the first kept;
    and per eval set the keys of its images that decode, with their pHashes (uint64; empty without `phash`)."""
    found = {}
    perceptual = []
    for e, path in enumerate(evals):
        hashes = []
        keys = []
        for raw in iter_samples(open_eval(path), decode=False):
            ext = image_ext(raw)
            _, _, why, rgb = decode_image(raw[ext] if ext else None, True)
            if why is None:
                found.setdefault(rgb_hash(rgb), (e, raw["__key__"]))
                keys.append(raw["__key__"])
                if phash:
                    hashes.append(perceptual_hash(rgb))
        perceptual.append((np.array(hashes, np.uint64), keys))
    return found, perceptual


def open_eval(path):
    """An --exclude dataset, or a one-line error."""
    try:
        return open_dataset(path)
    except VlprepError as e:
        raise VlprepError(redact_text(f"--exclude {path}: not a vlprep dataset ({e})")) from None


class Exclude:
    """--exclude DATASET...: drop a sample whose pixels equal an eval image's, or (with --phash D) whose pHash is
    within D of one's, or (with --near-dup T) within cosine T of one; every pair is kept for the report."""

    name = "exclude"

    def __init__(self, evals: list[str], threshold: float | None, images: Source | None, encoder, workers: int,
                 phash: int | None = None, vectors: list | None = None):
        self.evals = evals
        self.shown = [redact(e) for e in evals]  # as the report, meta.json and dropped.parquet name them
        self.threshold = threshold
        self.images = images
        self.encoder = encoder
        self.workers = workers
        self.phash = phash
        self.vectors = vectors  # --exclude-embeddings: each eval set's `vlprep embed` output, else None
        self.scan = ("image", "phash") if phash is not None else ("image",)
        self.hold = ("phash",) if phash is not None else ()
        self.pairs: list[dict] = []  # every (train key, eval set, eval key, cosine, distance) dropped, for the report

    def run(self, d, code: int) -> None:
        exact, perceptual = eval_hashes(self.evals, self.phash is not None)
        for i, shard in enumerate(d.shards):
            alive = np.flatnonzero(d.codes[i] == 0)
            if not alive.size:
                continue
            table = read_scan(d.out, shard, ["key", "image_full"])
            fulls = table.column(1)
            for r in alive.tolist():
                hit = exact.get(fulls[r].as_py())
                if hit is not None:
                    self._drop(d, code, i, r, table.column(0)[r].as_py(), hit[0], hit[1], None)
        del exact
        if self.phash is not None:
            for (i, r), key, e, eval_key, h in eval_matches(d, perceptual, self.phash):
                self._drop(d, code, i, r, key, e, eval_key, None, h)
        if self.threshold is not None:
            self._near(d, code, [keys for _, keys in perceptual])

    def _near(self, d, code: int, eval_keys: list[list[str]]) -> None:
        vec = self.images.open(d.out, d.progress)
        alive = Alive(d, vec)
        where = {}  # alive position -> (eval set, eval row, cosine): the first eval set that has a match
        names = []
        for e, path in enumerate(self.evals):
            name = "exclude-" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()  # by path, not place
            if self.vectors is not None:  # only the eval set's rows: a folder may hold other rows too
                ev = Vectors(self.vectors[e], "--exclude-embeddings")
                rows = check_covers(ev, eval_keys[e], path)
            else:
                ev = Vectors(embed_under(d.out, path, self.encoder, "image", name, self.workers, d.progress),
                             f"--exclude {redact(str(path))}")
                rows = np.arange(len(ev.keys))
            names.append(ev.keys.take(pa.array(rows)))
            index = index_over(ev, rows, "auto")
            for owner, ids, dist in range_hits(index, vec, alive.rows, self.threshold):
                for j, best in best_per_query(owner, dist):
                    where.setdefault(j, (e, int(ids[best]), float(dist[best])))
        # every eval set searched before any drop: the positions map to rows through the codes as Alive saw them
        positions = np.array(sorted(where), np.int64)
        for (i, r), j in zip(alive.place(d, positions), positions.tolist()):
            e, k, c = where[j]
            self._drop(d, code, i, r, vec.keys[int(alive.rows[j])].as_py(), e, names[e][k].as_py(), c)

    def _drop(self, d, code, i, r, key, e, eval_key, cos, distance=None) -> None:
        d.codes[i][r] = code
        how = "same pixels as" if cos is None else f"cosine {cos:.4f} with"
        how = how if distance is None else f"phash distance {distance} with"
        d.details[(i, r)] = {"detail": f"{how} {eval_key} of {self.shown[e]}", "match_key": eval_key,
                             "match_dataset": self.shown[e], "cosine": cos, "distance": distance}
        self.pairs.append({"key": key, "eval": self.shown[e], "eval_key": eval_key, "cosine": cos,
                           "distance": distance})


class ClipScore:
    """--clip-score-min S / --clip-score-top F: the cosine of each pair's image and caption vectors (DataComp)."""

    name = "clip_score"
    scan = ("image",)

    def __init__(self, least: float | None, top: float | None, images: Source, texts: Source):
        self.least = least
        self.top = top
        self.images = images
        self.texts = texts
        self.threshold = None  # the score a --clip-score-top run cut at (reported)
        self.lowest: list[tuple[str, float]] = []
        self.histogram: list[int] = []  # 40 bins over [-1, 1] of the scored samples
        self.cached = False  # whether the scores were read from OUT/_embed/clip_score.npy

    def run(self, d, code: int) -> None:
        every = self.every_score(d)
        counts = []
        for i, shard in enumerate(d.shards):
            alive = d.codes[i] == 0
            counts.append(int(alive.sum()))
            gap = np.flatnonzero(alive & np.isnan(every[i]))
            if gap.size:
                key = read_scan(d.out, shard, ["key"]).column(0)[int(gap[0])].as_py()
                raise VlprepError(f"clip score: no image or caption embedding for key {key!r} of shard {shard} "
                                  "(the embeddings must come from `vlprep embed` over SRC)")
        d.scores = every
        scores = np.concatenate([s[c == 0] for s, c in zip(every, d.codes)]) if every else np.zeros(0, np.float32)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n = len(scores)
        low = np.sort(np.argsort(scores, kind="stable")[:12])  # named before any drop: places() reads the codes
        named = {j: read_scan(d.out, d.shards[i], ["key"]).column(0)[r].as_py()
                 for (i, r), j in zip(places(d, starts, low), low.tolist())}
        self.lowest = sorted(((named[j], float(scores[j])) for j in named), key=lambda p: p[1])
        if self.top is not None:
            k = math.floor(Fraction(repr(self.top)) * n)
            order = np.argsort(-scores, kind="stable")  # highest first; equal scores in dataset order
            drop = np.zeros(n, bool)
            drop[order[k:]] = True
            self.threshold = float(scores[order[k - 1]]) if k else None
        else:
            drop = scores < np.float32(self.least)
            self.threshold = self.least
        positions = np.flatnonzero(drop)
        for (i, r), j in zip(places(d, starts, positions), positions.tolist()):
            d.codes[i][r] = code
            d.details[(i, r)] = {"detail": f"clip score {scores[j]:.4f}", "cosine": float(scores[j])}
        self.histogram = np.histogram(scores.astype(np.float64), bins=40, range=(-1.0, 1.0))[0].tolist()

    def every_score(self, d) -> list[np.ndarray]:
        """Per shard every sample's score (NaN without both vectors), read from OUT/_embed/clip_score.npy when
        it was saved from the same vectors and input, else computed (and saved, for a local OUT)."""
        img = self.images.open(d.out, d.progress)
        txt = self.texts.open(d.out, d.progress)
        ident = [img.identity, txt.identity, d.signature, d.shards, [len(c) for c in d.codes]]
        ident += [self.images.stamp(), self.texts.stamp()]
        fp = hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=16).hexdigest()
        cache = d.out.root / EMBED_DIR / "clip_score.npy" if d.out.url is None else None
        bounds = np.cumsum([0] + [len(c) for c in d.codes])
        if cache is not None and cache.is_file() and cache.with_suffix(".json").is_file():
            if json.loads(cache.with_suffix(".json").read_text()).get("fingerprint") == fp:
                self.cached = True
                flat = np.load(cache)
                return [flat[bounds[i]:bounds[i + 1]].copy() for i in range(len(d.codes))]
        every = []
        for i, shard in enumerate(d.shards):
            keys = read_scan(d.out, shard, ["key"]).column(0).combine_chunks()
            ri = img.rows(keys)
            rt = txt.rows(keys)
            ok = np.flatnonzero((ri >= 0) & (rt >= 0))
            s = np.full(len(keys), np.nan, np.float32)
            for b in range(0, ok.size, QUERY_BATCH):
                rows = ok[b:b + QUERY_BATCH]
                s[rows] = cosines(img.x[ri[rows]], txt.x[rt[rows]])
            every.append(s)
        if cache is not None:
            cache.parent.mkdir(exist_ok=True)
            with open(cache.with_name(cache.name + ".tmp"), "wb") as f:  # np.save on a name would add .npy
                np.save(f, np.concatenate(every) if every else np.zeros(0, np.float32))
            os.replace(cache.with_name(cache.name + ".tmp"), cache)
            write_json_atomic(cache.with_suffix(".json"), {"fingerprint": fp})
        return every


def best_per_query(owner: np.ndarray, dist: np.ndarray) -> list[tuple[int, int]]:
    """(query, hit index) of each query's most similar hit, the first in hit order on equal cosines: one sort, not a
    pass over every hit per query (a heavily contaminated batch has thousands of queries with hits)."""
    order = np.lexsort((np.arange(len(owner)), -dist, owner))
    if not len(order):
        return []
    lead = order[np.r_[True, owner[order][1:] != owner[order][:-1]]]
    return list(zip(owner[lead].tolist(), lead.tolist()))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two (B, E) arrays, in float64, rounded once to float32."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).astype(np.float32)


def check_covers(ev: Vectors, keys: list[str], path) -> np.ndarray:
    """The rows of an --exclude-embeddings output for the eval images that decode; a one-line error unless it has
    every one."""
    rows = ev.rows(pa.array(keys, pa.string())) if keys else np.zeros(0, np.int64)
    missing = int((rows < 0).sum())
    if missing:
        raise VlprepError(f"{ev.flag}: no embedding for {missing} of the {len(keys)} images of --exclude "
                          f"{redact(str(path))} (make it with `vlprep embed` over that eval set)")
    return rows


def build_embed_rules(cfg, encoder, warn: Callable[[str], None] = lambda line: None) -> tuple[list, dict]:
    """The embedding rules in their fixed order (near_dup, exclude, clip_score) and the options meta.json records."""
    t = cfg.near_dup
    if t is not None and not 0 < t <= 1:
        raise VlprepError(f"--near-dup is a cosine threshold in (0, 1], got {t:g}")
    if cfg.clip_score_min is not None and cfg.clip_score_top is not None:
        raise VlprepError("--clip-score-min and --clip-score-top are two ways to set one threshold: give one")
    if cfg.clip_score_min is not None and not -1 <= cfg.clip_score_min <= 1:
        raise VlprepError(f"--clip-score-min is a cosine in [-1, 1], got {cfg.clip_score_min:g}")
    if cfg.clip_score_top is not None and not 0 < cfg.clip_score_top <= 1:
        raise VlprepError(f"--clip-score-top is a fraction in (0, 1], got {cfg.clip_score_top:g}")
    clip = cfg.clip_score_min is not None or cfg.clip_score_top is not None
    if (cfg.embeddings or cfg.text_embeddings) and encoder is not None:
        raise VlprepError("give --embeddings/--text-embeddings or --checkpoint, not both")
    if t is not None and cfg.embeddings is None and encoder is None:
        raise VlprepError("--near-dup needs image embeddings: --embeddings EMB (a `vlprep embed` output over SRC) "
                          "or --checkpoint CKPT")
    if clip and encoder is None and (cfg.embeddings is None or cfg.text_embeddings is None):
        raise VlprepError("--clip-score-min/--clip-score-top need --checkpoint CKPT, or --embeddings and "
                          "--text-embeddings (`vlprep embed --modality image` and `--modality text` over SRC)")
    check_exclude_embeddings(cfg, encoder)
    if cfg.exclude and t is not None and encoder is None and not cfg.exclude_embeddings:
        raise VlprepError("--exclude with --near-dup embeds the eval images, so it needs --checkpoint (the encoder "
                          "that made --embeddings), or their `vlprep embed` outputs as --exclude-embeddings")
    for path in cfg.exclude:
        open_eval(path)
    check_given_vectors(cfg, warn)
    src = cfg.src
    images = (Source("image", cfg.embeddings, encoder, src, cfg.workers, cfg.distributor)
              if (cfg.embeddings or encoder) else None)
    texts = Source("text", cfg.text_embeddings, encoder, src, cfg.workers, cfg.distributor) if clip else None
    rules = []
    if t is not None:
        rules.append(NearDup(t, images))
    if cfg.exclude:
        rules.append(Exclude([str(p) for p in cfg.exclude], t, images, encoder, cfg.workers, cfg.phash,
                             [Path(p) for p in cfg.exclude_embeddings] or None))
    if clip:
        rules.append(ClipScore(cfg.clip_score_min, cfg.clip_score_top, images, texts))
    options = {"near_dup": t, "exclude": [redact(str(p)) for p in cfg.exclude], "clip_score_min": cfg.clip_score_min,
               "clip_score_top": cfg.clip_score_top,
               "exclude_embeddings": [redact(str(p)) for p in cfg.exclude_embeddings] or None}
    if images is not None and rules:
        options["image_vectors"] = images.identity()
    if texts is not None:
        options["text_vectors"] = texts.identity()
    return rules, options


def exclude_signatures(evals: list[str]) -> dict[str, str]:
    """Each eval set's signature (its sidecars' bytes and tar sizes), so meta.json says which eval data was used."""
    return {redact(str(p)): input_signature(open_eval(p))[1] for p in evals}


def vectors_identity(rules: list) -> dict:
    """The opened vectors' identities (rows, dim, keys' hash, encoder), once the rules have run."""
    found = {}
    for rule in rules:
        for src in (getattr(rule, "images", None), getattr(rule, "texts", None)):
            if src is not None and src.vectors is not None:
                found[src.modality] = src.vectors.identity
    return found

"""`vlprep filter`'s embedding rules: near duplicates, decontamination against eval sets, and the CLIP score.

docs/FILTER.md is the contract. Each rule is a dataset rule of vlprep.filter (`run(decision, code)`), run after the
exact dedups on the samples still kept. Vectors come from `vlprep embed` outputs (embeddings.npy, memory-mapped, and
keys.parquet), given (`--embeddings`, `--text-embeddings`) or made under OUT/_embed/ with an encoder object (the CLI's
`--checkpoint`). The driver holds per sample a 64-bit hash of each vector's key, its sort order and the row a sample's
vector is in (8 bytes each), one bit to a byte of state, and FAISS' copy of the vectors; never a Python object.
"""

import hashlib
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import open_dataset, iter_samples, image_ext
from vlprep.filterscan import image_attributes, read_scan

QUERY_BATCH = 4096  # range-search queries per FAISS call: bounds the result buffers, whatever N is
KEY_CHUNK = 4096  # keys hashed at a time: the Python strings of one chunk at most
EMBED_DIR = "_embed"


def key_hashes(keys: pa.Array) -> np.ndarray:
    """blake2b-64 of each key (uint64), computed a chunk at a time."""
    out = np.empty(len(keys), np.uint64)
    for s in range(0, len(keys), KEY_CHUNK):
        part = keys.slice(s, KEY_CHUNK).to_pylist()
        out[s:s + len(part)] = [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little")
                                for k in part]
    return out


class Vectors:
    """A `vlprep embed` output opened for lookups: keys (Arrow), rows memory-mapped, key hashes sorted."""

    def __init__(self, folder: Path, flag: str):
        folder = Path(folder)
        if not (folder / "embeddings.npy").is_file() or not (folder / "keys.parquet").is_file():
            raise VlprepError(f"{flag} {folder}: not a `vlprep embed` output (needs embeddings.npy and keys.parquet)")
        self.flag = f"{flag} {folder}"
        self.keys = pq.read_table(folder / "keys.parquet", columns=["key"]).column(0).combine_chunks()
        self.x = np.load(folder / "embeddings.npy", mmap_mode="r")
        if self.x.ndim != 2 or len(self.x) != len(self.keys):
            raise VlprepError(f"{self.flag}: embeddings.npy has shape {self.x.shape}, keys.parquet {len(self.keys)} rows")
        hashes = key_hashes(self.keys)
        self.order = np.argsort(hashes, kind="stable")
        hashes.sort()  # in place: equal hashes are equal values, so this is hashes[order] without a second array
        self.sorted = hashes
        meta = folder / "meta.json"
        info = json.loads(meta.read_text()) if meta.is_file() else {}
        self.identity = {"folder": str(folder), "rows": len(self.keys), "dim": int(self.x.shape[1]),
                         "keys_blake2b": hashlib.blake2b((folder / "keys.parquet").read_bytes(),
                                                         digest_size=16).hexdigest(),
                         "encoder": info.get("encoder"), "modality": (info.get("options") or {}).get("modality")}

    def rows(self, keys: pa.Array) -> np.ndarray:
        """Each key's row (the first if repeated), -1 where it has none; a 64-bit hash match is checked exactly."""
        if not len(self.sorted):
            return np.full(len(keys), -1, np.int64)
        h = key_hashes(keys)
        pos = np.minimum(np.searchsorted(self.sorted, h), len(self.sorted) - 1)
        rows = np.where(self.sorted[pos] == h, self.order[pos], -1).astype(np.int64)
        found = np.flatnonzero(rows >= 0)
        if found.size:
            same = pc.equal(self.keys.take(pa.array(rows[found])), keys.take(pa.array(found))).to_numpy(False)
            rows[found[~same]] = -1
        return rows

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows as contiguous float32, L2-normalised (a no-op up to rounding for vlprep embed's own output)."""
        x = np.asarray(self.x[rows], dtype=np.float32)
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        return np.ascontiguousarray(x / np.maximum(norm, np.float32(1e-12)))


class Source:
    """Where a modality's vectors come from: a given folder, or made under OUT/_embed/ by the encoder (once)."""

    def __init__(self, modality: str, folder: Path | None, encoder, src, workers: int):
        self.modality = modality
        self.folder = folder
        self.encoder = encoder
        self.src = src
        self.workers = workers
        self.vectors: Vectors | None = None

    def open(self, out, progress=None) -> Vectors:
        if self.vectors is None:
            folder = self.folder
            flag = "--embeddings" if self.modality == "image" else "--text-embeddings"
            if folder is None:
                folder = embed_under(out, self.src, self.encoder, self.modality, self.modality, self.workers, progress)
                flag = "--checkpoint"
            self.vectors = Vectors(folder, flag)
        return self.vectors

    def identity(self) -> dict:
        if self.folder is not None:
            return {"embeddings": str(self.folder)}
        return {"checkpoint": self.encoder.name, "fingerprint": self.encoder.fingerprint}


def embed_under(out, src, encoder, modality: str, name: str, workers: int, progress=None) -> Path:
    """`vlprep embed` of SRC into OUT/_embed/NAME with the encoder (a re-run resumes there, so nothing is encoded twice)."""
    from vlprep.embed import EmbedConfig, embed

    if out.url is not None:
        raise VlprepError("--checkpoint embeds into OUT/_embed/, which needs a local OUT; run `vlprep embed` and "
                          "give --embeddings (and --text-embeddings) instead")
    folder = out.root / EMBED_DIR / name
    folder.parent.mkdir(exist_ok=True)
    embed(EmbedConfig(src=src, out=folder, modality=modality, workers=workers), encoder, progress=progress)
    return folder


class Alive:
    """The samples the earlier rules kept, in dataset order: their vector rows (8 bytes each) and per-shard counts."""

    def __init__(self, d, vec: Vectors):
        self.counts = []
        parts = []
        for i, shard in enumerate(d.shards):
            mask = d.codes[i] == 0
            self.counts.append(int(mask.sum()))
            if not mask.any():
                continue
            keys = read_scan(d.out, shard, ["key"]).column(0).combine_chunks().filter(pa.array(mask))
            rows = vec.rows(keys)
            missing = np.flatnonzero(rows < 0)
            if missing.size:
                raise VlprepError(f"{vec.flag}: no embedding for key {keys[int(missing[0])].as_py()!r} of shard "
                                  f"{shard} (the embeddings must come from `vlprep embed` over SRC)")
            parts.append(rows)
        self.rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    def place(self, d, positions: np.ndarray):
        """(shard index, row) of each alive position, in order of the positions given."""
        for i in range(len(d.shards)):
            here = positions[(positions >= self.starts[i]) & (positions < self.starts[i + 1])]
            if here.size:
                local = np.flatnonzero(d.codes[i] == 0)
                yield from ((i, int(r)) for r in local[here - self.starts[i]])


def _radius(threshold: float) -> float:
    # FAISS keeps inner products above the radius; one float32 step lower, then `>= threshold` decides exactly
    return float(np.nextafter(np.float32(threshold), np.float32(-np.inf)))


def index_over(vec: Vectors, rows: np.ndarray, kind: str):
    """A CPU inner-product index over the given rows (flat or IVF as vlprep.knn chooses), added a batch at a time."""
    from vlprep.knn import DEFAULT_NPROBE, IndexBuilder, set_nprobe

    builder = IndexBuilder(kind, len(rows), vec.x.shape[1])
    for s in range(0, len(rows), QUERY_BATCH):
        builder.add(vec.gather(rows[s:s + QUERY_BATCH]))
    index = builder.finish()
    set_nprobe(index, DEFAULT_NPROBE)
    return index


def near_dup_greedy(vec: Vectors, rows: np.ndarray, threshold: float, kind: str = "auto"):
    """The greedy rule over positions 0..n-1 (rows[j] is position j's vector): j is dropped when an earlier KEPT
    position i < j has cosine >= threshold. Returns (dropped positions, the most similar such i, its cosine)."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    index = index_over(vec, rows, kind)
    keep = np.ones(n, bool)
    t = np.float32(threshold)
    found = ([], [], [])
    for s in range(0, n, QUERY_BATCH):
        q = vec.gather(rows[s:s + QUERY_BATCH])
        lims, dist, ids = index.range_search(q, _radius(threshold))
        owner = s + np.repeat(np.arange(len(q)), np.diff(lims).astype(np.int64))
        hit = (ids < owner) & (dist >= t)
        owner = owner[hit]
        ids = ids[hit]
        dist = dist[hit]
        if not owner.size:
            continue
        order = np.lexsort((ids, owner))  # a query's earlier neighbours in position order
        owner = owner[order]
        ids = ids[order]
        dist = dist[order]
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        ends = np.r_[starts[1:], owner.size]
        for a, b in zip(starts.tolist(), ends.tolist()):  # in position order: a drop here decides later queries
            kept = keep[ids[a:b]]
            if kept.any():
                j = int(owner[a])
                keep[j] = False
                best = a + int(np.argmax(np.where(kept, dist[a:b], -np.inf)))  # first of the highest: earliest
                found[0].append(j)
                found[1].append(int(ids[best]))
                found[2].append(float(dist[best]))
    return (np.array(found[0], np.int64), np.array(found[1], np.int64), np.array(found[2], np.float32))


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


def eval_hashes(evals: list[str]) -> dict[bytes, tuple[int, str]]:
    """Every eval image's pixel hash (as --dedup image computes it) -> (which eval set, its key); the first kept."""
    found = {}
    for e, path in enumerate(evals):
        for raw in iter_samples(open_eval(path), decode=False):
            ext = image_ext(raw)
            _, _, why, full = image_attributes(raw[ext] if ext else None, True)
            if why is None:
                found.setdefault(full, (e, raw["__key__"]))
    return found


def open_eval(path):
    """An --exclude dataset, or a one-line error."""
    try:
        return open_dataset(path)
    except VlprepError as e:
        raise VlprepError(f"--exclude {path}: not a vlprep dataset ({e})") from None


class Exclude:
    """--exclude DATASET...: drop a sample whose pixels equal an eval image's, or (with --near-dup T) within T of one."""

    name = "exclude"
    scan = ("image",)

    def __init__(self, evals: list[str], threshold: float | None, images: Source | None, encoder, workers: int):
        self.evals = evals
        self.threshold = threshold
        self.images = images
        self.encoder = encoder
        self.workers = workers
        self.pairs: list[dict] = []  # every (train key, eval set, eval key, cosine) dropped, for the report

    def run(self, d, code: int) -> None:
        exact = eval_hashes(self.evals)
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
        if self.threshold is not None:
            self._near(d, code)

    def _near(self, d, code: int) -> None:
        vec = self.images.open(d.out, d.progress)
        alive = Alive(d, vec)
        t = np.float32(self.threshold)
        for e, path in enumerate(self.evals):
            ev = Vectors(embed_under(d.out, path, self.encoder, "image", f"exclude{e}", self.workers, d.progress),
                         f"--exclude {path}")
            index = index_over(ev, np.arange(len(ev.keys)), "auto")
            hits = []
            for s in range(0, len(alive.rows), QUERY_BATCH):
                lims, dist, ids = index.range_search(vec.gather(alive.rows[s:s + QUERY_BATCH]),
                                                     _radius(self.threshold))
                owner = s + np.repeat(np.arange(len(lims) - 1), np.diff(lims).astype(np.int64))
                ok = dist >= t
                for j in np.unique(owner[ok]).tolist():
                    m = ok & (owner == j)
                    best = np.flatnonzero(m)[np.argmax(dist[m])]
                    hits.append((j, int(ids[best]), float(dist[best])))
            where = {j: (k, c) for j, k, c in hits}
            positions = np.array(sorted(where), np.int64)
            for (i, r), j in zip(alive.place(d, positions), positions.tolist()):
                if d.codes[i][r] == 0:  # not taken by an exact match or an earlier eval set
                    k, c = where[j]
                    self._drop(d, code, i, r, vec.keys[int(alive.rows[j])].as_py(), e, ev.keys[k].as_py(), c)

    def _drop(self, d, code, i, r, key, e, eval_key, cos) -> None:
        d.codes[i][r] = code
        how = "same pixels as" if cos is None else f"cosine {cos:.4f} with"
        d.details[(i, r)] = {"detail": f"{how} {eval_key} of {self.evals[e]}", "match_key": eval_key,
                             "match_dataset": str(self.evals[e]), "cosine": cos}
        self.pairs.append({"key": key, "eval": str(self.evals[e]), "eval_key": eval_key, "cosine": cos})


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

    def run(self, d, code: int) -> None:
        img = self.images.open(d.out, d.progress)
        txt = self.texts.open(d.out, d.progress)
        a_img = Alive(d, img)
        a_txt = Alive(d, txt)
        n = len(a_img.rows)
        scores = np.empty(n, np.float32)
        for s in range(0, n, QUERY_BATCH):
            scores[s:s + QUERY_BATCH] = cosines(img.x[a_img.rows[s:s + QUERY_BATCH]],
                                                txt.x[a_txt.rows[s:s + QUERY_BATCH]])
        d.scores = [np.full(len(c), np.nan, np.float32) for c in d.codes]
        for i in range(len(d.shards)):
            d.scores[i][d.codes[i] == 0] = scores[a_img.starts[i]:a_img.starts[i + 1]]
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
        for (i, r), j in zip(a_img.place(d, positions), positions.tolist()):
            d.codes[i][r] = code
            d.details[(i, r)] = {"detail": f"clip score {scores[j]:.4f}", "cosine": float(scores[j])}
        low = np.argsort(scores, kind="stable")[:12]
        self.lowest = [(img.keys[int(a_img.rows[j])].as_py(), float(scores[j])) for j in low.tolist()]
        self.histogram = np.histogram(scores.astype(np.float64), bins=40, range=(-1.0, 1.0))[0].tolist()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two (B, E) arrays, in float64, rounded once to float32."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (np.einsum("ij,ij->i", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).astype(np.float32)


def build_embed_rules(cfg, encoder) -> tuple[list, dict]:
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
    if cfg.exclude and t is not None and encoder is None:
        raise VlprepError("--exclude with --near-dup embeds the eval images, so it needs --checkpoint (the encoder "
                          "that made --embeddings)")
    for path in cfg.exclude:
        open_eval(path)
    for folder, flag in ((cfg.embeddings, "--embeddings"), (cfg.text_embeddings, "--text-embeddings")):
        if folder is not None and not ((Path(folder) / "embeddings.npy").is_file()
                                       and (Path(folder) / "keys.parquet").is_file()):
            raise VlprepError(f"{flag} {folder}: not a `vlprep embed` output (needs embeddings.npy and keys.parquet)")
    src = cfg.src
    images = Source("image", cfg.embeddings, encoder, src, cfg.workers) if (cfg.embeddings or encoder) else None
    texts = Source("text", cfg.text_embeddings, encoder, src, cfg.workers) if clip else None
    rules = []
    if t is not None:
        rules.append(NearDup(t, images))
    if cfg.exclude:
        rules.append(Exclude([str(p) for p in cfg.exclude], t, images, encoder, cfg.workers))
    if clip:
        rules.append(ClipScore(cfg.clip_score_min, cfg.clip_score_top, images, texts))
    options = {"near_dup": t, "exclude": [str(p) for p in cfg.exclude], "clip_score_min": cfg.clip_score_min,
               "clip_score_top": cfg.clip_score_top}
    if images is not None and rules:
        options["image_vectors"] = images.identity()
    if texts is not None:
        options["text_vectors"] = texts.identity()
    return rules, options


def exclude_signatures(evals: list[str]) -> dict[str, str]:
    """Each eval set's signature (its sidecars' bytes and tar sizes), so meta.json says which eval data was used."""
    from vlprep.filter import input_signature

    return {str(p): input_signature(open_eval(p))[1] for p in evals}


def vectors_identity(rules: list) -> dict:
    """The opened vectors' identities (rows, dim, keys' hash, encoder), once the rules have run."""
    found = {}
    for rule in rules:
        for src in (getattr(rule, "images", None), getattr(rule, "texts", None)):
            if src is not None and src.vectors is not None:
                found[src.modality] = src.vectors.identity
    return found



# --- the report and the figures -------------------------------------------------------------------------------------


def embed_report(report: dict, out, ds, rules: list) -> None:
    """The embedding rules' part of the report, and OUT/clip_score.png, near_dup.png, clip_score_low.png."""
    for rule in rules:
        if isinstance(rule, NearDup):
            report["near_dup"] = {"threshold": rule.threshold,
                                  "pairs": [{"key": a, "kept": b, "cosine": c} for a, b, c in rule.pairs]}
            if rule.pairs:
                cells = [cell for a, b, c in rule.pairs[:12] for cell in ((a, f"dropped, {c:.3f}"), (b, "kept"))]
                report["outputs"].append(image_grid(out.root / "near_dup.png", ds, cells,
                                                    f"near duplicates (cosine >= {rule.threshold:g}): dropped, kept"))
        elif isinstance(rule, Exclude):
            report["exclude"] = {"eval_sets": rule.evals, "pairs": rule.pairs}
        elif isinstance(rule, ClipScore):
            report["clip_score"] = {"min": rule.least, "top": rule.top, "threshold": rule.threshold,
                                    "histogram": {"range": [-1.0, 1.0], "bins": 40, "counts": rule.histogram},
                                    "lowest": [{"key": k, "clip_score": s} for k, s in rule.lowest]}
            report["outputs"].append(histogram_png(out.root / "clip_score.png", rule))
            if rule.lowest:
                cells = [(k, f"{s:.3f}") for k, s in rule.lowest]
                report["outputs"].append(image_grid(out.root / "clip_score_low.png", ds, cells,
                                                    "lowest clip scores (score, caption)", captions=True))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def histogram_png(path: Path, rule: ClipScore) -> str:
    """The scored samples' clip scores, with the threshold drawn."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.linspace(-1, 1, 41)
    ax.bar(edges[:-1], rule.histogram, width=edges[1] - edges[0], align="edge", color="tab:blue")
    if rule.threshold is not None:
        ax.axvline(rule.threshold, color="tab:red", label=f"threshold {rule.threshold:.4f}")
        ax.legend()
    ax.set(title="clip score (image-caption cosine) of the samples scored", xlabel="clip score", ylabel="samples")
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path.name


def image_grid(path: Path, ds, cells: list[tuple[str, str]], title: str, captions: bool = False) -> str:
    """A grid of the given keys' images (read from the shards that hold them), each with its label."""
    import textwrap

    from vlprep.dataset import decode_rgb, iter_tar

    plt = _pyplot()
    wanted = {k for k, _ in cells}
    images = {}
    texts = {}
    for shard in ds.shards:
        side = pq.read_table(ds.sidecar(shard), columns=["key", "caption"])
        here = wanted & set(side.column(0).to_pylist())
        if not here:
            continue
        texts.update((k, c) for k, c in zip(side.column(0).to_pylist(), side.column(1).to_pylist()) if k in here)
        for raw in iter_tar(ds.tar(shard)):
            if raw["__key__"] in here and image_ext(raw):
                im = decode_rgb(raw[image_ext(raw)])
                im.thumbnail((160, 160))
                images[raw["__key__"]] = im
    cols = 6
    rows = max(1, -(-len(cells) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 2.3, rows * 2.9), squeeze=False)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.03, top=0.92, wspace=0.12, hspace=0.5)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, (key, label) in zip(axes.ravel(), cells):
        if key in images:
            ax.imshow(images[key])
        lines = [f"{key}: {label}"] + (textwrap.wrap(texts.get(key) or "", 26)[:2] if captions else [])
        ax.text(0.5, -0.03, "\n".join(lines), transform=ax.transAxes, ha="center", va="top", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path.name

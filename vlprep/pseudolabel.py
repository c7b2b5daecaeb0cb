"""`vlprep pseudolabel`: pseudo bag-of-words captions for unaligned images (A Fistful of Words, sec. 2.3, Table 7).

docs/PSEUDOLABEL.md is the contract: S_a and its FAISS index (vlprep.knn), the crops behind NN_i
(vlprep.embed.crop_views), the words of a caption, the four strategies and their ties (`rank_words`), what is dropped
and counted, the output shards and sidecars, and when the saved index is reused.
"""

import fcntl
import hashlib
import os
import random
import time
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep import knn, objstore
from vlprep.bow import rmstop, top_tokens
from vlprep.dataset import BadJson, batches, check_shards, decode_json, iter_aligned, open_dataset, sidecar_name
from vlprep.embed import check_images, crop_views, decode, intact_captions
from vlprep.engine import Work, check_engine, map_shards, merged_skips
from vlprep.output import Out, check_out, finish_dataset, publish, write_json_atomic, write_shard, writing_output
from vlprep.text import tokenize
from vlprep.urls import redact

STRATEGIES = ("maxcount", "rmtopmaxcount", "rmtoprand", "weighted")
# json keys and sidecar columns about the input's caption(s), which the pseudo-caption replaces: bow's provenance, and
# a multi-caption sample's other captions (training would otherwise draw the input's captions instead of the pseudo one)
DROP_META = ("caption_raw", "bow", "captions", "captions_raw")


# --- word ranking (pure) ---------------------------------------------------------------------------


def caption_words(caption: str) -> frozenset[str]:
    """The candidate words of one caption: bow's tokens that survive bow's rmstop (alphabetic, not stop words)."""
    return frozenset(rmstop(tokenize(caption), None, None))


def top_words(aligned_df: Mapping[str, int], t: int) -> frozenset[str]:
    """The t words of highest document frequency, ties broken by the word (bow's RmTopFreq ranking)."""
    return frozenset(top_tokens(aligned_df, t))


def rank_counts(counts: Mapping[str, int], strategy: str, aligned_df: Mapping[str, int] | None = None,
                top: Collection[str] = frozenset(), p: int = 4, rng=None) -> list[str]:
    """`rank_words` from counts already made: counts[w] = count(w, NN_i); `top` is the set of words rmtop removes."""
    if strategy == "maxcount":
        order = sorted(counts, key=lambda w: (-counts[w], w))
    elif strategy == "rmtopmaxcount":
        order = sorted((w for w in counts if w not in top), key=lambda w: (-counts[w], w))
    elif strategy == "rmtoprand":
        if rng is None:
            raise ValueError("rmtoprand needs rng (anything with .shuffle(list), e.g. random.Random(0))")
        order = sorted(w for w in counts if w not in top)
        rng.shuffle(order)
    elif strategy == "weighted":
        if aligned_df is None:
            raise ValueError("weighted needs aligned_df (word -> number of ALIGNED captions containing it)")
        missing = sorted(w for w in counts if aligned_df.get(w, 0) < 1)
        if missing:
            raise ValueError(f"weighted: {len(missing)} neighbour word(s) have no ALIGNED document frequency, "
                             f"e.g. {missing[0]!r}; neighbour captions must come from ALIGNED")
        order = sorted(counts, key=lambda w: (-counts[w] / aligned_df[w], w))
    else:
        raise ValueError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
    return order[:p]


def rank_words(neighbour_captions: Iterable[str], strategy: str, aligned_df: Mapping[str, int] | None = None,
               top: int | Collection[str] | None = None, p: int = 4, rng=None) -> list[str]:
    """The first p words of NN_i (k*c captions, duplicates included) ranked by `strategy` (see module docstring).

    `aligned_df` maps word -> count(w, S_a); `top` is the rmtop count t (then top(t) comes from aligned_df) or the
    set of words to remove; `rng` (with .shuffle) drives rmtoprand.
    """
    if p < 1:
        raise ValueError(f"p must be at least 1, got {p}")
    counts = Counter()
    for caption in neighbour_captions:
        counts.update(caption_words(caption))
    removed = frozenset()
    if strategy in ("rmtopmaxcount", "rmtoprand") and top:
        if isinstance(top, int):
            if aligned_df is None:
                raise ValueError(f"{strategy} with top={top} needs aligned_df to find the top words")
            removed = top_words(aligned_df, top)
        else:
            removed = frozenset(top)
    return rank_counts(counts, strategy, aligned_df, removed, p, rng)


def neighbour_keys(ids: np.ndarray, scores: np.ndarray, keys: list[str], k: int) -> list[str]:
    """The k ALIGNED keys retrieved most often over a sample's crops (ids, scores (c, k)); then best score, key."""
    hits = Counter()
    best = {}
    for j, s in zip(ids.ravel().tolist(), scores.ravel().tolist()):
        if j >= 0:
            hits[j] += 1
            best[j] = max(best.get(j, -np.inf), s)
    return [keys[j] for j in sorted(hits, key=lambda j: (-hits[j], -best[j], keys[j]))[:k]]


# --- the stage ---------------------------------------------------------------------------------


@dataclass
class PseudolabelConfig:
    aligned: Path
    unaligned: Path
    out: Path
    strategy: str = "weighted"
    k: int = 10
    crops: int = 5
    words: int = 4
    rmtop: int = 1000
    index: str = "auto"
    nprobe: int | None = None       # IVF lists searched (default knn.DEFAULT_NPROBE)
    seed: int = 0
    batch_size: int = 16            # images per encoder call (x crops)
    device: str = "auto"            # the FAISS index: on a GPU unless cpu; with cuda, Ray actors get a GPU share
    workers: int = 1                # each worker has its own encoder and index
    distributor: str = "local"      # local | ray (docs/SCALE.md)
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


def _check(cfg: PseudolabelConfig) -> None:
    if cfg.strategy not in STRATEGIES:
        raise VlprepError(f"unknown --strategy {cfg.strategy!r}; strategies: {', '.join(STRATEGIES)}")
    if cfg.index not in knn.INDEX_KINDS:
        raise VlprepError(f"unknown --index {cfg.index!r}; use {', '.join(knn.INDEX_KINDS)}")
    for name in ("k", "crops", "words", "batch_size"):
        if getattr(cfg, name) < 1:
            raise VlprepError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.rmtop < 0:
        raise VlprepError("--rmtop must be at least 0")
    if cfg.nprobe is not None and cfg.nprobe < 1:
        raise VlprepError("--nprobe must be at least 1")
    check_engine(cfg.distributor, cfg.workers)


def _need_sidecars(ds, role: str) -> None:
    missing = [shard for shard in ds.shards if not ds.sidecar(shard).exists()]
    if missing:
        raise VlprepError(f"{role} {ds.root}: missing sidecar {ds.sidecar(missing[0]).name} (every vlprep stage "
                          "writes one; re-shard it with `vlprep shards`)")


def _aligned_columns(ds) -> list[str]:
    """The sidecar columns ALIGNED's keys and intact captions come from."""
    if ds.num_samples == 0:
        raise VlprepError(f"ALIGNED {ds.root} has no samples: there are no captions to retrieve")
    names = set(pq.read_schema(ds.sidecar(ds.shards[0])).names)
    if not {"key", "caption"} <= names:
        raise VlprepError(f"ALIGNED {ds.root}: the sidecars have no key/caption columns (not written by vlprep?)")
    return ["key", "caption"] + (["caption_raw"] if "caption_raw" in names else [])


def _aligned_captions(ds, columns: list[str]) -> Iterator[tuple[list[str], list[str]]]:
    """ALIGNED's keys and intact captions, one shard's sidecar at a time."""
    for shard in ds.shards:
        table = pq.read_table(ds.sidecar(shard), columns=columns)
        yield table.column("key").to_pylist(), intact_captions(table)


def _index_fingerprint(ds, enc, kind: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{enc.fingerprint}:{kind}".encode())
    for shard in ds.shards:
        h.update(ds.sidecar(shard).read_bytes())
    return h.hexdigest()


def caption_index(ds, columns: list[str], enc, out: Out, kind: str, progress=None) -> tuple[bool, str]:
    """(reused, fingerprint) of OUT/knn.faiss and the caption table over ALIGNED's intact captions, built if stale."""
    n = sum(pq.read_metadata(ds.sidecar(shard)).num_rows for shard in ds.shards)
    kind = knn.choose_kind(kind, n)
    fp = _index_fingerprint(ds, enc, kind)
    index_file = out.root / "knn.faiss"
    rows_file = out.root / "knn_captions.parquet"
    if index_file.exists() and rows_file.exists() and knn.table_fingerprint(out.root) == fp:
        meta = pq.read_schema(rows_file).metadata or {}
        if meta.get(b"fingerprint") == fp.encode():
            index = knn.load_index(index_file)
            if index.d == enc.dim and index.ntotal == n:
                return True, fp
    task = progress.add_task("embed captions", total=n) if progress else None
    index = knn.IndexBuilder(kind, n, enc.dim)
    pending = []
    schema = pa.schema([("key", pa.string()), ("caption", pa.string())], metadata={"fingerprint": fp})
    with (pq.ParquetWriter(out.root / "knn_captions.parquet.tmp", schema) as rows,
          knn.CaptionTableWriter(out.root, fp) as table):
        for keys, captions in _aligned_captions(ds, columns):
            table.add(keys, (caption_words(c) for c in captions))
            rows.write_table(pa.table([pa.array(keys, pa.string()), pa.array(captions, pa.string())], schema=schema))
            pending += captions
            # batches of 256 across the shards, the last one whatever is left: the embeddings depend neither on
            # --batch-size nor on ALIGNED's sharding
            while len(pending) >= 256 or (pending and index.done + len(pending) == n):
                index.add(enc.texts(pending[:256]))
                if progress:
                    progress.advance(task, len(pending[:256]))
                pending = pending[256:]
    knn.save_index(index.finish(), index_file)
    (out.root / "knn_captions.parquet.tmp").replace(rows_file)
    return False, fp


def _index_is_here(root: Path, index_fp: str) -> bool:
    return knn.table_fingerprint(root) == index_fp and all((root / name).exists() for name in knn.INDEX_FILES)


def fetch_index(out: Out, index_fp: str) -> None:
    """OUT's index and caption table (fingerprint `index_fp`) in `out.root` on this machine.

    The driver builds them in its folder and, for a URL OUT, uploads them before any shard runs; a worker on another
    machine (whose staging folder of the same name is its own) downloads them from OUT, once per machine: the first
    of its workers under a lock, each file under a temporary name then renamed, the vocabulary last; the others find
    the fingerprint in place and reuse them, as does the next run with the same index."""
    if out.url is None or _index_is_here(out.root, index_fp):
        return
    out.root.mkdir(parents=True, exist_ok=True)
    with open(out.root / ".knn-fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _index_is_here(out.root, index_fp):
            return
        for name in knn.INDEX_FILES:
            tmp = out.root / f"{name}.{os.getpid()}.tmp"
            objstore.get_file(objstore.join(out.url, name), tmp)
            os.replace(tmp, out.root / name)
    if not _index_is_here(out.root, index_fp):
        raise VlprepError(f"{redact(out.url)}: its caption index is not the one this run built (another run wrote "
                          "OUT meanwhile?)")


_worker: dict = {}


def _init_worker(enc, out: Out, index_fp: str, params: dict) -> None:
    """Per worker, once: the encoder (unpickled here, so it loads here), the saved index, ALIGNED's caption table.

    Everything comes from OUT/knn.faiss and the caption table's files (paths travel, not the index; the table is
    memory-mapped, its pages shared by the workers); a worker on a machine without them fetches them from a URL OUT
    first (`fetch_index`). In the driver the state is reused when the index is the same.
    """
    if _worker.get("index_fp") == index_fp and _worker.get("params") == params and _worker.get("enc") is enc:
        return
    fetch_index(out, index_fp)
    index = knn.load_index(out.root / "knn.faiss")
    kind = knn.kind_of(index)  # asked of the CPU index: nothing reads it back from a GPU
    n_lists = knn.nlist(index) if kind == "ivf" else None
    nprobe = knn.set_nprobe(index, params["nprobe"])
    if knn.use_gpu(params["device"]):
        index = knn.to_gpu(index, nprobe)
    table = knn.CaptionTable(out.root)
    top = frozenset()
    if params["strategy"] in ("rmtopmaxcount", "rmtoprand"):
        top = top_words(dict(zip(table.vocab, table.df.tolist())), params["rmtop"])
    _worker.update(enc=enc, index=index, kind=kind, nlist=n_lists, table=table, top=top, nprobe=nprobe,
                   index_fp=index_fp, params=params)


def rmtop_warnings(removed: int, vocab: int, dropped: int, n_in: int) -> list[str]:
    """A line when rmtop's top(t) takes a third or more of the aligned vocabulary: the paper's t = 1000 is for
    CC3M's; on a small aligned set the same t leaves rare words only, or none (images dropped)."""
    if not removed or removed * 3 < vocab:
        return []
    return [f"--rmtop removed {removed:,} of the {vocab:,} aligned words ({removed / vocab:.0%}); {dropped:,} of "
            f"{n_in:,} images were left with no word. On a small aligned set choose a t in proportion to its "
            "vocabulary (for instance the bow stage's rmtop:T)"]


def pseudolabel_shard(out: Out, src: Path, shard: str, fp: str) -> dict:
    """Pseudo-caption one UNALIGNED shard and write it; returns its counts."""
    w = _worker
    p = w["params"]
    enc = w["enc"]
    c = p["crops"]
    side = pq.read_table(src / sidecar_name(shard)).replace_schema_metadata(None)
    skipped = Counter()
    examples = {}
    dropped = 0
    samples = []
    kept = []
    captions = []
    neighbours = []
    for batch in batches(iter_aligned(src / shard, side.column("key").to_pylist()), p["batch_size"]):
        ok = []
        views = []
        metas = {}
        for i, raw in batch:
            try:  # a json member that is no strict JSON object (malformed, NaN, 100,000 deep): a counted skip
                metas[i] = decode_json(raw["json"]) if "json" in raw else {}
                image, why = decode(raw)
            except BadJson:
                image, why = None, "bad_json"
            if image is None:
                skipped[why] += 1
                if len(examples.setdefault(why, [])) < 5:
                    examples[why].append(raw["__key__"])
                continue
            ok.append((i, raw))
            views.append(crop_views(image, raw["__key__"], p["seed"], c, enc.image_size, enc.min_crop_scale))
        if ok:
            scores, ids = knn.search(w["index"], enc.images(np.concatenate(views)), p["k"])  # (B*c, k) each
        for n, (i, raw) in enumerate(ok):
            key = raw["__key__"]
            rows = ids[n * c:(n + 1) * c]
            counts, df = w["table"].word_counts(rows)  # IVF's -1 (fewer than k captions in the probed lists) left out
            rng = random.Random(f"{p['seed']}:{key}") if p["strategy"] == "rmtoprand" else None
            words = rank_counts(counts, p["strategy"], df, w["top"], p["words"], rng)
            if not words:
                dropped += 1
                continue
            meta = {k: v for k, v in metas[i].items() if k not in DROP_META}
            nbrs = neighbour_keys(rows, scores[n * c:(n + 1) * c], w["table"].keys, p["k"])
            caption = " ".join(words)
            samples.append({**{k: v for k, v in raw.items() if k not in ("txt", "json", "__url__")}, "txt": caption,
                            "json": {**meta, "pseudo": True, "strategy": p["strategy"], "neighbours": nbrs}})
            kept.append(i)
            captions.append(caption)
            neighbours.append(nbrs)
    table = side.take(pa.array(kept, pa.int64()))  # a bare [] would be a null-typed array
    for name in DROP_META:
        if name in table.column_names:
            table = table.remove_column(table.column_names.index(name))
    cols = {"caption": pa.array(captions, pa.string()), "pseudo": pa.array([True] * len(kept), pa.bool_()),
            "strategy": pa.array([p["strategy"]] * len(kept), pa.string()),
            "neighbours": pa.array(neighbours, pa.list_(pa.string()))}
    for name, col in cols.items():
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, col)
        else:
            table = table.append_column(name, col)
    stats = {"in": side.num_rows, "written": len(samples), "dropped_no_words": dropped, "skipped": dict(skipped),
             "skipped_examples": examples, "fingerprint": fp}
    write_shard(out, shard, samples, table, stats=stats)
    return stats


def pseudolabel(cfg: PseudolabelConfig, enc, progress=None) -> dict:
    """Run the stage with an encoder object (vlprep.embed); returns the report (also written to OUT/report.json)."""
    _check(cfg)
    check_images(enc)
    t0 = time.perf_counter()
    try:
        aligned = open_dataset(cfg.aligned)
    except VlprepError as e:
        raise VlprepError(f"ALIGNED: {e}") from None
    try:
        ds = open_dataset(cfg.unaligned)
    except VlprepError as e:
        raise VlprepError(f"UNALIGNED: {e}") from None
    out = check_out(cfg.out, aligned, ds, getattr(enc, "path", None))  # the checkpoint: an input too
    if cfg.skip_bad_shards:  # ALIGNED is read through its sidecars only, so only UNALIGNED's tars matter
        ds = check_shards(ds)
    _need_sidecars(aligned, "ALIGNED")
    _need_sidecars(ds, "UNALIGNED")
    columns = _aligned_columns(aligned)
    options = {k: v for k, v in asdict(cfg).items() if k not in ("aligned", "unaligned", "out", "batch_size",
                                                                  "device", "workers", "distributor", "overwrite",
                                                                  "skip_bad_shards")}
    options.update(aligned=aligned.location, unaligned=ds.location, encoder=enc.name)
    with writing_output(out, "pseudolabel", options, cfg.overwrite) as out:

        # --- plan: the caption index (saved in OUT for the workers) and one Work per UNALIGNED shard
        t_index = time.perf_counter()
        reused, index_fp = caption_index(aligned, columns, enc, out, cfg.index, progress)
        publish(out, knn.INDEX_FILES, keep=knn.INDEX_FILES)  # a URL OUT: there for workers on other machines
        params = {k: getattr(cfg, k) for k in ("strategy", "k", "crops", "words", "rmtop", "seed", "batch_size",
                                               "device")}
        params["nprobe"] = cfg.nprobe or knn.DEFAULT_NPROBE
        _init_worker(enc, out, index_fp, params)  # the driver's copy: the report's statistics, and one worker's state
        index_s = time.perf_counter() - t_index
        salt = (index_fp + repr(sorted(options.items()))).encode()
        plan = [Work(s, (ds.source, s), ds.fingerprint(s, salt + str(ds.tar_size(s)).encode()),
                     ds.sizes[s]) for s in ds.shards]
        t_images = time.perf_counter()
        stats, resumed = map_shards(out, plan, pseudolabel_shard, init=_init_worker,
                                    initargs=(enc, out.portable(), index_fp, params),
                                    workers=cfg.workers, distributor=cfg.distributor, progress=progress,
                                    label="pseudolabel", total=ds.num_samples, start="spawn", gpu=cfg.device == "cuda")
        images_s = time.perf_counter() - t_images
        processed = sum(ds.sizes[s] for s in ds.shards if s not in resumed)

        # --- summarise
        index = _worker["index"]
        kind = _worker["kind"]
        table = _worker["table"]
        top = _worker["top"]
        sizes = {s: stats[s]["written"] for s in ds.shards}
        skipped, examples = merged_skips(stats.values())
        n_in = ds.num_samples
        written = sum(sizes.values())
        dropped = sum(st["dropped_no_words"] for st in stats.values())
        index_info = {"kind": kind, "vectors": len(table), "dim": enc.dim, "nprobe": _worker["nprobe"] or None,
                      "gpu": knn.on_gpu(index), "reused": reused, "seconds": round(index_s, 3)}
        if kind == "ivf":
            index_info["nlist"] = _worker["nlist"]
        finish_dataset(out, sizes, {"stage": "pseudolabel", "input": redact(str(cfg.unaligned)),
                                    "aligned": redact(str(cfg.aligned)),
                                    "options": options, "index": index_info,
                                    "counts": {"in": n_in, "written": written, "dropped_no_words": dropped,
                                               "skipped": dict(skipped)}})
        from vlprep.report import pseudolabel_figures

        pseudo_words = Counter()
        lengths = Counter()
        for shard in ds.shards:
            for caption in pq.read_table(out.root / sidecar_name(shard), columns=["caption"]).column(0).to_pylist():
                ws = caption.split(" ")
                pseudo_words.update(ws)
                lengths[len(ws)] += 1
        ids = {w: i for i, w in enumerate(table.vocab)}  # for the top words' document frequencies
        report = {
            "stage": "pseudolabel", "aligned": redact(str(cfg.aligned)), "unaligned": redact(str(cfg.unaligned)),
            "encoder": enc.name, "strategy": cfg.strategy, "k": cfg.k, "crops": cfg.crops,
            "words": cfg.words, "rmtop": cfg.rmtop if top else None, "seed": cfg.seed, "index": index_info,
            "aligned_captions": len(table), "aligned_vocab": len(table.vocab), "samples_in": n_in, "written": written,
            "dropped_no_words": dropped, "skipped": dict(skipped), "skipped_examples": examples,
            "avg_words": round(sum(k * v for k, v in lengths.items()) / written, 3) if written else 0.0,
            "words_hist": {str(k): lengths[k] for k in sorted(lengths)}, "vocab": len(pseudo_words),
            "top_words": [[w, n, table.df[ids[w]].item()] for w, n in pseudo_words.most_common(30)],
            "shards": len(ds.shards), "shards_resumed": len(resumed), "bad_shards": ds.bad,
            "images_per_s": round(processed / images_s, 2) if processed and images_s > 0 else None,
            "warnings": rmtop_warnings(len(top), len(table.vocab), dropped, n_in),
        }
        report["plots"] = pseudolabel_figures(out, ds, report)
        report["elapsed_s"] = round(time.perf_counter() - t0, 3)
        write_json_atomic(out.root / "report.json", report)
    return report

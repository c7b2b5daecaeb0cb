"""`vlprep bow`: the bag-of-words caption deformations of A Fistful of Words (section 2.2).

docs/BOW.md is the contract: the tokens, the base set, each op and its order, multi-caption samples, what is dropped
and counted, and the outputs. Here: `OPS` (one pure function per op) and `deform` define the ops, `Deformer` applies
a whole cascade at once with the same result, `SampleRng` / `keyed_shuffle` draw the per-sample shuffle,
`top_tokens` ranks words (pseudolabel's top(t) too), and `bow` runs the two passes (base statistics from the
sidecars, then the shards rewritten under the same names and keys).
"""

import hashlib
import random
import struct
import time
from collections import Counter, _count_elements
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from vlprep import VlprepError
from vlprep.dataset import BadJson, bad_json_warning, carried_features, decode_json, iter_aligned, sidecar_name
from vlprep.engine import Work, check_engine, default_workers, map_shards
from vlprep.output import Out, finish_dataset, open_derived, write_json_atomic, write_shard, writing_output
from vlprep.text import stop_words, tokenize, words
from vlprep.urls import redact

DEFAULT_OPS = "shuffle,rmstop,basevocab,rmtop:1000,keep:4"
GRAMMAR = "OP[:N](,OP[:N])*  with OP one of: shuffle, rmstop, basevocab, rmtop:T (T >= 0), keep:N (N >= 1)"


@dataclass(frozen=True)
class BowContext:
    """What the base-dependent ops need: the base vocabulary and the top-t token set."""

    base_vocab: frozenset[str] = frozenset()
    top: frozenset[str] = frozenset()


# --- the ops: (tokens, context, rng) -> tokens ---------------------------------------------------


def shuffle(tokens: list[str], ctx: BowContext, rng) -> list[str]:
    """`rng` is anything with .shuffle(list): SampleRng in the stage, random.Random in a notebook."""
    tokens = list(tokens)
    rng.shuffle(tokens)
    return tokens


def rmstop(tokens: list[str], ctx: BowContext, rng: random.Random) -> list[str]:
    stop = stop_words()
    return [t for t in tokens if t.isalpha() and t not in stop]


def basevocab(tokens: list[str], ctx: BowContext, rng: random.Random) -> list[str]:
    return [t for t in tokens if t in ctx.base_vocab]


def rmtop(tokens: list[str], ctx: BowContext, rng: random.Random) -> list[str]:
    return [t for t in tokens if t not in ctx.top]


def keep(tokens: list[str], ctx: BowContext, rng: random.Random, n: int) -> list[str]:
    return tokens[:n]


def top_tokens(df: Mapping[str, int], t: int) -> list[str]:
    """RmTopFreq's ranking: the t tokens of highest document frequency, ties broken by the token string."""
    return sorted(df, key=lambda tok: (-df[tok], tok))[:t]


class OpSpec(NamedTuple):
    fn: Callable
    arg: str | None      # name of the count argument, None when the op takes none
    min_arg: int = 0
    needs_base: bool = False


OPS: dict[str, OpSpec] = {
    "shuffle": OpSpec(shuffle, None),
    "rmstop": OpSpec(rmstop, None),
    "basevocab": OpSpec(basevocab, None, needs_base=True),
    "rmtop": OpSpec(rmtop, "T", 0, needs_base=True),
    "keep": OpSpec(keep, "N", 1),
}


class Step(NamedTuple):
    name: str
    arg: int | None
    fn: Callable

    @property
    def label(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"


def parse_ops(spec: str) -> list[Step]:
    """'shuffle,rmstop,keep:4' -> the cascade (keep moved last); ValueError naming the grammar otherwise."""
    def bad(why: str) -> ValueError:
        return ValueError(f"bad --ops {spec!r}: {why}; grammar: {GRAMMAR}")

    steps = []
    seen = set()
    parts = [p.strip() for p in spec.split(",")] if spec and spec.strip() else []
    if not parts:
        raise bad("no ops given")
    for part in parts:
        name, _, raw = part.partition(":")
        name = name.strip().lower()
        if name not in OPS:
            raise bad(f"unknown op {name!r}")
        if name in seen:
            raise bad(f"op {name!r} given twice")
        seen.add(name)
        op = OPS[name]
        if op.arg is None:
            if raw:
                raise bad(f"{name} takes no argument")
            steps.append(Step(name, None, op.fn))
            continue
        try:
            n = int(raw)
        except ValueError:
            raise bad(f"{name} needs an integer count, e.g. {name}:{4 if name == 'keep' else 1000}") from None
        if n < op.min_arg:
            raise bad(f"{name}:{n}: the count must be at least {op.min_arg}")
        steps.append(Step(name, n, partial(keep, n=n) if name == "keep" else op.fn))
    return [s for s in steps if s.name != "keep"] + [s for s in steps if s.name == "keep"]


# Ops that cannot change which tokens a *base* caption holds: shuffle only reorders, and every token of a base
# caption is in the base vocabulary by definition. The ranking skips them, which lets it run in the same streaming
# pass that builds that vocabulary.
_SAME_TOKENS_ON_BASE = ("shuffle", "basevocab")


def ranking_prefix(cascade: list[Step]) -> list[Step]:
    """The ops before rmtop that can drop a token of a base caption; RmTopFreq ranks what they leave."""
    at = next((i for i, s in enumerate(cascade) if s.name == "rmtop"), 0)
    return [s for s in cascade[:at] if s.name not in _SAME_TOKENS_ON_BASE]


def deform(caption: str, cascade: list[Step], context: BowContext, rng: random.Random | None,
           removed: list[int] | None = None) -> str:
    """Deform one caption; `removed[i]` (optional) accumulates the tokens step i dropped."""
    tokens = tokenize(caption)
    for i, step in enumerate(cascade):
        n = len(tokens)
        tokens = step.fn(tokens, context, rng)
        if removed is not None:
            removed[i] += n - len(tokens)
    return " ".join(tokens)


def is_base(seed: int, key: str, frac: float) -> bool:
    """Base-set membership, a function of (seed, key) alone."""
    h = hashlib.blake2b(f"base:{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < frac * 2**64


def base_test(seed: int, frac: float) -> Callable[[str], bool]:
    """is_base(seed, ., frac) with its prefix and threshold made once: the stage asks it twice per sample."""
    prefix = f"base:{seed}:".encode()
    limit = frac * 2**64
    blake2b = hashlib.blake2b
    from_bytes = int.from_bytes
    return lambda key: from_bytes(blake2b(prefix + key.encode(), digest_size=8).digest(), "big") < limit


_blake2b = hashlib.blake2b
_SWAPS: dict[int, tuple] = {}  # list length n -> (unpack of its n - 1 big-endian 16-bit draws, (n, n - 1, ..., 2))


def keyed_shuffle(x: list, prefix: bytes) -> None:
    """SampleRng(seed, key).shuffle(x) with prefix = f"{seed}:{key}:".encode(): the same permutation, in one pass.

    The stage shuffles every caption once, so the stream needs no state between calls: the blocks it needs are
    hashed at once and the swap draws unpacked together (SampleRng.shuffle's per-swap loop was a hot spot).
    """
    n = len(x)
    if n < 2:
        return
    r = _blake2b(prefix + b"0", digest_size=64).digest()
    if n > 33:  # 2 bytes per swap, n - 1 swaps: more than one 64-byte block
        r += b"".join(_blake2b(prefix + str(b).encode(), digest_size=64).digest() for b in range(1, (2 * n + 61) // 64))
    plan = _SWAPS.get(n)
    if plan is None:
        plan = _SWAPS[n] = (struct.Struct(f">{n - 1}H").unpack_from, tuple(range(n, 1, -1)))
    unpack, sizes = plan
    for m, v in zip(sizes, unpack(r)):  # swap i = m - 1 with j drawn from 0..i
        j = v % m
        m -= 1
        x[m], x[j] = x[j], x[m]


class SampleRng:
    """Per-sample generator for `shuffle`, seeded from (seed, key).

    Hand-written rather than random.Random(f"{seed}:{key}") because seeding a Mersenne Twister per
    caption costs more than the whole rest of the cascade. A blake2b stream of (seed, key,
    block) drives a Fisher-Yates shuffle, two bytes per swap (bias below 1e-4 for captions under
    ten thousand tokens); the result is stable across processes and Python versions.
    """

    __slots__ = ("prefix", "stream", "block")

    def __init__(self, seed: int, key: str):
        self.prefix, self.stream, self.block = f"{seed}:{key}:".encode(), b"", 0

    def _bytes(self, n: int) -> bytes:
        while len(self.stream) < n:
            self.stream += hashlib.blake2b(self.prefix + str(self.block).encode(), digest_size=64).digest()
            self.block += 1
        out, self.stream = self.stream[:n], self.stream[n:]
        return out

    def shuffle(self, x: list) -> None:
        n = len(x)
        if n < 2:
            return
        r = self._bytes(2 * (n - 1))
        for step, i in enumerate(range(n - 1, 0, -1)):  # swap k uses stream bytes 2k, 2k+1 (big-endian)
            j = ((r[2 * step] << 8) | r[2 * step + 1]) % (i + 1)
            x[i], x[j] = x[j], x[i]


# Ops that drop tokens one at a time, each by a test of the token alone: a run of them is one filter.
_FILTERS = ("rmstop", "basevocab", "rmtop")


class Deformer:
    """The stage's per-caption deform: deform(caption, cascade, ctx, SampleRng(seed, key), removed), faster.

    A cascade is at most: token filters, then shuffle, then token filters, then keep (each op appears once and
    keep is last), so each run of filters is applied as one. A run that holds basevocab keeps exactly the base
    vocabulary words that pass its other filters, a set computed once here; one without it applies the ops in turn.
    The tokens each step dropped (`take_removed`) are counted from the tokens entering each run, tallied per
    shard: which step drops a token depends on the token alone. Output and counts are tested against deform() on
    many cascades.
    """

    def __init__(self, cascade: list[Step], context: BowContext, seed: int):
        self.cascade, self.context, self.seed = cascade, context, seed
        names = [s.name for s in cascade]
        self.shuffle = "shuffle" in names
        at = names.index("shuffle") if self.shuffle else len(names)
        self.pre, self.post = self._run(names, 0, at), self._run(names, at, len(names))
        self.keep_at = names.index("keep") if "keep" in names else None
        self.keep = cascade[self.keep_at].arg if self.keep_at is not None else None
        self.kept_over = 0
        self.seed_prefix = f"{seed}:"
        common = self.shuffle and self.pre is None and self.post is not None and self.post[1] is not None
        self.common = self.post[2] if common else None  # the post-run's tally, when __call__'s short path applies

    def _run(self, names: list[str], lo: int, hi: int) -> tuple[list[int], frozenset | None, dict] | None:
        """(the run's step indices, the set of tokens it keeps when that is finite, its tally) or None."""
        idx = [i for i in range(lo, hi) if names[i] in _FILTERS]
        if not idx:
            return None
        allowed = None
        if "basevocab" in (names[i] for i in idx):
            kept = list(self.context.base_vocab)
            for i in idx:
                kept = self.cascade[i].fn(kept, self.context, None)
            allowed = frozenset(kept)
        return idx, allowed, {}  # a plain dict: _count_elements takes its fast path only for an exact dict

    def _filter(self, run: tuple, tokens: list[str]) -> list[str]:
        idx, allowed, tally = run
        _count_elements(tally, tokens)  # Counter.update's C loop, without its Python preamble
        if allowed is not None:
            return [t for t in tokens if t in allowed]
        for i in idx:
            tokens = self.cascade[i].fn(tokens, self.context, None)
        return tokens

    def __call__(self, caption: str, key: str) -> str:
        tokens = tokenize(caption)
        if self.common is not None:  # shuffle, then filters that keep a finite set (the default cascade): inlined
            keyed_shuffle(tokens, (self.seed_prefix + key + ":").encode())
            _count_elements(self.common, tokens)
            allowed = self.post[1]
            tokens = [t for t in tokens if t in allowed]
            if self.keep is not None and len(tokens) > self.keep:
                self.kept_over += len(tokens) - self.keep
                tokens = tokens[:self.keep]
            return " ".join(tokens)
        if self.pre is not None:
            tokens = self._filter(self.pre, tokens)
        if self.shuffle:
            keyed_shuffle(tokens, (self.seed_prefix + key + ":").encode())
        if self.post is not None:
            tokens = self._filter(self.post, tokens)
        if self.keep is not None and len(tokens) > self.keep:
            self.kept_over += len(tokens) - self.keep
            tokens = tokens[:self.keep]
        return " ".join(tokens)

    def take_removed(self) -> list[int]:
        """Tokens each step dropped since the last call (deform's `removed`), and a fresh tally."""
        removed = [0] * len(self.cascade)
        for run in (self.pre, self.post):
            if run is None:
                continue
            idx, allowed, tally = run
            # Each step applied once to the distinct tokens the run dropped (it tests each token alone), rather than
            # to each token on its own: one call per step instead of one per token and step.
            left = [t for t in tally if t not in allowed] if allowed is not None else list(tally)
            for i in idx:
                kept = self.cascade[i].fn(left, self.context, None)
                if len(kept) != len(left):
                    survived = set(kept)
                    removed[i] += sum(tally[t] for t in left if t not in survived)
                left = kept
            tally.clear()
        if self.keep_at is not None:
            removed[self.keep_at], self.kept_over = self.kept_over, 0
        return removed


# --- the stage ---------------------------------------------------------------------------------


@dataclass
class BowConfig:
    src: Path
    out: Path
    ops: str = DEFAULT_OPS
    base_frac: float = 0.1
    seed: int = 0
    deform_base: bool = False
    workers: int = field(default_factory=default_workers)
    distributor: str = "local"     # local | ray (docs/SCALE.md)
    overwrite: bool = False
    skip_bad_shards: bool = False  # leave out shards whose tar, sidecar and sizes.json disagree (counted)


def base_statistics(ds, cascade: list[Step], base_frac: float, seed: int) -> tuple[BowContext, dict]:
    """First pass, over the sidecars: base vocabulary, top-t set, and the 'before' statistics."""
    df = Counter()
    vocab = set()
    before = Counter()
    lengths = Counter()
    # Fistful's Figure 2 removes "cars, table, men, rocks": the most frequent words that survive the earlier ops,
    # so the document frequencies are counted on base captions after the ops that precede rmtop, not on raw tokens
    # (which would spend most of the t slots on stop words and punctuation that rmstop already removed).
    prefix = ranking_prefix(cascade)
    no_ctx = BowContext()
    n = n_base = 0
    in_base = base_test(seed, base_frac)
    for shard in ds.shards:
        side = ds.sidecar(shard)
        if not side.exists():
            raise VlprepError(f"{ds.root}: missing sidecar {side.name}; re-shard the input with `vlprep shards`")
        pf = pq.ParquetFile(side)
        multi = "captions" in pf.schema_arrow.names  # a multi-caption dataset: base samples' extras count too
        t = pf.read(columns=["key", "caption"] + (["captions"] if multi else []))
        keys = t.column("key").to_pylist()
        captions = t.column("caption").to_pylist()
        extras = t.column("captions").to_pylist() if multi else None
        n += len(keys)
        # Counted a shard at a time (one C-level update each), not caption by caption.
        word_lists = list(map(words, captions))
        before.update(chain.from_iterable(word_lists))
        lengths.update(map(len, word_lists))
        for i, (key, caption) in enumerate(zip(keys, captions)):
            if in_base(key):
                n_base += 1
                for text in [caption, *((extras[i] or [])[1:] if extras else ())]:
                    toks = tokenize(text)
                    vocab.update(toks)
                    for step in prefix:
                        toks = step.fn(toks, no_ctx, None)
                    df.update(set(toks))
    t_top = next((s.arg for s in cascade if s.name == "rmtop"), 0)
    top = top_tokens(df, t_top)
    ctx = BowContext(base_vocab=frozenset(vocab), top=frozenset(top))
    return ctx, {"samples": n, "base": n_base, "words": before, "lengths": lengths, "top": top,
                 "ranked_tokens": len(df)}


def emptying_warnings(cascade: list[Step], ctx: BowContext, deformed: int | None = None,
                      dropped: int | None = None) -> list[str]:
    """Warnings for a cascade that empties most captions: rmtop:T at or above the base vocabulary left by the ops
    before it, and (once the counts are known) more than half of the deformed captions dropped as empty."""
    out = []
    at = next((i for i, s in enumerate(cascade) if s.name == "rmtop"), None)
    if at is not None:
        before = cascade[:at]
        # The ops before rmtop filter word by word (shuffle and keep never drop a single word), so a word of the
        # base vocabulary (a token, which tokenize gives back whole) survives them iff the one-word caption does:
        # each op is applied once to the whole vocabulary, as a list of one-word captions would be, word by word.
        # (shuffle is left out: it needs a generator, and a one-word caption is its own permutation)
        left = list(ctx.base_vocab)
        for step in before:
            if step.name != "shuffle":
                left = step.fn(left, ctx, None)
        left = len(left)
        t = cascade[at].arg
        if t >= left:
            after = f" after {','.join(s.label for s in before)}" if before else ""
            out.append(f"rmtop:{t} removes the {t} most frequent base words, but the base vocabulary has only {left} "
                       f"words{after}: nearly every deformed caption will come out empty and be dropped; use a much "
                       f"smaller t (docs/BOW.md, 'Choosing t')")
    if deformed is not None and dropped and dropped > (deformed + dropped) / 2:
        out.append(f"{dropped:,} of {deformed + dropped:,} deformed captions ({dropped / (deformed + dropped):.0%}) "
                   "came out empty and were dropped: the ops remove too much for these captions (docs/BOW.md)")
    return out


_worker: dict = {}


def init_worker(cascade_spec: str, context: BowContext, seed: int, base_frac: float, deform_base: bool) -> None:
    """Set up a worker of the bow stage (the cascade, the base test, the deformer), once per worker process."""
    # The context (base vocabulary, top set) is sent once per worker, not once per shard.
    cascade = parse_ops(cascade_spec)
    _worker.update(cascade=cascade, context=context, seed=seed, base_frac=base_frac, deform_base=deform_base,
                   deformer=Deformer(cascade, context, seed), in_base=base_test(seed, base_frac))


def shard_fingerprints(ds, ctx: BowContext) -> dict[str, str]:
    """Per input shard: its sidecar's bytes, its tar's size, and the global context (base vocab, top set).

    Every output shard depends on the global context, so a changed input shard anywhere means a
    resumed run rebuilds all of them; an unchanged input resumes.
    """
    g = hashlib.blake2b(digest_size=16)
    for part in (sorted(ctx.base_vocab), sorted(ctx.top)):
        g.update("\x00".join(part).encode() + b"\x01")
    fps = {}
    for shard in ds.shards:
        h = g.copy()
        h.update(ds.sidecar(shard).read_bytes())
        h.update(str(ds.tar_size(shard)).encode())
        fps[shard] = h.hexdigest()
    return fps


def bow_shard(out: Out, src: Path, shard: str, fp: str = "") -> dict:
    """Second pass over one shard: deform captions, copy everything else; returns the shard's counts."""
    w = _worker
    deformer = w["deformer"]
    in_base = w["in_base"]
    deformer.take_removed()  # a fresh tally (a failed shard before this one may have left counts)
    side = pq.ParquetFile(src / sidecar_name(shard)).read().replace_schema_metadata(None)
    samples = []
    kept = []
    captions = []
    raw_captions = []
    flags = []
    all_captions = []
    dropped = 0
    dropped_extra = 0
    bad_json = 0
    deform_base = w["deform_base"]
    for i, raw in iter_aligned(src / shard, side.column("key").to_pylist()):
        key = raw["__key__"]
        text = raw["txt"].decode("utf-8")
        # decode_sample's work, without copying the sample; a json member that is no strict JSON object (malformed,
        # NaN, 100,000 deep) makes a counted bad sample, left out
        try:
            meta = decode_json(raw["json"]) if "json" in raw else {}
        except BadJson:
            bad_json += 1
            continue
        caption = text
        deform_it = deform_base or not in_base(key)
        if deform_it:
            caption = deformer(text, key)
            if not caption:
                dropped += 1
                continue
        raw_caption = meta.setdefault("caption_raw", text)
        meta["bow"] = deform_it
        extra = meta.get("captions")
        if isinstance(extra, list):  # a multi-caption sample: every caption is deformed (module docstring)
            meta.setdefault("captions_raw", list(extra))
            if deform_it:
                deformed = [deformer(c, f"{key}#{j}") if isinstance(c, str) else ""
                            for j, c in enumerate(extra[1:], 1)]
                dropped_extra += deformed.count("")
                meta["captions"] = [caption, *filter(None, deformed)]
            all_captions.append(meta["captions"])
        else:
            all_captions.append([caption])
        # the sample written is the raw one, read for this loop alone (encode_sample leaves out its __url__)
        raw["txt"], raw["json"] = caption, meta
        samples.append(raw)
        kept.append(i)
        captions.append(caption)
        raw_captions.append(raw_caption)
        flags.append(deform_it)
    # The sidecar is edited column-wise (take the kept rows, swap the caption column) rather than
    # round-tripped through Python dicts: that was a few percent of this stage. The indices are typed
    # int64 because a shard whose captions all come out empty has none, and pa.array([]) is of type null.
    table = side.take(pa.array(kept, pa.int64()))
    for name, values, typ in (("caption", captions, pa.string()), ("caption_raw", raw_captions, pa.string()),
                              ("bow", flags, pa.bool_())):
        col = pa.array(values, typ)
        if name in table.column_names:
            table = table.set_column(table.schema.get_field_index(name), pa.field(name, typ), col)
        else:
            table = table.append_column(pa.field(name, typ), col)
    if "captions" in table.column_names:  # a multi-caption dataset's sidecar follows json.captions
        typ = table.schema.field("captions").type
        table = table.set_column(table.column_names.index("captions"), pa.field("captions", typ),
                                 pa.array(all_captions, typ))
    stats = {"in": side.num_rows, "written": len(samples), "deformed": sum(flags), "dropped_empty": dropped,
             "removed": deformer.take_removed(), "fingerprint": fp}
    if dropped_extra:
        stats["captions_dropped_empty"] = dropped_extra
    if bad_json:
        stats["bad_json"] = bad_json
    write_shard(out, shard, samples, table, stats=stats)
    # The 'after' statistics of the kept captions travel back with the counts but are not stored with them (a
    # resumed shard's are read from its sidecar): counting them here saves reading every new sidecar again.
    return {**stats, "after": _word_stats(captions)}


def bow(cfg: BowConfig, progress=None, warn: Callable[[str], None] = lambda line: None) -> dict:
    """Run the stage; returns the report (also written to OUT/report.json, with its `warnings`).

    `warn` receives a warning line as soon as it is known (the CLI prints it before the progress bar runs)."""
    try:
        cascade = parse_ops(cfg.ops)
    except ValueError as e:
        raise VlprepError(str(e)) from None
    if not 0 <= cfg.base_frac <= 1:
        raise VlprepError("--base-frac must be between 0 and 1")
    needs_base = [s.label for s in cascade if OPS[s.name].needs_base]
    if needs_base and cfg.base_frac == 0:
        raise VlprepError(f"{', '.join(needs_base)} need a base set, but --base-frac is 0")
    check_engine(cfg.distributor, cfg.workers)
    t0 = time.perf_counter()
    ds, out = open_derived(cfg.src, cfg.out, cfg.skip_bad_shards)
    ctx, before = base_statistics(ds, cascade, cfg.base_frac, cfg.seed)
    if needs_base and before["base"] == 0:
        raise VlprepError(f"the base set is empty ({before['samples']} samples x --base-frac {cfg.base_frac}); "
                          "raise --base-frac")
    options = {k: v for k, v in asdict(cfg).items() if k not in ("src", "out", "workers", "distributor", "overwrite", "skip_bad_shards")}
    options["src"] = ds.location
    with writing_output(out, "bow", options, cfg.overwrite) as out:
        for line in emptying_warnings(cascade, ctx):  # before the long pass, so the user can stop it
            warn(line)

        spec = ",".join(s.label for s in cascade)
        fps = shard_fingerprints(ds, ctx)
        plan = [Work(shard, (ds.source, shard), fps[shard], ds.sizes[shard]) for shard in ds.shards]
        after_words = Counter()
        after_lengths = Counter()

        def fold_after(shard: str, st: dict) -> dict:
            """The 'after' statistics of each shard's kept captions (bow_shard's; a resumed shard's from its
            sidecar), merged in shard order as the shards finish: no shard's word counts are held to the end."""
            shard_words, shard_lengths = st.pop("after", None) or _word_stats(
                pq.ParquetFile(out.root / sidecar_name(shard)).read(columns=["caption"]).column(0).to_pylist())
            after_words.update(shard_words)
            after_lengths.update(shard_lengths)
            return st

        stats, resumed = map_shards(out, plan, bow_shard, init=init_worker,
                                    initargs=(spec, ctx, cfg.seed, cfg.base_frac, cfg.deform_base), workers=cfg.workers,
                                    distributor=cfg.distributor, progress=progress, label="bow", total=ds.num_samples,
                                    fold=fold_after)

        sizes = {s: stats[s]["written"] for s in ds.shards}
        n_in = ds.num_samples
        written = sum(sizes.values())
        removed = [sum(stats[s]["removed"][i] for s in ds.shards) for i in range(len(cascade))]
        deformed = sum(stats[s]["deformed"] for s in ds.shards)
        dropped = sum(stats[s]["dropped_empty"] for s in ds.shards)
        dropped_extra = sum(stats[s].get("captions_dropped_empty", 0) for s in ds.shards)
        bad_json = sum(stats[s].get("bad_json", 0) for s in ds.shards)
        finish_dataset(out, sizes, {
            "stage": "bow", "input": redact(str(cfg.src)), "options": options,
            "counts": {"in": n_in, "written": written, "deformed": deformed, "dropped_empty": dropped},
            **carried_features(ds),
        })
        report = {
            "stage": "bow", "source": redact(str(cfg.src)), "ops": spec, "base_frac": cfg.base_frac, "seed": cfg.seed,
            "deform_base": cfg.deform_base, "samples_in": n_in, "base_samples": before["base"], "written": written,
            "dropped_empty": dropped, "captions_dropped_empty": dropped_extra, "bad_json": bad_json,
            "size_change_pct": round(100 * (written - n_in) / n_in, 2) if n_in else 0.0,
            "deformed_fraction": round(deformed / written, 4) if written else 0.0,
            "avg_words_before": _mean(before["lengths"]), "avg_words_after": _mean(after_lengths),
            "vocab_before": len(before["words"]), "vocab_after": len(after_words),
            "top_words_before": [[w_, n] for w_, n in before["words"].most_common(20)],
            "top_words_after": [[w_, n] for w_, n in after_words.most_common(20)],
            "tokens_removed": {s.label: n for s, n in zip(cascade, removed)},
            "base_vocab_size": len(ctx.base_vocab), "rmtop_tokens": before["top"][:50],
            "rmtop_ranked_after": _ranked_after(cascade),
            "rmtop_candidates": None if _ranked_after(cascade) is None else before["ranked_tokens"],
            "length_hist_before": _hist(before["lengths"]), "length_hist_after": _hist(after_lengths),
            "shards": len(ds.shards), "shards_resumed": len(resumed), "bad_shards": ds.bad,
            "elapsed_s": round(time.perf_counter() - t0, 3),
            "warnings": emptying_warnings(cascade, ctx, deformed, dropped) + bad_json_warning(bad_json),
        }
        from vlprep.report import plot_bow

        report["plots"] = plot_bow(out, before["words"], after_words, before["lengths"], after_lengths)
        write_json_atomic(out.root / "report.json", report)
    return report


def _word_stats(captions: list[str]) -> tuple[Counter, Counter]:
    """(word counts, caption lengths in words) of some captions."""
    word_lists = list(map(words, captions))
    return Counter(chain.from_iterable(word_lists)), Counter(map(len, word_lists))


def _ranked_after(cascade: list[Step]) -> str | None:
    """The ops rmtop's ranking counts after, as written in the cascade (None without rmtop)."""
    at = next((i for i, s in enumerate(cascade) if s.name == "rmtop"), None)
    return None if at is None else ",".join(s.label for s in cascade[:at])


def _mean(hist: Counter) -> float:
    n = sum(hist.values())
    return round(sum(k * v for k, v in hist.items()) / n, 3) if n else 0.0


def _hist(hist: Counter) -> dict[str, int]:
    return {str(k): hist[k] for k in sorted(hist)}

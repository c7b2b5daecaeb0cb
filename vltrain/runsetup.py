"""A run's set-up, before the first step: the output folder, seeds, input kind, loader workers, speed options and the
training data (streamed shards, or index-sampled views for GRIT, TOnICS and triplets). Benchmarks call these too."""

import math
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vlprep import VlprepError
from vlprep.outlock import lock_output
from vlprep.urls import redact
from vltrain.checkpoint import check_config, load
from vltrain.errors import TrainError
from vltrain.config import GRIT_RATIOS, GRIT_RATIOS_BEFORE, Config, grit_sizes
from vltrain.data import (Collate, IndexedShards, InstanceView, ShardStream, TokenLengths, count_split,
                          eval_transform, feature_input, in_val, train_transform)
from vltrain.distributed import broadcast
from vltrain.evaluate import distinct_positions
from vltrain.model import autocast, bf16_supported, image_stats, resolve_device, tokenizer_for
from vltrain.report import console
from vltrain.samplers import GritSampler, TonicsBatchSampler, TonicsCurriculum, default_ontology, tonics_instances

EVAL_TRIPLETS = 1000  # triplet mode: validation retrieval over at most this many triplets (one per image)
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "result.json", "curriculum.json", "curriculum.png",
             "learning_curve.png", "tb")


# --- the output folder, seeds, device ------------------------------------------------------------------------


def prepare_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a folder that holds another run unless told to resume it or to overwrite it."""
    if resume:
        if not (out / "last.pt").exists():
            raise TrainError(f"--resume: no checkpoint at {out / 'last.pt'}")
        return
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not overwrite:
        raise TrainError(f"{out} already holds a run ({', '.join(found)}); add --resume to continue it or "
                         "--overwrite to start over (or choose another --out)")
    for name in found:  # only the files a run writes: anything else in the folder is the user's
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    out.mkdir(parents=True, exist_ok=True)


def open_output(out: Path, resume: bool, overwrite: bool, rank: int) -> None:
    """Rank 0 locks OUT and prepares it; under torchrun every rank stops on rank 0's error instead of waiting."""
    error = None
    if rank == 0:
        try:  # one run per OUT: a second `--resume` on the same folder would interleave two runs' checkpoints
            lock_output(out, "vltrain")
            prepare_out(out, resume, overwrite)
        except (VlprepError, TrainError) as e:
            error = str(e)
    error = broadcast(error)
    if error is not None:
        raise TrainError(error)


def init_source(init_from, out: Path, resume: bool, overwrite: bool) -> dict | None:
    """--init-from's checkpoint or export, read (CheckpointError: one line), or None without it; refused with --resume,
    whose run goes on from its own weights, and when it is OUT's own checkpoint, which --overwrite would delete."""
    if init_from is None:
        return None
    if resume:
        raise TrainError("give --resume or --init-from, not both: --resume continues OUT/last.pt with its optimiser "
                         "and step, --init-from starts a new run from other weights (a resumed run that began with "
                         "--init-from keeps them: its checkpoint has everything)")
    path = Path(init_from)
    if overwrite and deleted_by_overwrite(path, out):
        raise TrainError(f"--init-from {path} is a checkpoint of the run in {out}, which --overwrite deletes; copy it "
                         "elsewhere first, or choose another --out")
    source = load(path, "--init-from")
    check_config(source, f"--init-from {path}")  # its config is read for notes: checked as every reader checks it
    return source


def deleted_by_overwrite(path: Path, out: Path) -> bool:
    """Whether `path` is, or lies in, a file that --overwrite deletes from OUT (RUN_FILES): resolved paths, so that a
    link (or a second name for OUT) pointing into the run is caught as well as its own name."""
    try:
        where = path.resolve()
        targets = [(out / name).resolve() for name in RUN_FILES]
    except (OSError, RuntimeError):  # a link loop: load says the path is not a checkpoint
        return False
    return any(where == t or t in where.parents for t in targets)


def train_device(name: str) -> torch.device:
    try:
        return resolve_device(name)
    except VlprepError as e:  # the shared resolver's one-line error
        raise TrainError(str(e)) from None


def seed_everything(seed: int, device: torch.device) -> None:
    """A fresh run is a function of its seed: every RNG seeded, deterministic kernels where torch has them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
        torch.backends.cudnn.benchmark = False
    # warn_only: an op without a deterministic kernel warns instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    # ...without filling every new tensor first (~5 ms of a 0.2 s CPU step): that guards reads of uninitialised
    # memory, which no op here does; results do not depend on it.
    torch.utils.deterministic.fill_uninitialized_memory = False


def resolve_input(cfg: Config) -> None:
    """Features or pixels, from the shards' meta.json (data.input auto) or as asked; sets the model to match."""
    try:
        spec = feature_input(cfg.shards, cfg.data.input)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if spec is None:
        cfg.data.input = "pixels"
        if cfg.model.image_model == "features":
            raise TrainError("model.image_model=features needs `vlprep features` output as the data")
        return
    cfg.data.input = "features"
    cfg.model.image_model, cfg.model.feature_dim, cfg.model.feature_encoder = "features", int(spec["dim"]), spec


def resolve_workers(cfg: Config, device: torch.device) -> None:
    """data.workers -1 (auto): 0 for cached tokens on a CPU, where loading is light and worker processes only
    compete with torch's threads (and are forked anew each epoch: benchmarks/features.py), 2 otherwise."""
    if cfg.data.workers < 0:
        cfg.data.workers = 0 if cfg.data.input == "features" and device.type == "cpu" else 2


def fit_workers(cfg: Config, n_train: int, n_shards: int) -> None:
    """Fewer streaming workers when some would get no shard, or when the data fill less than a batch per worker.

    Each worker batches its own shards and drops its last partial batch, so with W workers and fewer than W * B
    training samples an epoch can yield no batch at all, and the run would wait forever.
    """
    w = cfg.data.workers
    fit = min(w, n_shards, max(1, n_train // cfg.batch_size))
    if fit < w:
        why = (f"{n_train} training samples fill fewer than one batch of {cfg.batch_size} per worker"
               if fit < n_shards else f"the data has {n_shards} shard(s), one worker's share at most")
        console.print(f"warning: data.workers {w} -> {fit}: {why}", highlight=False)
        cfg.data.workers = fit


def speed_options(cfg: Config, model, device: torch.device, use_features: bool) -> bool:
    """Apply train.tf32 / channels_last / unpad / compile; returns whether pixels go channels-last."""
    cuda = device.type == "cuda"
    if cuda:  # TF32: ~10-bit mantissa matmuls on Ampere and later, the usual trade for training speed
        on = cfg.train.tf32 != "off"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    # auto: on CUDA, and for a frozen image tower on a CPU, whose no-grad forward is 1.74x faster in NHWC here
    # (benchmarks/mfu.py --extras channels_last: the packaged EfficientNet-Lite0, batch 32 at 224 px)
    channels_last = not use_features and (cfg.train.channels_last == "on"
                                          or (cfg.train.channels_last == "auto" and (cuda or cfg.model.freeze_image)))
    if channels_last:  # NHWC convolutions are the fast path of tensor cores; only 4-D weights change layout
        model.image_encoder.to(memory_format=torch.channels_last)
    # Up to 4 groups: GRIT's and TOnICS' batches (never length-bucketed) and every ITM / MLM pass stop paying for
    # padding; a bucketed batch is one group (benchmarks/mfu.py)
    model.set_unpad(4 if cfg.train.unpad else 0)
    if cfg.train.compile:  # in place (nn.Module.compile), so state_dict keys and checkpoints stay the same
        model.image_encoder.compile()
        model.text_encoder.compile()
    return channels_last


def resolve_precision(cfg: Config, model, device: torch.device, ckpt: dict | None, rank: int) -> tuple[str, str]:
    """(fp32 or bf16: what train.precision means for this run, the reason in a few words). A resumed run keeps its
    checkpoint's (fp32 before the key existed). `auto`: bf16 on CUDA; on a CPU with bf16 arithmetic (AVX512_BF16,
    AMX) bf16 when a quick check of the model's text tower finds it at least BF16_GAIN times faster, else fp32.
    Under torchrun rank 0 decides for every rank."""
    if ckpt is not None:
        p = ckpt.get("precision", "fp32")
        return p, "as the resumed run"
    asked, supported = cfg.train.precision, bf16_supported(device)
    if asked == "fp32":
        return "fp32", "train.precision=fp32"
    if asked == "bf16":
        if not supported:
            raise TrainError(f"train.precision=bf16: this {'CPU' if device.type == 'cpu' else 'device'} has no bf16 "
                             "arithmetic (AVX512_BF16 or AMX), so torch would emulate it, slower than fp32; use fp32 "
                             "or auto")
        return "bf16", "train.precision=bf16"
    if not supported:
        return "fp32", "auto: no bf16 arithmetic here"
    if device.type == "cuda":
        return "bf16", "auto on CUDA"
    width = model.text_encoder.config.hidden_size
    if width < BF16_MIN_WIDTH:  # decided without timing: such matmuls gain nothing, and the result stays reproducible
        return "fp32", f"auto: a {width}-wide text tower is too small to gain from bf16"
    gain = broadcast(bf16_gain(model, cfg.batch_size, min(16, cfg.data.max_len)) if rank == 0 else None)
    return ("bf16" if gain >= BF16_GAIN else "fp32"), f"auto: bf16 ran {gain:.1f}x fp32 in a quick check"


def keep_freed_memory() -> bool:
    """glibc only: serve large allocations from the heap and keep freed memory in the process. By default glibc
    maps every block over 32 MB (MiniLM's word-embedding gradient is 47 MB, made anew each step) with mmap and
    returns it on free, so each step zero-fills fresh pages through page faults: about a third of a `clip` step at
    batch 32 on cached tokens (111-159 ms against 88 ms with this, benchmarks/mfu.py's step). The cost: memory freed
    late in a run stays with the process. Returns whether it took effect (False off glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2 ** 31 - 1))


BF16_GAIN = 1.1  # auto takes bf16 on a CPU only when it is at least this much faster
BF16_MIN_WIDTH = 256  # auto keeps fp32 on a CPU for narrower text towers (the tests' tiny model is 32 wide)


def bf16_gain(model, batch: int, length: int, reps: int = 3) -> float:
    """fp32 time / bf16 time of the text tower's forward on a (batch, length) caption batch, medians of `reps`
    alternating calls after one of each (no gradient; the backward's matmuls gain alike)."""
    ids = torch.full((batch, length), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    times, training = {"fp32": [], "bf16": []}, model.training
    model.eval()  # no dropout draws: the run's random numbers are the same whether or not the check ran
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for i in range(reps + 1):
            for p in ("fp32", "bf16"):
                t0 = time.perf_counter()
                with autocast(torch.device("cpu"), p):
                    model.encode_text(ids, mask)
                if i:
                    times[p].append(time.perf_counter() - t0)
    model.train(training)
    return statistics.median(times["fp32"]) / statistics.median(times["bf16"])


# --- the training data ---------------------------------------------------------------------------------------


@dataclass
class TrainData:
    """What the loop reads: the training set with its batch sampler (None: streamed random batches), the collate,
    the load counts (undecodable samples), sizes, and for index-sampled data the held-out view."""

    tokenizer: object
    collate: Collate
    use_features: bool
    train: object              # ShardStream, or an InstanceView for an index sampler
    sampler: object            # GritSampler / TonicsBatchSampler, or None
    counts: object             # .totals() -> (read, bad)
    n_train: int
    n_val: int
    per_epoch: int             # full global batches per epoch
    val: InstanceView | None = None
    names: list | None = None  # TOnICS: the curriculum's node names
    heldout: np.ndarray | None = None       # TOnICS: the refresh check's held-out positions
    val_triplets: np.ndarray | None = None  # triplet mode: the held-out triplets scored at each eval
    heldout_keys: set | None = None         # pairs under TOnICS: the check's images, left out of the scored set


def index_data(cfg: Config, tf_train, tf_eval, grit_ratios: tuple[int, int] = GRIT_RATIOS, world: int = 1) -> dict:
    """Train / val views read through wids, the batch sampler over the train view, the curriculum's node names and
    `notes` (lines for the user).

    Under torchrun (`world` processes) the sampler draws global batches of world x batch_size, the same on every
    rank from the same seed; each rank reads its slice (vltrain.distributed.RankSlice).
    """
    shards = IndexedShards(cfg.shards)
    is_val = np.array([in_val(k, cfg.data.val_frac) for k in shards.keys], dtype=bool)
    use_features, s, n = cfg.data.input == "features", cfg.sampler, cfg.batch_size * world
    names, notes = None, []
    if s.kind == "grit":
        splits = {"train": {"samples": np.flatnonzero(~is_val), "spans": None},
                  "val": {"samples": np.flatnonzero(is_val), "spans": None}}
        m, q = grit_sizes(cfg, grit_ratios)
        if world > 1 and not s.search_space:  # M and L are multiples of the global batch
            m = m * world
            q = s.queue_size or grit_ratios[1] * m
        sampler = GritSampler(len(splits["train"]["samples"]), n, m, q, cfg.seed)
    else:  # tonics, or random batches of triplets (P(entity) stays 1)
        try:
            onto = s.ontology or default_ontology(cfg.shards[0])
            if onto != cfg.shards[0] and not s.ontology:
                notes.append(f"tonics: ontology from {onto}, the folder {redact(cfg.shards[0])} was cached from")
            splits = tonics_instances(onto, shards.keys, is_val, cfg.data.triplets)
        except ValueError as e:
            raise TrainError(str(e)) from None
        sampler, names = _tonics_sampler(cfg, splits["train"], n, notes)
    # The training view draws one caption of a multi-caption sample per epoch; the held-out view takes the first.
    views = {split: InstanceView(shards, splits[split]["samples"], tf_train if split == "train" else tf_eval,
                                 use_features, splits[split]["spans"], "draw" if split == "train" else "first",
                                 cfg.seed) for split in ("train", "val")}
    return {"sampler": sampler, "names": names, "notes": notes, **views}


def _tonics_sampler(cfg: Config, train: dict, n: int, notes: list) -> tuple:
    """TOnICS' batch sampler over the classes that can fill a batch of n distinct images, and the node names."""
    s, image_of = cfg.sampler, train["samples"]
    if len(np.unique(image_of)) < n:
        raise TrainError(f"the training split has {len(np.unique(image_of))} distinct images with "
                         f"{'triplets' if cfg.data.triplets else 'samples'}, fewer than one batch of {n}")
    keep, dropped = [], []
    for c, pos in train["nodes"] if s.kind == "tonics" else []:
        (keep if len(np.unique(image_of[pos])) >= n else dropped).append((c, pos))
    if s.kind == "tonics" and not keep:
        raise TrainError(f"no ontology class has {n} distinct training images, so no same-object batch can be "
                         "drawn; lower --batch-size")
    if dropped:
        notes.append(f"tonics: {len(dropped)} of {len(dropped) + len(keep)} classes have fewer than {n} distinct "
                     f"training images and stay out of the curriculum: {', '.join(c for c, _ in dropped)}")
    curriculum = TonicsCurriculum([len(p) for _, p in keep] or [1], s.alpha, s.beta)
    nodes = [p for _, p in keep] or [np.arange(len(image_of))]  # random triplets: a never-drawn dummy node
    sampler = TonicsBatchSampler(curriculum, nodes, image_of, n, s.refresh_every, cfg.seed)
    return sampler, ["entity"] + [c for c, _ in keep]


def training_data(cfg: Config, ckpt: dict | None, rank: int, size: int) -> TrainData:
    """The run's training data, and the run lengths that depend on it: --epochs in steps, ALBEF's one-epoch
    distillation warm-up, the queue clamped to the training split."""
    tok = tokenizer_for(cfg.model.text_model)
    use_features = cfg.data.input == "features"
    mean, std, _ = image_stats(cfg.model)
    tf_train = None if use_features else train_transform(cfg.data.image_size, mean, std, cfg.data.min_crop_scale,
                                                         cfg.data.augment)
    if use_features and cfg.data.augment != "none":
        console.print(f"note: data.augment={cfg.data.augment} needs pixels; the cached tokens are fixed views, so "
                      "images are not augmented (train on the pixel dataset to augment)", highlight=False)
    tf_eval = None if use_features else eval_transform(cfg.data.image_size, mean, std)
    collate = Collate(tok, cfg.data.max_len, use_features)
    if cfg.sampler.kind != "random" or cfg.data.triplets:
        # TOnICS / GRIT / triplets: positions from a batch sampler, samples read through wids.
        # A GRIT checkpoint from before the sizes were saved in its state used the former default ratios.
        old_grit = ckpt is not None and isinstance(ckpt.get("sampler"), dict) and "m" not in ckpt["sampler"]
        data = index_data(cfg, tf_train, tf_eval, GRIT_RATIOS_BEFORE if old_grit else GRIT_RATIOS, size)
        for note in data["notes"]:
            console.print(note, highlight=False)
        d = TrainData(tok, collate, use_features, data["train"], data["sampler"], data["train"].shards.counts,
                      len(data["train"]), len(data["val"]), 0, data["val"], data["names"])
    else:
        counts = count_split(cfg.shards, cfg.data.val_frac)
        stream = ShardStream(cfg.shards, "train", cfg.data.val_frac, tf_train, seed=cfg.seed,
                             use_features=use_features, rank=rank, world=size, bucket=cfg.data.bucket,
                             batch=cfg.batch_size, lengths=TokenLengths(tok, cfg.data.max_len),
                             skip_bad_shards=cfg.data.skip_bad_shards)
        d = TrainData(tok, collate, use_features, stream, None, stream.counts, counts["train"], counts["val"], 0)
    global_batch = cfg.batch_size * size  # --batch-size is per process
    if d.n_train < global_batch:
        raise TrainError(f"the training split has {d.n_train} {'triplets' if cfg.data.triplets else 'samples'}, "
                         f"fewer than one batch of {global_batch}; lower --batch-size or data.val_frac")
    d.per_epoch = d.n_train // global_batch  # drop_last: every batch is full (hard negatives need B >= 2)
    if d.sampler is None:
        if len(d.train.shards) < size:
            raise TrainError(f"the random sampler gives each process whole shards, and the data has "
                             f"{len(d.train.shards)} shard(s) for {size} processes; write more, smaller shards")
        fit_workers(cfg, d.n_train // size, len(d.train.shards) // size)
    if cfg.epochs > 0:
        cfg.steps = max(1, math.ceil(cfg.epochs * d.per_epoch))
    if cfg.loss.distill_warmup_steps < 0:  # -1: one epoch of this training split (ALBEF); the checkpoint keeps it
        cfg.loss.distill_warmup_steps = d.per_epoch
    return d


def clamp_queue(cfg: Config, n_train: int) -> str | None:
    """model.queue_size clamped to the training split's size; the warning to print when it was longer (after the
    resume checks, whose refusal would make it moot)."""
    asked = cfg.model.queue_size
    cfg.model.queue_size = min(asked, n_train)
    if asked > n_train:
        return (f"warning: model.queue_size {asked:,} is longer than the training split ({n_train:,}): every sample "
                f"would sit in the queue as its own negative more than once; clamped to {n_train:,}")
    return None


def heldout_positions(cfg: Config, d: TrainData) -> None:
    """TOnICS' refresh-check positions and the scored held-out positions, from the validation view, never sharing an
    image: the check takes the first sampler.heldout images of a seeded order (at most half of the split's distinct
    images) and the score the images after them, so a curriculum decision never sees a triplet it is scored on. Triplet mode sets the check's share aside
    whatever the sampler, so a random-batch arm scores the same triplets as its TOnICS twin (same seed and
    sampler.heldout); with pairs the check's images leave the held-out evaluation (`heldout_keys`)."""
    tonics = isinstance(d.sampler, TonicsBatchSampler) and cfg.sampler.kind == "tonics"
    if not (tonics or cfg.data.triplets):
        return
    order = distinct_positions(d.val, len(d.val), cfg.seed)
    reserve = min(cfg.sampler.heldout, len(order) // 2)
    if tonics:
        d.heldout = order[:reserve]
        if len(d.heldout) < 2:
            raise TrainError(f"the TOnICS refresh check needs held-out images and the validation split has "
                             f"{len(order)} distinct images (half of them at most are checked, the rest scored); "
                             "raise data.val_frac")
        if not cfg.data.triplets:
            d.heldout_keys = {d.val.shards.keys[int(d.val.samples[p])] for p in d.heldout}
    if cfg.data.triplets:
        d.val_triplets = order[reserve:reserve + EVAL_TRIPLETS]

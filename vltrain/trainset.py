"""A run's training data: streamed shards, or index-sampled views for GRIT, TOnICS and triplets, with the
held-out positions of TOnICS' refresh check; and `prepare`, which reads the data, then resolves the config."""

from dataclasses import dataclass

import numpy as np

from vlprep.urls import redact
from vltrain import hfclip
from vltrain.config import GRIT_RATIOS, GRIT_RATIOS_BEFORE, Config, grit_sizes
from vlprep.encoders import eval_transform
from vltrain.data.collate import Collate, TokenLengths
from vltrain.data.indexed import IndexedShards, InstanceView
from vltrain.data.samples import train_transform
from vltrain.data.shards import count_split, feature_input, in_val
from vltrain.data.stream import ShardStream
from vltrain.errors import TrainError
from vltrain.evaluate import distinct_positions
from vltrain.model import image_interpolation, image_squash, image_stats, tokenizer_for
from vltrain.resolve import DataFacts, resolve, resolve_towers
from vltrain.samplers import GritSampler, TonicsBatchSampler, TonicsCurriculum, default_ontology, tonics_instances

EVAL_TRIPLETS = 1000  # triplet mode: validation retrieval over at most this many triplets (one per image)


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
    per_epoch: int = 0         # full global batches per epoch
    val: InstanceView | None = None
    names: list | None = None  # TOnICS: the curriculum's node names
    heldout: np.ndarray | None = None       # TOnICS: the refresh check's held-out positions
    val_triplets: np.ndarray | None = None  # triplet mode: the held-out triplets scored at each eval
    heldout_keys: set | None = None         # pairs under TOnICS: the check's images, left out of the scored set


def index_data(cfg: Config, use_features: bool, tf_train, tf_eval, grit_ratios: tuple[int, int] = GRIT_RATIOS,
               world: int = 1) -> dict:
    """Train / val views read through wids, the batch sampler over the train view, the curriculum's node names and
    `notes` (lines for the user).

    Under torchrun (`world` processes) the sampler draws global batches of world x batch_size, the same on every
    rank from the same seed; each rank reads its slice (vltrain.distributed.RankSlice).
    """
    shards = IndexedShards(cfg.shards)
    # one byte per sample, no list of one Python bool per sample on the way
    is_val = np.fromiter((in_val(k, cfg.data.val_frac) for k in shards.keys), dtype=bool, count=len(shards.keys))
    s = cfg.sampler
    n = cfg.batch_size * world
    names = None
    notes = []
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
    s = cfg.sampler
    image_of = train["samples"]
    if len(np.unique(image_of)) < n:
        raise TrainError(f"the training split has {len(np.unique(image_of))} distinct images with "
                         f"{'triplets' if cfg.data.triplets else 'samples'}, fewer than one batch of {n}")
    keep = []
    dropped = []
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


def input_spec(cfg: Config) -> dict | None:
    """The `vlprep features` record of the shards' cached tokens (data.input auto or features), or None for pixels."""
    try:
        spec = feature_input(cfg.shards, cfg.data.input)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if spec is None and cfg.model.image_model == "features":
        raise TrainError("model.image_model=features needs `vlprep features` output as the data")
    return spec


def prepare(cfg: Config, device, ckpt: dict | None = None, rank: int = 0, size: int = 1) -> tuple:
    """(the resolved, read-only config, the TrainData, the notes to print in order): the data is read first, with
    only what resolve leaves as it is, and what resolve needs from it is handed over as DataFacts."""
    cfg, tower_notes = resolve_towers(cfg)  # first: the data pipeline reads the sizes a CLIP tower fixes
    spec = input_spec(cfg)
    if spec is not None and hfclip.is_clip(cfg.model.image_model):
        raise TrainError(f"model.image_model={cfg.model.image_model} reads pixels, and the shards hold `vlprep "
                         "features` tokens: train on the pixel dataset")
    data, notes = training_data(cfg, spec is not None, ckpt, rank, size)
    notes = tower_notes + notes
    streamed = None
    if data.sampler is None:
        streamed = (data.n_train // size, len(data.train.shards) // size)
    facts = DataFacts(features=spec, n_train=data.n_train, per_epoch=data.per_epoch, streamed=streamed)
    resolved, changed = resolve(cfg, device, facts)
    return resolved, data, notes + changed


def training_data(cfg: Config, use_features: bool, ckpt: dict | None, rank: int, size: int) -> tuple:
    """(the run's TrainData, notes for the user). Reads only keys that `resolve` leaves as they are."""
    tok = tokenizer_for(cfg.model.text_model)
    notes = []
    tf_train = None
    tf_eval = None
    if use_features and cfg.data.augment != "none":
        notes.append(f"note: data.augment={cfg.data.augment} needs pixels; the cached tokens are fixed views, so "
                     "images are not augmented (train on the pixel dataset to augment)")
    if not use_features:
        mean, std, _ = image_stats(cfg.model)
        how = image_interpolation(cfg.model)
        tf_train = train_transform(cfg.data.image_size, mean, std, cfg.data.min_crop_scale, cfg.data.augment, how,
                                   cfg.data.decode)
        tf_eval = eval_transform(cfg.data.image_size, mean, std, how, image_squash(cfg.model))
    # the training views are uint8, normalised on the device (to_device); the held-out views are float already
    collate = Collate(tok, cfg.data.max_len, use_features, tf_train.norm if tf_train is not None else None)
    common = dict(tokenizer=tok, collate=collate, use_features=use_features)
    if cfg.sampler.kind != "random" or cfg.data.triplets:
        # TOnICS / GRIT / triplets: positions from a batch sampler, samples read through wids.
        # A GRIT checkpoint from before the sizes were saved in its state used the former default ratios.
        old_grit = ckpt is not None and isinstance(ckpt.get("sampler"), dict) and "m" not in ckpt["sampler"]
        ratios = GRIT_RATIOS_BEFORE if old_grit else GRIT_RATIOS
        data = index_data(cfg, use_features, tf_train, tf_eval, ratios, size)
        notes += data["notes"]
        d = TrainData(**common, train=data["train"], sampler=data["sampler"], counts=data["train"].shards.counts,
                      n_train=len(data["train"]), n_val=len(data["val"]), val=data["val"], names=data["names"])
    else:
        counts = count_split(cfg.shards, cfg.data.val_frac)
        stream = ShardStream(cfg.shards, "train", cfg.data.val_frac, tf_train, seed=cfg.seed,
                             use_features=use_features, rank=rank, world=size, bucket=cfg.data.bucket,
                             batch=cfg.batch_size, lengths=TokenLengths(tok, cfg.data.max_len),
                             skip_bad_shards=cfg.data.skip_bad_shards)
        d = TrainData(**common, train=stream, sampler=None, counts=stream.counts, n_train=counts["train"],
                      n_val=counts["val"])
    global_batch = cfg.batch_size * size  # --batch-size is per process
    if d.n_train < global_batch:
        raise TrainError(f"the training split has {d.n_train} {'triplets' if cfg.data.triplets else 'samples'}, "
                         f"fewer than one batch of {global_batch}; lower --batch-size or data.val_frac")
    d.per_epoch = d.n_train // global_batch  # drop_last: every batch is full (hard negatives need B >= 2)
    if d.sampler is None and len(d.train.shards) < size:
        raise TrainError(f"the random sampler gives each process whole shards, and the data has "
                         f"{len(d.train.shards)} shard(s) for {size} processes; write more, smaller shards")
    return d, notes


def heldout_positions(cfg: Config, d: TrainData) -> None:
    """TOnICS' refresh-check positions and the scored held-out positions, from the validation view, never sharing an
    image: the check takes the first sampler.heldout images of a seeded order (at most half of the split's distinct
    images) and the score the images after them, so a curriculum decision never sees a triplet it is scored on.
    Triplet mode sets the check's share aside whatever the sampler, so a random-batch arm scores the same triplets
    as its TOnICS twin (same seed and sampler.heldout); with pairs the check's images leave the held-out evaluation (`heldout_keys`)."""
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

"""`resolve`: a run's config with every derived value filled in, read-only from then on, and the notes saying what
it changed and why. What it needs from the data comes in `DataFacts`, read from the data before it."""

import copy
import math
from dataclasses import dataclass

from vltrain.config import Config, freeze


@dataclass(frozen=True)
class DataFacts:
    """What the derived values depend on in the data: the `vlprep features` record of cached tokens (None: pixels),
    the training split's size, full global batches per epoch, and for the streamed random sampler each process's
    training samples and shards (None: index-sampled)."""

    features: dict | None
    n_train: int
    per_epoch: int
    streamed: tuple[int, int] | None = None


def resolve(cfg: Config, device, facts: DataFacts) -> tuple[Config, list[str]]:
    """A new, read-only Config with the input kind (and the model keys it implies), loader workers, steps, the
    distillation warm-up and the queue size filled in; and the lines to print about what changed."""
    out = copy.deepcopy(cfg)
    notes = []
    if facts.features is None:
        out.data.input = "pixels"
    else:
        out.data.input = "features"
        out.model.image_model = "features"
        out.model.feature_dim = int(facts.features["dim"])
        out.model.feature_encoder = facts.features
    if out.data.workers < 0:
        # auto: 0 for cached tokens on a CPU, where loading is light and worker processes only compete with torch's
        # threads (and are forked anew each epoch), 2 otherwise
        out.data.workers = 0 if out.data.input == "features" and device.type == "cpu" else 2
    if facts.streamed is not None:
        note = fit_workers(out, *facts.streamed)
        notes += [note] if note else []
    if out.epochs > 0:
        out.steps = max(1, math.ceil(out.epochs * facts.per_epoch))
    if out.loss.distill_warmup_steps < 0:  # -1: one epoch of this training split (ALBEF); the checkpoint keeps it
        out.loss.distill_warmup_steps = facts.per_epoch
    note = clamp_queue(out, facts.n_train)
    notes += [note] if note else []
    return freeze(out), notes


def fit_workers(cfg: Config, n_train: int, n_shards: int) -> str | None:
    """Fewer streaming workers when some would get no shard, or when the data fill less than a batch per worker;
    the warning to print when so.

    Each worker batches its own shards and drops its last partial batch, so with W workers and fewer than W * B
    training samples an epoch can yield no batch at all, and the run would wait forever.
    """
    w = cfg.data.workers
    fit = min(w, n_shards, max(1, n_train // cfg.batch_size))
    if fit >= w:
        return None
    why = (f"{n_train} training samples fill fewer than one batch of {cfg.batch_size} per worker"
           if fit < n_shards else f"the data has {n_shards} shard(s), one worker's share at most")
    cfg.data.workers = fit
    return f"warning: data.workers {w} -> {fit}: {why}"


def clamp_queue(cfg: Config, n_train: int) -> str | None:
    """model.queue_size clamped to the training split's size; the warning to print when it was longer."""
    asked = cfg.model.queue_size
    cfg.model.queue_size = min(asked, n_train)
    if asked > n_train:
        return (f"warning: model.queue_size {asked:,} is longer than the training split ({n_train:,}): every sample "
                f"would sit in the queue as its own negative more than once; clamped to {n_train:,}")
    return None

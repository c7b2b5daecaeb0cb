"""`resolve`: a run's config with every derived value filled in, read-only from then on, and the notes saying what
it changed and why. What it needs from the data comes in `DataFacts`, read from the data before it."""

import copy
import math
import os
from dataclasses import dataclass

from vltrain import hfclip
from vltrain.config import Config, ConfigError, freeze, itc_defaults
from vltrain.config_load import user_set
from vltrain.data.samples import gpu_augment_refusal
from vltrain.model import check_input_size


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
    distillation warm-up, the queue size and the ITC kind (config.itc_defaults) filled in; and the lines to print
    about what changed."""
    out = copy.deepcopy(cfg)
    notes = []
    if facts.features is None:
        out.data.input = "pixels"
        check_input_size(out.model, out.data.image_size)  # a named backbone too small for the size: one line now
    else:
        out.data.input = "features"
        out.model.image_model = "features"
        out.model.feature_dim = int(facts.features["dim"])
        out.model.feature_encoder = facts.features
    check_gpu_decode(out.data, device)
    if out.data.workers < 0:
        out.data.workers, note = auto_workers(node_cpus(), local_ranks(), out.data.input, device.type)
        notes.append(note)
    if out.data.workers == 0 and out.data.prefetch > 0:  # torch refuses prefetch_factor without workers
        notes.append(f"note: data.prefetch {out.data.prefetch} is ignored: data.workers is 0 (batches are loaded in "
                     "the main process when the step asks)")
    if facts.streamed is not None:
        note = fit_workers(out, *facts.streamed)
        notes += [note] if note else []
    if out.epochs > 0:
        out.steps = max(1, math.ceil(out.epochs * facts.per_epoch))
    if out.loss.distill_warmup_steps < 0:  # -1: one epoch of this training split (ALBEF); the checkpoint keeps it
        out.loss.distill_warmup_steps = facts.per_epoch
    note = clamp_queue(out, facts.n_train)
    notes += [note] if note else []
    notes += itc_defaults(out, user_set(cfg, "loss.itc_kind"), user_set(cfg, "model.temp"))  # SigLIP's own loss
    return freeze(out), notes


def check_gpu_decode(data, device) -> None:
    """data.decode gpu where it can run as the CPU view does, else a one-line ConfigError: pixels (there are no JPEGs
    in cached tokens), a CUDA device (nvjpeg), and augment none, whose per-sample crop and flip the loader draws and
    ships with the bytes. albef's RandAugment and softmask's colour ops draw per sample too, and torchvision's
    transforms on a batch tensor draw once for the whole batch (one RandAugment op set, one jitter), so the device
    could only match them with a call per sample, no cheaper than the worker: they are refused."""
    if data.decode != "gpu":
        return
    if data.input == "features":
        raise ConfigError("data.decode=gpu decodes JPEG pixels, and the shards hold `vlprep features` tokens "
                          "(nothing to decode); leave data.decode at cpu")
    if device.type != "cuda":
        raise ConfigError(f"data.decode=gpu decodes JPEGs with nvjpeg on a CUDA device, and this run's device is "
                          f"{device.type}; use data.decode=cpu")
    if data.augment != "none":
        raise ConfigError(gpu_augment_refusal(data.augment))


MAX_AUTO_WORKERS = 16  # past this a loader's workers mostly add start-up time and memory (one forked copy each)


def node_cpus() -> int:
    """The CPUs this process may run on (its affinity set: a container's or a job's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def local_ranks() -> int:
    """The processes torchrun started on this node (LOCAL_WORLD_SIZE), which share its CPUs; 1 outside torchrun."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def auto_workers(cpus: int, ranks: int, input_kind: str, device_type: str) -> tuple[int, str]:
    """data.workers auto: (workers, the note saying why). Each of the node's `ranks` processes gets an equal share of
    its `cpus`, less one for the process itself (it runs the step), capped at MAX_AUTO_WORKERS, at least 1; 0 for
    cached tokens on a CPU, where loading is light and worker processes only compete with torch's threads."""
    if input_kind == "features" and device_type == "cpu":
        return 0, ("note: data.workers auto: 0 (cached tokens on a CPU load in the main process; workers would only "
                   "compete with torch's threads)")
    share = cpus // ranks - 1
    workers = max(1, min(MAX_AUTO_WORKERS, share))
    rank_word = "local rank" if ranks == 1 else "local ranks"
    why = f"{cpus} CPUs for this process / {ranks} {rank_word} - 1 for the main process"
    if share > MAX_AUTO_WORKERS:
        why += f", capped at {MAX_AUTO_WORKERS}"
    elif share < 1:
        why += ", at least 1"
    return workers, f"note: data.workers auto: {workers} ({why})"


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


def resolve_towers(cfg: Config) -> tuple[Config, list[str]]:
    """A copy of cfg whose clip: towers are recorded in model.towers (so a checkpoint rebuilds them without their
    folder) and whose sizes follow them: data.image_size the vision tower's, data.max_len its text positions (its
    context length, so captions are read as the source model reads them) unless the user set it
    (config_load.user_set), and never more, model.embed_dim the towers' embedding width, and a fusion encoder over a
    CLIP or SigLIP text tower fresh (fusion_from=new: a causal CLIP layer is no donor for a bidirectional fusion
    layer); and the notes saying what changed. cfg itself when neither tower is pretrained. An unreadable folder is a
    one-line ConfigError."""
    m = cfg.model
    sides = {side: name for side, name in (("text", m.text_model), ("image", m.image_model)) if hfclip.is_clip(name)}
    if not sides:
        return cfg, []
    out = copy.deepcopy(cfg)
    try:
        out.model.towers = {side: hfclip.tower_record(cfg.model, side) for side in sides}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    towers = out.model.towers
    notes = []

    def follow(section, key: str, value, why: str) -> None:
        if getattr(section, key) != value:
            name = "data" if section is out.data else "model"
            notes.append(f"note: {name}.{key} {getattr(section, key)} -> {value}: {why}")
            setattr(section, key, value)

    if "image" in towers:
        follow(out.data, "image_size", towers["image"]["preprocess"]["size"], "the pretrained vision tower's input size")
    if "text" in towers:
        context = towers["text"]["max_len"]  # the tower's positions: CLIP's 77, SigLIP's 64
        if not user_set(cfg, "data.max_len"):  # captions as long as the source model reads them
            out.data.max_len = context
            kind = "SigLIP" if towers["text"]["model_type"] == "siglip" else "CLIP"
            notes.append(f"note: data.max_len {context}: the {kind} tower's context length (set data.max_len to "
                         "cut captions shorter)")
        elif out.data.max_len > context:
            follow(out.data, "max_len", context, "the pretrained text tower's positions")
    dims = sorted({t["projection_dim"] for t in towers.values()})
    if len(dims) > 1:
        raise ConfigError(f"the pretrained text and image towers embed in {dims[0]} and {dims[1]} dimensions; take "
                          "both from models of one embedding width")
    follow(out.model, "embed_dim", dims[0], "the pretrained towers' embedding width")
    if "text" in towers and out.model.fusion_layers and out.model.fusion_from != "new":
        follow(out.model, "fusion_from", "new", "a CLIP or SigLIP text tower lends no layers to the fusion encoder; "
               f"{out.model.fusion_layers} fresh fusion layer(s) of its width")
    return out, notes

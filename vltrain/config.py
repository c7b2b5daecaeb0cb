"""One dataclass config for `vltrain run`: its sections, the presets, every key's range and the checks of a whole
config, read-only once resolved. How a config is built from a preset, a YAML file and `--set` is vltrain.config_load.
"""

import functools
import re
from dataclasses import FrozenInstanceError, asdict, dataclass, field, fields
from typing import Any

import yaml

from vlprep import MAX_SIZE, MIN_SIZE, VlprepError, cut, objstore
from vlprep.cliargs import check_dataset, check_local
from vlprep.urls import redact
from vltrain.errors import TrainError


class ConfigError(ValueError):
    """A bad preset, file or override; the message is one line and lists the valid choices."""


TEMP_MIN = 0.001  # ALBEF's clamp on the learnable ITC temperature
TEMP_MAX = 0.5
# SigLIP's fresh sigmoid head (Zhai et al. 2023, 3.1 and Algorithm 1): t' = log 10 (t = 10, model.temp 0.1), b = -10
SIGLIP_TEMP = 0.1
SIGLIP_BIAS = -10.0
FUSION_FROM = ("copy", "split", "new")
POOLING = ("cls", "mean")

class Section:
    """A config (section) that can be set while it is built and is read-only once `freeze` has run on it."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_frozen"):
            raise FrozenInstanceError(f"cannot set {name}: a resolved config is read-only (dataclasses.replace "
                                      "makes a changed copy)")
        object.__setattr__(self, name, value)


def freeze(cfg: Section) -> Section:
    """`cfg` and its sections made read-only, in place; returns cfg."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Section):
            freeze(value)
    cfg.__dict__["_frozen"] = True
    return cfg


@dataclass
class ModelConfig(Section):
    """Model architecture; the names map onto `--set model.KEY=VALUE`."""

    # "minilm" (packaged all-MiniLM-L6-v2), "tiny" (random 2x32 BERT), "random:minilm" / "random:bert-base" (those
    # shapes, random init), a local HF dir, or "clip:PATH" (the text tower of a local CLIPModel folder)
    text_model: str = "minilm"
    # "efficientnet-lite0" (packaged), "tiny" (random CNN), "features" (cached tokens), a backbone by name:
    # "torchvision:ARCH" / "timm:NAME" (CNNs and ViTs), weights from `image_weights` (a local state dict), or
    # "clip:PATH" (the vision tower of a local CLIPModel folder)
    image_model: str = "efficientnet-lite0"
    image_weights: str = ""  # torchvision:/timm: backbones: torch.save(model.state_dict(), PATH); "" = random init
    feature_dim: int = 2048  # D_in of precomputed tokens when image_model == "features"
    # image_model == "features": the `vlprep features` record of the frozen encoder that made the tokens (meta.json
    # "features"); with it, raw-pixel images are run through that encoder first. {} = tokens only.
    feature_encoder: dict = field(default_factory=dict)
    embed_dim: int = 256  # ITC projection size
    fusion_layers: int = 2  # N; 0 = no fusion encoder and no ITM/MLM heads (CLIP-style dual encoder)
    # Where the N fusion layers come from: "copy" = self-attention + FFN copied from the text encoder's last N
    # layers, which it keeps (all L); "split" = ALBEF's layout: text encoder = first L - N layers, fusion = last N;
    # "new" = N fresh layers of the text width (what a CLIP text tower gets: its causal layers are no donors)
    fusion_from: str = "copy"
    freeze_image: bool = False
    temp: float = 0.07  # initial ITC temperature
    temp_learnable: bool = True  # false: tau stays at `temp` (A Fistful of Words: fixed 0.02)
    # a learnable ITC bias b (SigLIP's sigmoid loss; SIGLIP_BIAS for a fresh head, a SigLIP folder's own from
    # --init-from): follows loss.itc_kind, set when the config is checked and resolved, not by hand
    itc_bias: bool = False
    pooling: str = "cls"  # text ITC embedding from the [CLS] state (ALBEF) or the masked mean of all states (Fistful)
    momentum: bool = False  # keep an EMA copy (ALBEF momentum distillation)
    momentum_m: float = 0.995
    queue_size: int = 0  # MoCo queue length Q; 0 = in-batch negatives only
    aligner: bool = False  # TOnICS noun-query aligner head (triplet mode)
    # Every dropout rate of the model (text encoder, fusion, aligner, image tower) set to this; 0 also turns off
    # stochastic depth, so a training forward is deterministic. None = each tower's own rates
    dropout: float | None = None
    # FLIP (Li et al. 2023, 3): a ViT image tower keeps a random (1 - p) share of its patch tokens (the class token
    # always) in each training forward; evaluation and export see every token. 0 = off
    patch_dropout: float = 0.0
    # clip: towers: {"text": ..., "image": ...}, each the tower's source, transformers config, projection width and
    # preprocessing, filled in when a run resolves its config, so that a checkpoint rebuilds them without the folder
    towers: dict = field(default_factory=dict)


@dataclass
class DataConfig(Section):
    image_size: int = 224
    max_len: int = 32
    val_frac: float = 0.05          # held out by key hash, never trained on
    val_max: int = 1000             # held-out samples scored at each evaluation (the first in shard order; the size
                                    # of Flickr30K's 1K test split), so its cost does not grow with the dataset; 0 = all
    input: str = "auto"             # auto (features when every folder has `vlprep features` tokens), features, pixels
    workers: int = -1               # DataLoader workers; -1 = auto: the CPUs this process may use / the node's
                                    # torchrun ranks - 1, at most 16, at least 1; 0 on cached tokens on a CPU
    prefetch: int = -1              # batches each loader worker prepares ahead (prefetch_factor); -1 = torch's (2)
    min_crop_scale: float = 0.5     # RandomResizedCrop scale lower bound of augment=none (ALBEF fine-tuning: 0.5)
    triplets: bool = False          # TOnICS triplet mode: instances are (caption, image, noun span) triplets
    # where training JPEGs are decoded: cpu (the loader workers) or gpu (the workers ship the bytes and each sample's
    # crop; the device decodes the batch with torchvision.io.decode_jpeg and crops there; CUDA and augment none only)
    decode: str = "cpu"
    augment: str = "none"           # training images: none (crop + flip), albef (+ RandAugment), softmask (+ colour)
    bucket: int = 8                 # random stream: batches cut from windows of this many batches sorted by caption
                                    # length, so each pads to a similar length; 0 = off (GRIT / TOnICS orders: never)
    skip_bad_shards: bool = False   # random stream: leave out (counted) a shard cut short or, at a URL, unreadable


@dataclass
class LossConfig(Section):
    itc: float = 1.0
    itm: float = 1.0
    mlm: float = 1.0
    mlm_prob: float = 0.15
    distill_alpha: float = 0.0      # momentum distillation weight (ALBEF: 0.4); needs model.momentum
    distill_warmup_steps: int = 0   # alpha ramps up linearly over these steps; 0 = none, -1 = one epoch (ALBEF)
    focal_gamma: float = 0.0        # > 0: SoftMask++ focal ITC instead of plain ITC
    consistency: float = 0.0        # GRIT-VLP ITC consistency weight (lambda_cons, paper: 0.2)
    tonics_ir: float = 0.0          # TOnICS aligner image retrieval loss L_IR (needs model.aligner, data.triplets)
    tonics_tr: float = 0.0          # TOnICS aligner text retrieval loss L_TR
    itm_negatives: str = "sample"   # ITM hard negatives: sample (ALBEF: drawn by in-batch similarity) or hardest (GRIT)
    itm_global_negatives: bool = False  # under torchrun: ITM negatives from every rank's batch (BLIP), not the local one
    itc_detach_keys: bool = False   # no momentum model: keys are sg(features), gradient via queries only (GRIT code)
    # softmax: ITC as InfoNCE over each row (CLIP, ALBEF); sigmoid: SigLIP's pairwise loss (Zhai et al. 2023, 3.1),
    # every image-text pair a binary match with a learnt bias. Towers from a SigLIP folder default to sigmoid
    itc_kind: str = "softmax"
    dedupe: str = "none"            # caption: in-batch byte-identical captions are ITC positives, never ITM negatives
    softmask_itm: float = 0.0       # SoftMask++ soft ITM: positives with soft-masked image tokens are still matches
    softmask_source: str = "gradcam"  # the mask: gradcam (SoftMask++), attention (Table 9), random:R (RandMask)
    masked_text_all: bool = False   # SoftMask++ MMDA: the MLM-masked caption is the text of ITC, ITM and MLM

    @functools.cached_property
    def softmask(self) -> tuple[str, float]:
        """softmask_source parsed: (kind, R); computed once per config (load_config's validation parses it)."""
        return parse_source(self.softmask_source)


def parse_source(source: str) -> tuple[str, float]:
    """'gradcam' | 'attention' | 'random:R' -> (kind, R); ValueError naming the valid forms."""
    kind, _, arg = source.partition(":")
    if kind in ("gradcam", "attention") and not arg:
        return kind, 0.0
    if kind == "random":
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if 0 < ratio < 1:
            return kind, ratio
    raise ValueError(f"unknown loss.softmask_source {source!r}; use gradcam, attention or random:R with R in (0, 1)")



@dataclass
class SamplerConfig(Section):
    kind: str = "random"            # random (streamed shuffle), tonics (ontology curriculum) or grit (grouping)
    ontology: str = ""              # folder with ontology.json + triplets.parquet [default: the first shard folder,
                                    # or the folder `vlprep features` made it from]
    alpha: float = 0.9              # TOnICS: P(entity) <- max(alpha * P(entity), beta) at each refresh
    beta: float = 0.2
    refresh_every: int = 500        # TOnICS: steps between held-out checks (paper: 5K of 500K steps)
    threshold: float = 0.9          # TOnICS: refresh when held-out image retrieval R@1 >= threshold
    heldout: int = 100              # TOnICS: held-out images for the check (at most half the validation split's;
                                    # the held-out score uses the others, never these)
    search_space: int = 0           # GRIT M; 0 = 10 * batch_size (paper 5.1: N=96, M=960)
    queue_size: int = 0             # GRIT L; 0 = 50 * M (paper 5.1: L=48,000 = 50 * 960)


@dataclass
class OptimConfig(Section):
    lr: float = 1e-4
    weight_decay: float = 0.02
    warmup_steps: int = 100
    min_lr_ratio: float = 0.01      # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


SWITCHES = ("auto", "on", "off")
DECODES = ("cpu", "gpu")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
COMPILE_MODES = ("off", "towers", "step")
TRACKERS = ("tensorboard", "wandb", "mlflow")


def step_compile_refusal(cfg) -> str | None:
    """Why train.compile=step cannot trace this run's step as one graph, in a few words; None when it can."""
    if cfg.loss.softmask_itm > 0:
        return ("SoftMask++'s soft ITM (loss.softmask_itm) draws its masks from the run's generator inside the step "
                "and its Grad-CAM takes a second backward")
    if cfg.loss.dedupe == "caption":
        return "loss.dedupe=caption compares the caption strings inside the step"
    if cfg.train.accum_steps > 1:
        return "train.accum_steps > 1 runs the step in phases of its own"
    return None


@dataclass
class TrainConfig(Section):
    """GPU speed options; "auto" turns each on with CUDA and leaves a CPU run as it was."""
    tf32: str | bool = "auto"           # TF32 matmuls and convolutions (CUDA only; auto = on there)
    channels_last: str | bool = "auto"  # NHWC memory format for the CNN image tower and its pixels (auto = on
                                        # CUDA, and on a CPU for a frozen image tower)
    compile: str | bool = "off"         # torch.compile: off; towers (the image and text encoders, in place; true
                                        # in older configs); step (the whole step, forward, losses and backward,
                                        # captions padded to 4 length buckets). Checkpoint keys stay the same
    unpad: bool = True                  # text encoder and fusion layers run on length groups of each batch, each
                                        # cut to its longest caption, instead of the whole batch padded to its longest
    precision: str = "auto"             # fp32, bf16 (autocast), fp16 (autocast + loss scaling); auto: bf16 on a
                                        # GPU with native bf16, fp16 on other CUDA cards, and on a CPU bf16 where it
                                        # has bf16 arithmetic and a quick check finds it faster; else fp32
    accum_steps: int = 1                # K: the towers run on batch_size / K rows at a time (exact: every loss still
                                        # sees the whole batch); 1 = one pass as before
    grad_checkpointing: bool = False    # recompute the text, fusion, aligner and trained image layers' activations
                                        # in the backward pass instead of keeping them: less memory, a slower step
    # where metrics.jsonl's rows also go: tensorboard (tb/), wandb, mlflow (the [wandb] / [mlflow] extras); [] or
    # none = metrics.jsonl alone
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])


BEST_BY = ("mean_recall", "zeroshot_top1")


@dataclass
class EvalConfig(Section):
    """What each held-out evaluation scores besides held-out retrieval, and which score keeps best.pt."""
    # a class-per-folder zero-shot benchmark (ROOT/CLASS/*.jpg, optional ROOT/classnames.txt and templates.txt, as
    # `vltrain eval --zeroshot-folder` reads it), scored on rank 0 at every evaluation; "" = none
    zeroshot_folder: str = ""
    # prompt templates, one per line with {} for the class name (`vltrain eval --templates`); "" = ROOT/templates.txt,
    # else CLIP's 7 ImageNet templates
    zeroshot_templates: str = ""
    best_by: str = "mean_recall"  # the score best.pt holds the best of: held-out mean_recall, or zeroshot_top1


@dataclass
class Config(Section):
    shards: list[str] = field(default_factory=list)
    out: str = "runs/run"
    preset: str = "albef"
    steps: int = 1000
    epochs: float = 0.0             # > 0 overrides steps: epochs over the training split
    batch_size: int = 32
    device: str = "auto"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 500
    ckpt_every: int = 500
    ckpt_minutes: float = 10.0      # also write last.pt whenever this much wall time passed since the last one
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


PRESETS: dict[str, dict[str, Any]] = {
    # dual encoder, ITC only (in-batch; --set model.queue_size=N for a queue)
    "clip": {"model.fusion_layers": 0, "model.momentum": False, "model.queue_size": 0,
             "loss.itm": 0.0, "loss.mlm": 0.0, "loss.distill_alpha": 0.0},
    # ALBEF: ITC with queue + momentum distillation (alpha 0.4, ramped up over the first epoch), ITM with hard
    # negatives, MLM 15%; one BERT split into text and fusion halves (BERT-base 6 + 6; the 6-layer MiniLM 3 + 3)
    "albef": {"model.momentum": True, "model.queue_size": 4096, "loss.distill_alpha": 0.4, "loss.mlm_prob": 0.15,
              "loss.distill_warmup_steps": -1, "model.fusion_from": "split", "model.fusion_layers": 3,
              "data.augment": "albef"},
    # GRIT-VLP's ALBEFBase: ALBEF without the momentum model (so no distillation and no queue), same split (5.1)
    "albef-base": {"model.momentum": False, "model.queue_size": 0, "loss.distill_alpha": 0.0,
                   "loss.mlm_prob": 0.15, "model.fusion_from": "split", "model.fusion_layers": 3},
    # TOnICS: the noun-query aligner on triplets with the ontology curriculum, L_IR + L_TR (no ITC/ITM/MLM); the
    # image encoder is frozen, as the paper's VinVL features are (on `vlprep features` output it is cached anyway)
    "tonics": {"sampler.kind": "tonics", "data.triplets": True, "model.aligner": True, "model.fusion_layers": 0,
               "model.freeze_image": True,
               "model.momentum": False, "model.queue_size": 0, "loss.itc": 0.0, "loss.itm": 0.0, "loss.mlm": 0.0,
               "loss.distill_alpha": 0.0, "loss.tonics_ir": 1.0, "loss.tonics_tr": 1.0},
    # TOnICS with the image retrieval loss alone
    "tonics-ir": {"sampler.kind": "tonics", "data.triplets": True, "model.aligner": True, "model.fusion_layers": 0,
                  "model.freeze_image": True,
                  "model.momentum": False, "model.queue_size": 0, "loss.itc": 0.0, "loss.itm": 0.0, "loss.mlm": 0.0,
                  "loss.distill_alpha": 0.0, "loss.tonics_ir": 1.0, "loss.tonics_tr": 0.0},
    # A Fistful of Words 3: dual encoder, InfoNCE against momentum (EMA) keys in an 8,192-entry memory bank,
    # fixed tau = 0.02, mean-pooled text
    "fistful": {"model.fusion_layers": 0, "model.momentum": True, "model.queue_size": 8192, "model.temp": 0.02,
                "model.temp_learnable": False, "model.pooling": "mean", "loss.itm": 0.0, "loss.mlm": 0.0,
                "loss.distill_alpha": 0.0},
    # SoftMask++: albef's model with focal ITC (gamma 2), ITM, soft ITM on Grad-CAM masks, MLM 15% on the one masked
    # caption every loss reads, strong image augmentation; no distillation (focal ITC replaces ITC)
    "softmask": {"model.momentum": True, "model.queue_size": 4096, "model.fusion_from": "split",
                 "model.fusion_layers": 3, "loss.distill_alpha": 0.0, "loss.focal_gamma": 2.0, "loss.itm": 1.0,
                 "loss.softmask_itm": 1.0, "loss.softmask_source": "gradcam", "loss.mlm": 1.0, "loss.mlm_prob": 0.15,
                 "loss.masked_text_all": True, "data.augment": "softmask"},
    # GRIT-VLP: ALBEFBase + GRIT sampler + ITC consistency (lambda 0.2) + ITM top-1 hard negatives + MLM at 50%
    "grit": {"sampler.kind": "grit", "model.momentum": False, "model.queue_size": 0, "loss.distill_alpha": 0.0,
             "model.fusion_from": "split", "model.fusion_layers": 3, "loss.consistency": 0.2, "loss.mlm_prob": 0.5,
             "loss.itm_negatives": "hardest", "loss.itc_detach_keys": True},
}


def shown(value) -> str:
    return cut(repr(value))


INPUTS = ("auto", "features", "pixels")
AUGMENTS = ("none", "albef", "softmask")
ITM_NEGATIVES = ("sample", "hardest")
DEDUPE = ("none", "caption")
ITC_KINDS = ("softmax", "sigmoid")


# Every numeric key's valid values: [a, b] includes its ends, (a, b) excludes them; docs/TRAINING.md lists the same.
# A value outside (or NaN) is one ConfigError naming the key, the value and the range. optim.betas: each of the two.
RANGES: dict[str, tuple[str, str]] = {
    "steps": ("[0, inf)", "optimiser steps; at least 1 unless epochs > 0"),
    "epochs": ("[0, inf)", "0 = use steps"),
    "batch_size": ("[2, inf)", "contrastive and ITM losses need negatives"),
    "seed": ("[0, 4294967295]", "numpy's seed range"),
    "log_every": ("[1, inf)", "steps"),
    "eval_every": ("[1, inf)", "steps"),
    "ckpt_every": ("[1, inf)", "steps"),
    "ckpt_minutes": ("(0, inf)", "wall-clock minutes"),
    "model.feature_dim": ("[1, inf)", "width of cached image tokens"),
    "model.embed_dim": ("[1, inf)", "ITC projection size"),
    "model.fusion_layers": ("[0, inf)", "0 = no fusion encoder"),
    "model.temp": (f"[{TEMP_MIN}, {TEMP_MAX}]", "the ITC temperature's clamp"),
    "model.momentum_m": ("[0, 1]", "EMA weight of the momentum copy"),
    "model.queue_size": ("[0, inf)", "0 = in-batch negatives only"),
    "model.patch_dropout": ("[0, 1)", "the share of a ViT's patch tokens dropped in training; 0 = off"),
    "data.image_size": (f"[{MIN_SIZE}, {MAX_SIZE}]", "pixels; the image trunks downsample by 32"),
    "data.max_len": ("[2, 512]", "tokens with [CLS] and [SEP]; BERT's position table holds 512"),
    "data.val_frac": ("[0, 1)", "a share of the samples"),
    "data.val_max": ("[0, inf)", "held-out samples scored per evaluation; 0 = all"),
    "data.workers": ("[-1, inf)", "-1 = auto"),
    "data.prefetch": ("[-1, inf)", "batches per loader worker; -1 = torch's default (2); not 0"),
    "data.min_crop_scale": ("(0, 1]", "a share of the image area"),
    "data.bucket": ("[0, 1000]", "batches per length-sorted window; 0 = off"),
    "loss.itc": ("[0, inf)", "a loss weight"),
    "loss.itm": ("[0, inf)", "a loss weight"),
    "loss.mlm": ("[0, inf)", "a loss weight"),
    "loss.mlm_prob": ("[0, 1]", "a probability; in (0, 1) when loss.mlm > 0"),
    "loss.distill_alpha": ("[0, 1]", "the soft targets' share"),
    "loss.distill_warmup_steps": ("[-1, inf)", "steps; -1 = one epoch of the training split"),
    "loss.focal_gamma": ("[0, inf)", "0 = plain ITC"),
    "loss.consistency": ("[0, inf)", "a loss weight"),
    "loss.tonics_ir": ("[0, inf)", "a loss weight"),
    "loss.tonics_tr": ("[0, inf)", "a loss weight"),
    "loss.softmask_itm": ("[0, inf)", "a loss weight"),
    "sampler.alpha": ("(0, 1)", "P(entity) decay factor"),
    "sampler.beta": ("[0, 1]", "P(entity) floor"),
    "sampler.refresh_every": ("[1, inf)", "steps"),
    "sampler.threshold": ("[0, 1]", "held-out R@1 as a fraction"),
    "sampler.heldout": ("[2, inf)", "images"),
    "sampler.search_space": ("[0, inf)", "0 = 10 x batch_size"),
    "sampler.queue_size": ("[0, inf)", "0 = 50 x search_space"),
    "optim.lr": ("[0, inf)", "peak learning rate; 0 keeps the weights (a frozen check run)"),
    "optim.weight_decay": ("[0, inf)", "AdamW decoupled decay"),
    "optim.warmup_steps": ("[0, inf)", "steps"),
    "optim.min_lr_ratio": ("[0, 1]", "the cosine's floor as a share of lr"),
    "optim.grad_clip": ("[0, inf)", "0 = no clipping"),
    "optim.betas": ("[0, 1)", "Adam's two decay rates"),
    "train.accum_steps": ("[1, inf)", "tower chunks per optimiser step; divides batch_size"),
}


def in_range(value: float, interval: str) -> bool:
    """Whether `value` lies in an interval written as in RANGES ("[1, inf)"); NaN never does."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    return ((value >= low) if interval[0] == "[" else (value > low)) and (
        (value <= high) if interval[-1] == "]" else (value < high))


def check_ranges(cfg: Config) -> None:
    for key, (interval, meaning) in RANGES.items():
        value = functools.reduce(getattr, key.split("."), cfg)
        if key == "optim.betas" and len(value) != 2:
            raise ConfigError(f"optim.betas: expected two numbers ({meaning}), got {shown(value)}")
        bad = [v for v in (value if isinstance(value, list) else [value]) if not in_range(v, interval)]
        if bad:
            raise ConfigError(f"{key}={shown(value)} is outside its range {interval} ({meaning})")


# Keys that name local files or folders (a URL is refused in one line, vlprep.cliargs); `shards` may be URLs.
PATH_KEYS = ("shards", "out", "model.text_model", "model.image_weights", "sampler.ontology", "eval.zeroshot_folder",
             "eval.zeroshot_templates")


def validate(cfg: Config) -> None:
    check_ranges(cfg)
    for key in PATH_KEYS:
        value = functools.reduce(getattr, key.split("."), cfg)
        check = check_dataset if key == "shards" else check_local
        try:
            [check(v, key) for v in (value if isinstance(value, list) else [value])]
        except VlprepError as e:
            raise ConfigError(str(e)) from None
    remote = [s for s in cfg.shards if objstore.is_remote(s)]
    if remote and (cfg.sampler.kind != "random" or cfg.data.triplets):
        why = f"sampler.kind={cfg.sampler.kind}" if cfg.sampler.kind != "random" else "data.triplets"
        raise ConfigError(f"{why} reads samples by index (random access), which needs local shards, and {remote[0]} "
                          "is a URL: copy the dataset to a local folder (e.g. aws s3 sync, gcloud storage rsync), or "
                          "train with sampler.kind=random, which streams")
    if cfg.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", cfg.device):
        raise ConfigError(f"unknown device {shown(cfg.device)}; use auto (CUDA when present), cpu, cuda or cuda:N")
    if cfg.steps < 1 and cfg.epochs <= 0:
        raise ConfigError("steps must be at least 1 (or set epochs > 0)")
    if not 0 < cfg.loss.mlm_prob < 1 and cfg.loss.mlm > 0:
        raise ConfigError("loss.mlm_prob must be in (0, 1) when loss.mlm > 0")
    if cfg.data.prefetch == 0:
        raise ConfigError("data.prefetch=0 would have the loader workers prepare no batch; give the batches each "
                          "worker prepares ahead (>= 1), or -1 for torch's default (2)")
    if cfg.data.input not in INPUTS:
        raise ConfigError(f"unknown data.input {shown(cfg.data.input)}; use one of {', '.join(INPUTS)}")
    if cfg.loss.distill_alpha > 0 and not cfg.model.momentum:
        raise ConfigError("loss.distill_alpha > 0 needs model.momentum=true")
    if cfg.model.pooling not in POOLING:
        raise ConfigError(f"unknown model.pooling {shown(cfg.model.pooling)}; use one of {', '.join(POOLING)}")
    if cfg.model.fusion_from not in FUSION_FROM:
        raise ConfigError(f"unknown model.fusion_from {shown(cfg.model.fusion_from)}; use one of "
                          f"{', '.join(FUSION_FROM)}")
    if cfg.model.fusion_from == "split" and cfg.model.fusion_layers == 0:
        raise ConfigError("model.fusion_from=split needs model.fusion_layers >= 1 (the last N text layers become the "
                          "fusion encoder)")
    if (cfg.loss.itm > 0 or cfg.loss.mlm > 0) and cfg.model.fusion_layers == 0:
        raise ConfigError("loss.itm and loss.mlm need a fusion encoder (model.fusion_layers >= 1)")
    if cfg.loss.dedupe not in DEDUPE:
        raise ConfigError(f"unknown loss.dedupe {shown(cfg.loss.dedupe)}; use one of {', '.join(DEDUPE)}")
    if cfg.loss.dedupe != "none" and cfg.loss.focal_gamma > 0:
        raise ConfigError("loss.dedupe=caption needs plain or distilled ITC: focal ITC (loss.focal_gamma > 0) has one "
                          "positive per row")
    if cfg.loss.itc_kind not in ITC_KINDS:
        raise ConfigError(f"unknown loss.itc_kind {shown(cfg.loss.itc_kind)}; use one of {', '.join(ITC_KINDS)}")
    if cfg.loss.itc_kind == "sigmoid" and sigmoid_conflict(cfg):
        raise ConfigError(f"loss.itc_kind=sigmoid (SigLIP's loss) does not combine with {sigmoid_conflict(cfg)}: "
                          "SigLIP has no momentum model, queue, distillation or softmax-based ITC variant; use "
                          "preset clip (or albef-base), or loss.itc_kind=softmax")
    cfg.model.itc_bias = cfg.loss.itc_kind == "sigmoid"
    if cfg.data.decode not in DECODES:
        raise ConfigError(f"unknown data.decode {shown(cfg.data.decode)}; use one of {', '.join(DECODES)}")
    if cfg.data.augment not in AUGMENTS:
        raise ConfigError(f"unknown data.augment {shown(cfg.data.augment)}; use one of {', '.join(AUGMENTS)}")
    if cfg.loss.focal_gamma > 0 and cfg.loss.distill_alpha > 0:
        raise ConfigError("loss.focal_gamma > 0 (focal ITC) replaces ITC, and no published form combines it with "
                          "momentum distillation: set loss.distill_alpha=0 or loss.focal_gamma=0")
    cfg.loss.__dict__.pop("softmask", None)  # parsed anew from the final softmask_source
    try:
        kind, _ = cfg.loss.softmask
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.loss.softmask_itm > 0 and cfg.model.fusion_layers == 0:
        raise ConfigError("loss.softmask_itm needs a fusion encoder (model.fusion_layers >= 1)")
    if cfg.loss.softmask_itm > 0 and kind != "random" and cfg.loss.itm <= 0:
        raise ConfigError(f"loss.softmask_source={kind} reads the ITM positives' cross-attention: set loss.itm > 0 "
                          "(or use random:R)")
    if cfg.loss.masked_text_all and cfg.loss.mlm <= 0:
        raise ConfigError("loss.masked_text_all needs loss.mlm > 0 (it feeds the MLM-masked caption to every loss)")
    if cfg.loss.itm_negatives not in ITM_NEGATIVES:
        raise ConfigError(f"unknown loss.itm_negatives {shown(cfg.loss.itm_negatives)}; use one of "
                          f"{', '.join(ITM_NEGATIVES)}")
    for key in ("tf32", "channels_last"):
        value = getattr(cfg.train, key)
        if isinstance(value, bool):  # YAML reads a bare on / off as a boolean
            setattr(cfg.train, key, "on" if value else "off")
        if getattr(cfg.train, key) not in SWITCHES:
            raise ConfigError(f"train.{key} must be one of {', '.join(SWITCHES)}, got {shown(getattr(cfg.train, key))}")
    if isinstance(cfg.train.compile, bool):  # true / false before the key had modes: true compiled the towers
        cfg.train.compile = "towers" if cfg.train.compile else "off"
    if cfg.train.compile not in COMPILE_MODES:
        raise ConfigError(f"train.compile must be one of {', '.join(COMPILE_MODES)}, got {shown(cfg.train.compile)}")
    if cfg.train.compile == "step":
        why = step_compile_refusal(cfg)
        if why:
            raise ConfigError(f"train.compile=step: {why}; use train.compile=towers")
    if cfg.batch_size % cfg.train.accum_steps:
        raise ConfigError(f"train.accum_steps={cfg.train.accum_steps} must divide batch_size={cfg.batch_size}")
    if cfg.model.dropout is not None and not in_range(cfg.model.dropout, "[0, 1)"):
        raise ConfigError(f"model.dropout={shown(cfg.model.dropout)} is outside its range [0, 1) (a dropout "
                          "probability; null = the towers' own rates)")
    if cfg.train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {shown(cfg.train.precision)}")
    cfg.train.report_to = report_to(cfg.train.report_to)
    s = cfg.sampler
    if s.kind not in SAMPLERS:
        raise ConfigError(f"unknown sampler {shown(s.kind)}; samplers: {', '.join(SAMPLERS)}")
    aligner_loss = cfg.loss.tonics_ir > 0 or cfg.loss.tonics_tr > 0
    if aligner_loss and not (cfg.model.aligner and cfg.data.triplets):
        raise ConfigError("loss.tonics_ir/tonics_tr need model.aligner=true and data.triplets=true")
    if cfg.data.triplets and s.kind == "grit":
        raise ConfigError("data.triplets works with sampler.kind random or tonics, not grit")
    if cfg.data.triplets and (cfg.loss.itm > 0 or cfg.loss.mlm > 0 or cfg.loss.itc > 0) and not aligner_loss:
        raise ConfigError("data.triplets is for the TOnICS aligner: set loss.tonics_ir and/or loss.tonics_tr")
    m, queue = grit_sizes(cfg)
    if s.kind == "grit" and (m < 2 or queue < m):
        raise ConfigError("GRIT needs sampler.search_space >= 2 and sampler.queue_size >= sampler.search_space")
    check_eval(cfg)


def check_eval(cfg: Config) -> None:
    """The eval section's checks: best_by's name and its benchmark, and eval.zeroshot_folder read as a benchmark (its
    classes, classnames.txt, templates) now, so that a bad one stops the run before its first step, not at its first
    evaluation."""
    e = cfg.eval
    if e.best_by not in BEST_BY:
        raise ConfigError(f"unknown eval.best_by {shown(e.best_by)}; use one of {', '.join(BEST_BY)}")
    if e.best_by == "zeroshot_top1" and not e.zeroshot_folder:
        raise ConfigError("eval.best_by=zeroshot_top1 needs eval.zeroshot_folder (the benchmark whose top-1 keeps "
                          "best.pt)")
    if e.zeroshot_templates and not e.zeroshot_folder:
        raise ConfigError("eval.zeroshot_templates needs eval.zeroshot_folder (the benchmark they prompt)")
    if not e.zeroshot_folder:
        return
    if cfg.data.triplets:
        raise ConfigError("eval.zeroshot_folder scores ITC embeddings, which a TOnICS aligner run (data.triplets) "
                          "does not train; leave it empty")
    from vltrain.zsfolder import image_folder, read_templates  # torch: imported only with a benchmark

    key = "eval.zeroshot_folder"
    try:
        image_folder(e.zeroshot_folder)
        key = "eval.zeroshot_templates"
        if e.zeroshot_templates:
            read_templates(e.zeroshot_templates)
    except TrainError as err:
        raise ConfigError(f"{key}: {err}") from None


def sigmoid_conflict(cfg: Config) -> str | None:
    """The first key that rules out the sigmoid ITC (SigLIP's loss has none of these), as 'key=value'; None if none."""
    m, w = cfg.model, cfg.loss
    for key, on in (("model.momentum", m.momentum), ("model.queue_size", m.queue_size > 0),
                    ("loss.distill_alpha", w.distill_alpha > 0), ("loss.focal_gamma", w.focal_gamma > 0),
                    ("loss.consistency", w.consistency > 0), ("loss.itc_detach_keys", w.itc_detach_keys)):
        if on:
            return f"{key}={functools.reduce(getattr, key.split('.'), cfg)}"
    return None


def itc_defaults(cfg: Config, chose_kind: bool, chose_temp: bool) -> list[str]:
    """loss.itc_kind filled in on `cfg` (in place; its towers already recorded in model.towers): sigmoid when a tower
    comes from a SigLIP folder, unless the user chose the kind (chose_kind) or the config rules it out (then softmax,
    said in the note); a fresh sigmoid head (no pretrained tower brings a temperature) starts at SigLIP's t = 10
    unless the user chose model.temp. Returns the notes to print."""
    notes = []
    siglip = any(t.get("model_type") == "siglip" for t in cfg.model.towers.values())
    if siglip and not chose_kind and cfg.loss.itc_kind != "sigmoid":
        conflict = sigmoid_conflict(cfg)
        if conflict is None:
            cfg.loss.itc_kind = "sigmoid"
            notes.append("note: loss.itc_kind sigmoid: SigLIP's own loss for its towers, its temperature and bias "
                         "trained (set loss.itc_kind=softmax for the softmax ITC)")
        else:
            notes.append(f"note: loss.itc_kind softmax, not SigLIP's sigmoid loss: {conflict} needs the softmax ITC")
    cfg.model.itc_bias = cfg.loss.itc_kind == "sigmoid"
    if cfg.model.itc_bias and not cfg.model.towers and not chose_temp and cfg.model.temp != SIGLIP_TEMP:
        notes.append(f"note: model.temp {cfg.model.temp} -> {SIGLIP_TEMP}: SigLIP's initial t = 10 for a fresh "
                     f"sigmoid head (its bias starts at {SIGLIP_BIAS:g})")
        cfg.model.temp = SIGLIP_TEMP
    return notes


def report_to(names: list[str]) -> list[str]:
    """train.report_to as a list of TRACKERS without repeats ("wandb,mlflow" from --set is two; none is none)."""
    found = []
    given = [part.strip() for item in names for part in item.split(",")]
    for name in given:
        if name not in TRACKERS + ("none", ""):
            raise ConfigError(f"train.report_to: unknown tracker {shown(name)}; use {', '.join(TRACKERS)} or none")
        if name not in found + ["none", ""]:
            found.append(name)
    if "none" in given and found:  # "none,wandb" would report to W&B: none means no tracker at all
        raise ConfigError(f"train.report_to: none cannot be combined with a tracker ({', '.join(found)}); give none "
                          "alone, or the trackers alone")
    return found


SAMPLERS = ("random", "tonics", "grit")


GRIT_RATIOS = (10, 50)         # GRIT-VLP 5.1's defaults: N = 96, M = 960 = 10 N, L = 48,000 = 50 M
GRIT_RATIOS_BEFORE = (15, 25)  # what 0 meant before (Table 3's M = 15 N, L = 25 M); for older checkpoints


def grit_sizes(cfg: Config, ratios: tuple[int, int] = GRIT_RATIOS) -> tuple[int, int]:
    """GRIT's (M, L): the configured values, or M = 10 N and L = 50 M (the paper's 5.1 defaults) when left at 0."""
    m = cfg.sampler.search_space or ratios[0] * cfg.batch_size
    return m, cfg.sampler.queue_size or ratios[1] * m


def to_dict(cfg: Config) -> dict:
    """The config as plain builtins (what checkpoints and `vltrain config` hold), dataset URLs redacted: no
    credentials in a file or on the terminal (vlprep.urls)."""
    d = asdict(cfg)
    d["shards"] = [redact(s) for s in d["shards"]]
    return d


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)

"""Checkpoints: what a run saves and restores, the one way to rebuild a model from a checkpoint, and the format.

A run's checkpoint holds the model, optimiser, position in the data (`RunState`), sampler state, RNG states, config
and data signature; `save_checkpoint(path, run, state)` writes it, `restore` reads it back into a run.
`load_checkpoint` / `model_from` rebuild a trained model for eval, embed, pseudolabel, gradcam and resume.

Checkpoints hold only tensors and plain data, are written atomically and are read without the unpickler.

`torch.load(weights_only=True)` accepts tensors, dicts, lists, tuples, strings, numbers, booleans and None and
refuses every other pickle opcode, so a crafted file cannot run code. Everything we save is therefore converted
to those types first (`plain`): numpy arrays become tensors, the numpy RNG state a list of ints, the config a
dict of builtins. Every failure to read or fit a checkpoint is one line (`CheckpointError`).

`load` also reads a `vltrain export` folder (`read_export`: json and safetensors, no pickle at all), whose model is
rebuilt without the training-only tensors the export leaves out (EXPORT_DROPS).
"""

import json
import math
import os
import pickle
import random
import zipfile
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors

from vlprep import MAX_SIZE, MIN_SIZE, versions
from vlprep.urls import redact
from vltrain.errors import TrainError
from vlprep import cut
from vltrain.config import Config, ConfigError, ModelConfig, check_ranges, from_dict, to_dict, upgrade
from vltrain.distributed import barrier, gather_objects, world
from vltrain.model import VLModel, build_model, text_layers

FORMAT = 1  # bumped when the layout below changes incompatibly
REQUIRED = {"model": dict, "config": dict}


class CheckpointError(ValueError):
    """A file that is not a vltrain checkpoint, or one that does not fit the model or the run; one line."""


def plain(obj):
    """`obj` with numpy arrays as tensors and numpy scalars as Python numbers, recursively (weights_only-safe)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def rng_states(generator: torch.Generator) -> dict:
    """Every RNG a run draws from, as tensors and plain data."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "generator": generator.get_state()}


def set_rng_states(rng: dict, generator: torch.Generator) -> None:
    """Restore what `rng_states` saved."""
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    generator.set_state(rng["generator"])


def save(obj: dict, path: Path) -> None:
    """torch.save of plain(obj) to a temporary file, then rename: a crash never leaves a half-written checkpoint."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": FORMAT, **plain(obj)}, tmp)
    os.replace(tmp, path)


def load(path, what: str = "checkpoint") -> dict:
    """Read a checkpoint with weights_only=True and check its layout; CheckpointError (one line) otherwise."""
    path = Path(path)
    if path.is_dir() and is_export(path):
        return read_export(path, what)
    if path.is_dir():
        raise CheckpointError(f"{what} {path} is a folder, not a checkpoint file (last.pt or best.pt)")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} is not a regular file (a FIFO or device)" if path.exists() else
                              f"{what} not found: {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else is not ours
        raise CheckpointError(f"{path}: not a vltrain checkpoint (not a torch.save file, or truncated)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refused a pickle opcode or global: an old checkpoint, or a file crafted to run code.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "unsupported" in ln.lower()), lines[-1] if lines else type(e).__name__)
        why = why.split(". Please use")[0]  # torch goes on to suggest allowlisting the global, an unsafe route
        raise CheckpointError(f"{path}: refused to load: it holds Python objects other than tensors and plain data, "
                              f"which could run code ({why[:160]})") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable vltrain checkpoint (truncated, or not a torch file: "
                              f"{type(e).__name__})") from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path}: not a vltrain checkpoint (expected a dict with 'model' and 'config')")
    for key, typ in REQUIRED.items():
        if not isinstance(ckpt.get(key), typ):
            raise CheckpointError(f"{path}: not a vltrain checkpoint (no '{key}' {typ.__name__})")
    if not isinstance(ckpt["config"].get("model"), dict):
        raise CheckpointError(f"{path}: the checkpoint's config has no 'model' section")
    bad = next((k for k, v in ckpt["model"].items() if not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{path}: model entry {bad!r} is not a tensor")
    fmt = ckpt.get("format", FORMAT)
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointError(f"{path}: checkpoint format {cut(repr(fmt))} is not a version this vltrain reads "
                              f"(it reads {FORMAT})")
    if fmt > FORMAT:
        raise CheckpointError(f"{path}: written by a newer vltrain (checkpoint format {fmt}, this "
                              f"version reads {FORMAT})")
    return ckpt


# --- an export (`vltrain export`, vltrain.export writes it) ------------------------------------------------------

EXPORT_FORMAT, EXPORT_VERSION = "vltrain-export", 1  # config.json's "format" and "version"
CONFIG_JSON_BYTES = 16 << 20  # an export's config.json is a few KB
# What an export leaves out of the state dict: training state that inference never reads, the EMA copy (every key
# under `momentum.`) and the MoCo queues with their pointer. A model rebuilt from an export is built with
# EXPORT_MODEL's values, so it has none of these tensors (rather than random ones) and loading stays strict.
EXPORT_DROPS = ("momentum.", "image_queue", "text_queue", "queue_ptr")
EXPORT_MODEL = {"momentum": False, "queue_size": 0}


def is_export(path: Path) -> bool:
    """Whether a folder is, or claims to be, a `vltrain export` (perhaps unfinished or damaged, which read_export
    says): it holds model.safetensors or config.json. Other folders keep load's "a folder, not a checkpoint"."""
    return (path / "config.json").is_file() or (path / "model.safetensors").is_file()


def untie(state: dict) -> tuple[dict, dict]:
    """(tensors, tied): every tensor once, as safetensors requires, contiguous; `tied` maps each further name of a
    shared tensor (the MLM decoder's weight is the word embeddings) to the name kept, for read_export to restore."""
    seen, tensors, tied = {}, {}, {}
    for name, t in state.items():  # the state dict's order: the first name of a shared tensor is the one kept
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, tied


def read_export(path, what: str = "export") -> dict:
    """A `vltrain export` folder as a checkpoint-shaped dict {"model", "config", "step", "data", "export": True},
    read with json and safetensors only: no unpickler, so nothing in the folder can run code. model_from rebuilds
    it (without EXPORT_DROPS). A missing, truncated or foreign config.json or model.safetensors is one line."""
    path = Path(path)
    meta_path, weights_path = path / "config.json", path / "model.safetensors"
    if not meta_path.is_file():
        raise CheckpointError(f"{what} {path}: not a complete vltrain export (no config.json; an export writes it "
                              "last, so this one did not finish: export again)")
    try:
        if meta_path.stat().st_size > CONFIG_JSON_BYTES:
            raise CheckpointError(f"{meta_path}: {meta_path.stat().st_size:,} bytes; an export's config.json is a "
                                  f"few KB (at most {CONFIG_JSON_BYTES:,})")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{meta_path}: not readable JSON (truncated or corrupt: {type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{what} {path} is a folder, and its config.json is not a vltrain export's (no "
                              f"\"format\": \"{EXPORT_FORMAT}\"); give a checkpoint file (last.pt, best.pt) or an "
                              "export")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{meta_path}: export version {cut(repr(version))} is not a version this vltrain reads "
                              f"(it reads {EXPORT_VERSION})")
    if version > EXPORT_VERSION:
        raise CheckpointError(f"{path}: written by a newer vltrain (export version {version!r}, this version reads "
                              f"{EXPORT_VERSION})")
    config, source, tied = meta.get("config"), meta.get("source") or {}, meta.get("tied") or {}
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{meta_path}: no \"config\" with a \"model\" section")
    for key, value in (("source", source), ("tied", tied)):
        if not isinstance(value, dict):
            raise CheckpointError(f"{meta_path}: \"{key}\" is a {type(value).__name__}, not a mapping")
    if not weights_path.is_file():
        raise CheckpointError(f"{path}: the export has no model.safetensors")
    try:
        weights = load_safetensors(weights_path, device="cpu")
    except (SafetensorError, OSError) as e:
        why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise CheckpointError(f"{weights_path}: not a readable safetensors file (truncated or corrupt: "
                              f"{why})") from None
    # safetensors stores a tensor once: a tied weight (the MLM decoder shares the word embeddings) is listed by name
    for alias, name in tied.items():
        if name not in weights:
            raise CheckpointError(f"{meta_path}: tied weight {alias!r} names {name!r}, which model.safetensors lacks")
        weights[alias] = weights[name]
    return {"model": weights, "config": config, "step": source.get("step"), "data": source.get("data"),
            "export": True}


def model_config(saved: dict, path):
    """ModelConfig from a checkpoint's config['model']; keys unknown to this version are a CheckpointError."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise CheckpointError(f"{path}: model config keys unknown to this version: {', '.join(unknown)}")
    return ModelConfig(**saved)


def load_weights(model, weights: dict, path) -> None:
    """model.load_state_dict(weights) after checking names and shapes, each mismatch said in one line."""
    ours = model.state_dict()
    missing, extra = sorted(set(ours) - set(weights)), sorted(set(weights) - set(ours))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise CheckpointError(f"{path}: weights do not match the model its config builds ({len(missing)} missing, "
                              f"{len(extra)} unexpected, e.g. {what})")
    emb = model.cfg.embed_dim
    saved_emb = weights.get("text_proj.weight", ours["text_proj.weight"]).shape[0]
    if saved_emb != emb:
        raise CheckpointError(f"{path}: checkpoint has embed_dim {saved_emb}, config asks {emb}")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(ours[name].shape):
            raise CheckpointError(f"{path}: dimensions do not match: {name} is {tuple(t.shape)} in the checkpoint "
                                  f"but {tuple(ours[name].shape)} in the model its config builds")
    model.load_state_dict(weights)


# Keys a resumed run may change: how long it runs, where and how it reports, how it loads data, the speed options.
# Keys added with a default that is not the behaviour from before them: a checkpoint older than the key ran as this.
BEFORE_KEY = {"data.bucket": 0, "train.precision": "fp32", "train.unpad": False}
RESUMABLE = {"steps", "epochs", "out", "device", "log_every", "eval_every", "ckpt_every", "ckpt_minutes",
             "data.workers", "train.tf32", "train.channels_last", "train.compile"}


def config_diff(saved: dict, now: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """'key: saved -> now' for every config key that differs, dotted, skipping RESUMABLE keys.

    A key absent from `saved` (a checkpoint older than the key) counts as its value in `defaults`, the dataclass
    defaults, which keep the behaviour from before the key existed."""
    diffs, defaults = [], defaults or {}
    # The preset first: when it differs, it explains most of the other differences.
    for key in sorted(set(saved) | set(now), key=lambda k: (k != "preset", k)):
        dotted = prefix + key
        a, b = saved.get(key, defaults.get(key)), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = defaults.get(key)
            diffs += config_diff(a, b, dotted + ".", sub if isinstance(sub, dict) else None)
        elif dotted not in RESUMABLE and a != b:
            older = " (absent from this older checkpoint)" if key not in saved and key in defaults else ""
            diffs.append(f"{dotted}: {a!r}{older} -> {b!r}")
    return diffs


# --- a trained model ------------------------------------------------------------------------------------------


def check_config(ckpt: dict, path) -> Config:
    """The checkpoint's (or export's) config as a Config, checked before any model is built: the types and RANGES a
    run's config has (vltrain.config), and a size budget: the parameters its sizes imply fit in the weights it holds
    (a crafted model.embed_dim of 1e9 would otherwise allocate gigabytes). One-line CheckpointError naming the key."""
    try:
        cfg = from_dict(ckpt["config"])
        check_ranges(cfg)
        if cfg.model.image_model == "features" and cfg.model.feature_encoder:
            check_feature_encoder(cfg.model.feature_encoder)
    except ConfigError as e:
        raise CheckpointError(f"{path}: its config does not hold: {e}") from None
    m, weights = cfg.model, ckpt["model"]
    held = sum(t.numel() for t in weights.values())

    def width(name: str) -> int:  # a projection's input width as the weights hold it (nn.Linear: (out, in))
        t = weights.get(name)
        return int(t.shape[1]) if t is not None and t.dim() == 2 else 1

    image_width = m.feature_dim if m.image_model == "features" else width("image_proj.weight")
    implied = m.embed_dim * (width("text_proj.weight") + image_width)  # the two ITC projections alone
    if m.queue_size and not ckpt.get("export"):
        implied += 2 * m.queue_size * m.embed_dim
    if implied > held:
        raise CheckpointError(f"{path}: its config implies at least {implied:,} parameters (model.embed_dim "
                              f"{m.embed_dim}, model.queue_size {m.queue_size}, model.feature_dim {m.feature_dim}) "
                              f"and its weights hold {held:,}: the config does not describe these weights")
    return cfg


def check_feature_encoder(spec: dict) -> None:
    """model.feature_encoder, the `vlprep features` record a features model reads pixels through: its size in the
    encoders' range (a size of 1e6 would make each image a 3 TB tensor) and three mean and std numbers."""
    size = spec.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE <= size <= MAX_SIZE:
        raise ConfigError(f"model.feature_encoder.size={cut(repr(size))} is outside its range [{MIN_SIZE}, "
                          f"{MAX_SIZE}] (pixels)")
    for key in ("mean", "std"):
        value = spec.get(key)
        if not (isinstance(value, list) and len(value) == 3 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise ConfigError(f"model.feature_encoder.{key}: expected three numbers, got {cut(repr(value))}")
    if min(spec["std"]) <= 0:
        raise ConfigError(f"model.feature_encoder.std: expected three positive numbers, got {spec['std']}")


def model_from(ckpt: dict, path) -> VLModel:
    """The model a loaded checkpoint describes (on CPU, in train mode), its weights loaded and checked; an export's
    without the EMA copy and queues it does not hold (EXPORT_MODEL). The config is checked first (check_config)."""
    check_config(ckpt, path)
    cfg = model_config(ckpt["config"]["model"], path)
    # pretrained=False: a backbone's model.image_weights file is not read (the checkpoint's weights replace it)
    model = build_model(replace(cfg, **EXPORT_MODEL) if ckpt.get("export") else cfg, pretrained=False)
    load_weights(model, ckpt["model"], path)
    return model


def load_checkpoint(path, device="cpu") -> tuple[VLModel, dict]:
    """A `vltrain run` checkpoint -> (model in eval mode on `device`, its saved config dict).

    Read with weights_only=True (no code runs from the file); the model is rebuilt from ckpt["config"]["model"],
    and every mismatch is a one-line CheckpointError (a ValueError).
    """
    ckpt = load(path)
    return model_from(ckpt, path).to(device).eval(), ckpt["config"]


# --- a run's checkpoints ---------------------------------------------------------------------------------------


class Interrupted(TrainError):
    """Ctrl-C or SIGTERM: last.pt was written; the message says how to go on. `signum`: the signal that stopped the
    run (the exit status is 128 + it, as a shell reports a process the signal killed: 130, 143)."""

    def __init__(self, message: str, signum: int = 2):
        super().__init__(message)
        self.signum = signum


@dataclass
class RunState:
    """Where a run is: optimiser steps taken, data epoch and batches consumed in it, best held-out mean recall, and
    TOnICS' curriculum log (P_S at every held-out check)."""

    step: int = 0
    epoch: int = 0
    consumed: int = 0
    best: float = -1.0
    curriculum_log: list = field(default_factory=list)


@dataclass
class Run:
    """A run's fixed parts: what every checkpoint of it saves besides the RunState."""

    cfg: Config
    model: VLModel
    optimizer: torch.optim.Optimizer
    sampler: object  # GritSampler / TonicsBatchSampler, or None for the streamed random sampler
    generator: torch.Generator  # MLM masks, hard-negative draws, soft masks
    data: str  # the training data's signature (vltrain.data.data_signature)
    out: Path
    stop_signal: int | None = None  # set by the signal handler: save after this step and stop
    init_from: dict | None = None  # --init-from: where the weights came from (init_weights' record), kept by resumes
    precision: str = "fp32"  # what train.precision resolved to (fp32 / bf16); a resumed run keeps it

    @property
    def last_path(self) -> Path:
        return self.out / "last.pt"

    @property
    def best_path(self) -> Path:
        return self.out / "best.pt"


def checkpoint_state(run: Run, state: RunState) -> dict:
    """What last.pt / best.pt hold: weights, optimiser, position in the data, sampler state, RNG states, config,
    `data`, the training data's signature (computed once per run), and `init_from` for a run started from other
    weights (init_weights' record, so that a resumed run still says where it began)."""
    return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "step": state.step,
            "epoch": state.epoch, "consumed": state.consumed, "best": state.best, "config": to_dict(run.cfg),
            "data": run.data, "sampler": run.sampler.state_dict() if run.sampler is not None else None,
            "curriculum_log": state.curriculum_log, "rng": rng_states(run.generator), "versions": versions(),
            "precision": run.precision,
            **({"init_from": run.init_from} if run.init_from else {})}


def save_checkpoint(path: Path, run: Run, state: RunState, every_rank: bool = True) -> None:
    """Write a checkpoint atomically. Under torchrun (every_rank) each rank's RNG states and data position are
    gathered into `ranks`; rank 0 writes and the others wait at a barrier."""
    rank, size = world()
    ranks = None
    if every_rank and size > 1:
        ranks = gather_objects({"rng": rng_states(run.generator), "epoch": state.epoch, "consumed": state.consumed})
    if rank == 0:
        saved = checkpoint_state(run, state)
        if ranks is not None:
            saved["ranks"] = ranks
        save(saved, path)
    if every_rank:
        barrier()


def interrupted(run: Run, state: RunState) -> Interrupted:
    """Write last.pt and return the error that tells the user how to go on."""
    save_checkpoint(run.last_path, run, state)
    return Interrupted(f"stopped at step {state.step} of {run.cfg.steps}: {run.last_path} holds it; run the same "
                       "command with --resume to continue", run.stop_signal or 2)


def check_ranks(ckpt: dict, path: Path, size: int) -> None:
    """A TrainError unless `ckpt` was written by as many processes as this run has."""
    saved_size = len(ckpt.get("ranks") or [None])
    if saved_size != size:  # each rank's RNG states and data position are in the checkpoint
        raise TrainError(f"--resume: {path} was written by {saved_size} process(es) and this run has {size}; "
                         "resume with the same --nproc_per_node")


def check_resumable(ckpt: dict, cfg: Config, data: str, path: Path) -> None:
    """A TrainError unless `ckpt` continues this run: the same config (but RESUMABLE keys) and training data."""
    defaults = to_dict(Config())
    for dotted, value in BEFORE_KEY.items():  # an older checkpoint ran as these keys' former behaviour
        section, key = dotted.split(".")
        defaults[section][key] = value
    diffs = config_diff(upgrade(ckpt["config"]), to_dict(cfg), defaults=defaults)
    if diffs:
        raise TrainError(f"--resume: {path} was trained with another config ({'; '.join(diffs[:8])}"
                         f"{'; ...' if len(diffs) > 8 else ''}); use the same options, or a new --out")
    if ckpt.get("data") not in (None, data):  # None: a checkpoint from before the signature
        raise TrainError(f"--resume: the training data changed since {path} was written (other keys or captions in "
                         f"{', '.join(map(redact, cfg.shards))}); use --overwrite to start over, or a new --out")


def restore(ckpt: dict, run: Run, rank: int, size: int) -> tuple[RunState, dict]:
    """Optimiser and sampler state from a resume checkpoint; returns (the RunState, this rank's RNG states), the
    RNG states to set once the data position has been replayed."""
    run.optimizer.load_state_dict(ckpt["optimizer"])
    state = RunState(ckpt["step"], ckpt["epoch"], ckpt["consumed"], ckpt["best"])
    rng = ckpt["rng"]
    if size > 1:  # each rank continues from its own RNG states and data position
        own = ckpt["ranks"][rank]
        rng, state.epoch, state.consumed = own["rng"], own["epoch"], own["consumed"]
    if run.sampler is not None:
        if ckpt.get("sampler") is None:
            raise TrainError(f"{run.last_path} holds no sampler state: it was not written by a "
                             f"{run.cfg.sampler.kind} run")
        run.sampler.load_state_dict(ckpt["sampler"])
        state.curriculum_log = ckpt.get("curriculum_log", [])
    return state, rng


QUEUES = ("image_queue", "text_queue", "queue_ptr")  # MoCo queues: features of past batches, not weights
MOMENTUM = "momentum."  # the EMA copy's prefix (VLModel.momentum)


def init_weights(model: VLModel, source: dict, path) -> dict:
    """--init-from: a new run's freshly built model takes a checkpoint's (or an export's) weights by name.

    The run's config built `model`, so it decides the architecture: a tensor both hold is loaded (a shape mismatch is
    a one-line CheckpointError naming it), one only the model holds stays as built ("new"), one only the checkpoint
    holds is "dropped". As VLModel does at construction, the EMA copy starts as the online model: a `momentum.*`
    tensor the checkpoint lacks copies the online tensor just loaded (one it holds is loaded, as ALBEF's fine-tuning
    loads its pre-training checkpoint's momentum encoders). The MoCo queues start fresh, as at any start, and a fixed
    temperature (model.temp_learnable=false) keeps the run's model.temp. Returns the record the run prints and keeps
    in its checkpoints and result.json: path, counts, counts per top-level module, notes.
    """
    ours = model.state_dict()
    theirs = {k: v for k, v in source["model"].items() if k not in QUEUES}
    kept = [k for k in ("temp", MOMENTUM + "temp") if k in ours and k in theirs and not model.cfg.temp_learnable]
    shared = [k for k in ours if k in theirs and k not in kept]
    bad = [k for k in shared if tuple(theirs[k].shape) != tuple(ours[k].shape)]
    if bad:
        k = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"--init-from {path}: {k}: checkpoint {tuple(theirs[k].shape)}, model "
                              f"{tuple(ours[k].shape)}{more}; the run's config decides the architecture"
                              f"{_architecture_diff(source['config']['model'], model.cfg)}")
    values = {k: theirs[k] for k in shared}
    # A tied tensor (the MLM decoder shares the word embeddings) is one parameter under two names: both names take
    # the loaded value, or load_state_dict would copy the stale one over it.
    for alias, name in untie(ours)[1].items():
        if name in values or alias in values:
            values.setdefault(name, values.get(alias))
            values.setdefault(alias, values[name])
    copied = [k for k in ours if k.startswith(MOMENTUM) and k not in values and k not in kept]
    model.load_state_dict({**ours, **values})
    notes = _fusion_from_text(model, theirs, values)
    with torch.no_grad():  # the EMA copy the checkpoint lacks: the online tensors as they now are (loaded or built)
        now = model.state_dict()
        for k in copied:
            now[k].copy_(now[k[len(MOMENTUM):]])
    loaded = [k for k in ours if k in values and k not in copied]
    new = [k for k in ours if k not in values and k not in copied and k not in kept and k not in QUEUES]
    dropped = [k for k in theirs if k not in ours]
    notes += _input_notes(source["config"]["model"], model.cfg, path, dropped, new)
    if kept:
        notes.append(f"temp: kept at the run's {model.cfg.temp} (model.temp_learnable=false), not the checkpoint's "
                     f"{float(theirs['temp']):.4g}")
    return {"path": str(path), "step": source.get("step"), "preset": source["config"].get("preset"),
            "loaded": len(loaded), "new": len(new), "dropped": len(dropped), "momentum_copied": len(copied),
            "queues_fresh": any(k in ours for k in QUEUES),
            "modules": {"loaded": _by_module(loaded), "new": _by_module(new), "dropped": _by_module(dropped)},
            "notes": notes}


def _fusion_from_text(model: VLModel, theirs: dict, values: dict) -> list[str]:
    """A fusion encoder the checkpoint lacks is built as VLModel builds one: the self-attention and FFN of fusion
    layer i from the text layer L - N + i, here the checkpoint's (its trained text encoder, e.g. a clip run's, in
    place of the packaged one); cross-attention stays new. Returns the note saying so, or none."""
    if model.fusion is None or any(k.startswith("fusion.") for k in values):
        return []
    import copy

    holder, layers = text_layers(model.text_encoder)
    n = len(model.fusion)
    depth = len(layers) + (n if model.cfg.fusion_from == "split" else 0)  # L: "split" gave its last N to fusion
    want = {k: tuple(v.shape) for k, v in layers[-1].state_dict().items()}
    picked = list(range(depth - n, depth))
    donors = []
    for j in picked:
        prefix = f"text_encoder.{holder}.layer.{j}."
        weights = {k[len(prefix):]: v for k, v in theirs.items() if k.startswith(prefix)}
        if {k: tuple(v.shape) for k, v in weights.items()} != want:
            return []  # the checkpoint's text encoder is not this one's depth or width: the fusion stays as built
        donors.append(weights)
    for fusion_layer, weights in zip(model.fusion, donors):
        donor = copy.deepcopy(layers[-1])
        donor.load_state_dict(weights)
        fusion_layer.load_bert_layer(donor)
    return [f"fusion: self-attention and FFN of its {n} layer(s) from the checkpoint's text layers "
            f"{', '.join(map(str, picked))} (as VLModel builds them from the text encoder's last layers); "
            "cross-attention new"]


def _by_module(names: list[str]) -> dict:
    """Tensor counts per top-level module ('text_encoder', 'fusion', 'momentum', ...), largest first."""
    counts = Counter(name.split(".")[0] for name in names)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _image_side(m: dict) -> str:
    """A model config's image input in words: 'efficientnet-lite0 pixels', 'tokens cached by efficientnet-lite0'."""
    if m.get("image_model") != "features":
        return f"{m.get('image_model')} pixels"
    enc = (m.get("feature_encoder") or {}).get("encoder")
    return f"{m.get('feature_dim')}-d tokens cached by {enc}" if enc else f"{m.get('feature_dim')}-d cached tokens"


def _architecture_diff(saved: dict, cfg: ModelConfig) -> str:
    """'(checkpoint vs run: model.embed_dim 32 vs 16)' for the model keys that shape tensors, '' when none differ."""
    keys = ["embed_dim", "text_model", "fusion_from", "aligner"]
    diffs = [f"model.{k} {saved[k]!r} vs {getattr(cfg, k)!r}" for k in keys
             if k in saved and saved[k] != getattr(cfg, k)]
    if _image_side(saved) != _image_side(vars(cfg)):
        diffs.append(f"image input {_image_side(saved)} vs {_image_side(vars(cfg))}")
    return f" (checkpoint vs run: {'; '.join(diffs)})" if diffs else ""


def _input_notes(saved: dict, cfg: ModelConfig, path, dropped: list, new: list) -> list[str]:
    """What --init-from between a features model and a pixel model means, when the layers above the image encoder
    fit: the cached tokens are that encoder's output, so only the encoder itself is dropped or starts as built."""
    from_features, to_features = saved.get("image_model") == "features", cfg.image_model == "features"
    if from_features == to_features:
        return []
    spec = saved.get("feature_encoder") if from_features else cfg.feature_encoder
    encoder = (spec or {}).get("encoder")
    pixel_model = cfg.image_model if from_features else saved.get("image_model")
    if from_features:
        n = sum(k.startswith("image_encoder.") for k in new)
        same = encoder == pixel_model and not (spec or {}).get("weights")
        how = (" (the packaged weights that cached those tokens)" if same
               else ", not the encoder whose tokens the loaded layers above it were trained on")
        return [f"note: {path} was trained on {_image_side(saved)}; this run reads pixels: its {pixel_model} image "
                f"encoder ({n} tensors) starts as built{how}"]
    n = sum(k.startswith("image_encoder.") for k in dropped)
    same = encoder == pixel_model and saved.get("freeze_image") and not (spec or {}).get("weights")
    how = ", the frozen encoder it was trained with" if same else ", which its loaded layers were not trained on"
    return [f"note: {path} read pixels through its own {pixel_model} image encoder ({n} tensors, dropped); this run "
            f"reads {_image_side(vars(cfg))}{how}"]

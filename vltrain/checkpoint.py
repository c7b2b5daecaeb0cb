"""The checkpoint file: save and load without the unpickler, config checks, `model_from`."""

import math
import os
import pickle
import zipfile
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

from vlprep import MAX_SIZE, MIN_SIZE, cut
from vltrain.config import Config, ConfigError, ModelConfig, check_ranges
from vltrain.config_load import from_dict
from vltrain.errors import CheckpointError, check_version
from vltrain.exportfmt import EXPORT_MODEL, is_export, read_export
from vltrain import hfclip
from vltrain.model import VLModel, build_model

# Checkpoints hold only tensors and plain data, are written atomically and are read without the
# unpickler. `torch.load(weights_only=True)` accepts tensors, dicts, lists, tuples, strings, numbers,
# booleans and None and refuses every other pickle opcode, so a crafted file cannot run code. Everything
# we save is therefore converted to those types first (`plain`): numpy arrays become tensors, the numpy
# RNG state a list of ints, the config a dict of builtins. Every failure to read or fit a checkpoint is
# one line (`CheckpointError`). `load` also reads a `vltrain export` folder (exportfmt.read_export),
# whose model is rebuilt without the tensors an export leaves out.
FORMAT = 1  # bumped when the layout below changes incompatibly
REQUIRED = {"model": dict, "config": dict}


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
    check_version(ckpt.get("format", FORMAT), FORMAT, "checkpoint format", path, path)
    return ckpt


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
    missing = sorted(set(ours) - set(weights))
    extra = sorted(set(weights) - set(ours))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise CheckpointError(f"{path}: weights do not match the model its config builds ({len(missing)} missing, "
                              f"{len(extra)} unexpected, e.g. {what})")
    emb = model.cfg.embed_dim
    saved_emb = weights["text_proj.weight"].shape[0] if "text_proj.weight" in ours else emb  # SigLIP: no projection
    if saved_emb != emb:
        raise CheckpointError(f"{path}: checkpoint has embed_dim {saved_emb}, config asks {emb}")
    for name, t in weights.items():
        if tuple(t.shape) != tuple(ours[name].shape):
            raise CheckpointError(f"{path}: dimensions do not match: {name} is {tuple(t.shape)} in the checkpoint "
                                  f"but {tuple(ours[name].shape)} in the model its config builds")
    model.load_state_dict(weights)


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
    m = cfg.model
    weights = ckpt["model"]
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
    if ckpt.get("tokenizer") and hfclip.is_clip(cfg.text_model):  # the export's copy: the CLIP folder may be gone
        model.tokenizer_dir = ckpt["tokenizer"]
    return model


def load_checkpoint(path, device="cpu") -> tuple[VLModel, dict]:
    """A `vltrain run` checkpoint -> (model in eval mode on `device`, its saved config dict).

    Read with weights_only=True (no code runs from the file); the model is rebuilt from ckpt["config"]["model"],
    and every mismatch is a one-line CheckpointError (a ValueError).
    """
    ckpt = load(path)
    return model_from(ckpt, path).to(device).eval(), ckpt["config"]

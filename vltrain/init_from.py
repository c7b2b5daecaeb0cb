"""`--init-from`: a new run's model takes a checkpoint's (or an export's) weights by name; and the checks that keep
a command's output apart from the inputs it reads (a run's OUT, a result file)."""

import copy
from collections import Counter
from pathlib import Path

import torch

from vltrain.errors import CheckpointError, TrainError
from vltrain.exportfmt import untie
from vltrain.config import ModelConfig
from vltrain.model import VLModel, text_layers

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
    """A fusion encoder the checkpoint lacks is built as VLModel builds one, from the text layers the model
    names (VLModel.fusion_donor_prefixes), here the checkpoint's (its trained text encoder, e.g. a clip
    run's, in place of the packaged one); cross-attention stays new. Returns the note saying so, or none."""
    if model.fusion is None or not model.fusion_donors or any(k.startswith("fusion.") for k in values):
        return []  # no fusion, a fresh one (fusion_from=new), or the checkpoint's own
    template = text_layers(model.text_encoder)[1][-1]  # a text layer: the donors' module and shapes
    want = {k: tuple(v.shape) for k, v in template.state_dict().items()}
    donors = []
    for prefix in model.fusion_donor_prefixes():
        weights = {k[len(prefix):]: v for k, v in theirs.items() if k.startswith(prefix)}
        if {k: tuple(v.shape) for k, v in weights.items()} != want:
            return []  # the checkpoint's text encoder has another depth or width: the fusion stays as built
        donors.append(weights)
    for fusion_layer, weights in zip(model.fusion, donors):
        donor = copy.deepcopy(template)
        donor.load_state_dict(weights)
        fusion_layer.load_bert_layer(donor)
    layers = ", ".join(map(str, model.fusion_donors))
    return [f"fusion: self-attention and FFN of its {len(donors)} layer(s) from the checkpoint's text "
            f"layers {layers} (as VLModel builds them from the text encoder's last layers); "
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
    from_features = saved.get("image_model") == "features"
    to_features = cfg.image_model == "features"
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


def check_out_apart(out, shards: list, init_from, benchmark: str = "") -> None:
    """A run's OUT checked against every input it reads, before anything is written: it may not be a dataset folder
    or lie inside one (the run's files would land in the data), nor be or lie inside the --init-from folder or file
    (an export, a clip: or open_clip: source), nor the zero-shot benchmark (`eval.zeroshot_folder`: its
    learning_curve.png would be scored as an image of a class). A one-line TrainError naming both; a URL never
    overlaps a local OUT."""
    from vlprep.urls import overlap, redact

    from vltrain import hfclip, hub, openclip

    spec = "" if init_from is None else str(init_from)
    if hfclip.is_clip(spec):
        spec = spec[len(hfclip.PREFIX):]
        spec = "" if hub.is_hub(spec) else spec
    elif openclip.is_open_clip(spec):
        rest = spec[len(openclip.PREFIX):]
        spec = rest[len("local-dir:"):] if rest.startswith("local-dir:") else rest.partition(":")[2]
    inputs = [(s, "the dataset") for s in shards] + ([(spec, "the --init-from source")] if spec else []) + \
        ([(benchmark, "the zero-shot benchmark eval.zeroshot_folder")] if benchmark else [])
    for src, what in inputs:
        try:
            relation = overlap(str(out), str(src))
        except (OSError, RuntimeError, ValueError):  # a path that cannot be resolved is no folder OUT could be
            continue
        if relation in ("same", "inside"):
            where = "is" if relation == "same" else "lies inside"
            raise TrainError(f"OUT {redact(str(out))} {where} {what} {redact(str(src))}; choose a folder outside it")


def result_apart(out: Path, checkpoint: Path, folders=(), files=()) -> None:
    """Before the work: a result file may not be the checkpoint or a file of an export given as one (its eval.json,
    or another new name at its top, is fine), lie in a dataset folder the command reads, or be an input file."""
    from vlprep.urls import overlap

    from vltrain.exportfmt import EXPORT_FILES

    def relation(a, b):
        try:
            return overlap(str(a), str(b))
        except (OSError, RuntimeError, ValueError):  # unresolvable: no file the command reads
            return None

    where = relation(out, checkpoint)
    if where == "same" or (where == "inside" and (out.name in EXPORT_FILES or out.parent.resolve() !=
                                                  Path(checkpoint).resolve())):
        raise TrainError(f"--out {out} would overwrite the model it scores ({checkpoint}); choose another file")
    for folder in folders:
        if relation(out, folder) in ("same", "inside"):
            raise TrainError(f"--out {out} lies in the dataset {folder}; choose a file outside it")
    for file in files:
        if file is not None and relation(out, file) == "same":
            raise TrainError(f"--out {out} is the input {file}; choose another file")

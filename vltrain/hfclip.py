"""Pretrained CLIP towers (`clip:PATH`): a local Hugging Face CLIPModel folder's text and vision towers, projections and
temperature as a vltrain model's, and the record a checkpoint keeps to rebuild them without that folder.

A vltrain model with CLIP towers names its tensors as CLIPModel does, under another prefix: `text_model.X` is
`text_encoder.X`, `vision_model.X` is `image_encoder.X`, `text_projection` / `visual_projection` are `text_proj` /
`image_proj` (no bias, as CLIP's), and `logit_scale` is log(1 / temp). So loading a CLIP folder, exporting one
(vltrain.export_hf) and `--init-from clip:PATH` are renames, not conversions.
"""

import json
from pathlib import Path

import torch

from vlprep import cut
from vltrain import hub

PREFIX = "clip:"
MODEL_TYPES = ("clip", "siglip")  # the config.json model_type a clip: folder may have
# CLIP's pixel statistics: a folder without preprocessor_config.json gets them, as transformers' CLIPImageProcessor
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's codes, which preprocessor_config.json's resample holds
# CLIPModel's names of the tensors outside the towers -> vltrain's
RENAMES = {"text_projection.weight": "text_proj.weight", "visual_projection.weight": "image_proj.weight"}
TOWERS = {"text_model.": "text_encoder.", "vision_model.": "image_encoder."}


def is_clip(name) -> bool:
    """Whether a text_model / image_model names a CLIP tower (`clip:PATH`)."""
    return isinstance(name, str) and name.startswith(PREFIX)


def folder(spec: str) -> Path:
    """The local folder of `clip:PATH`, or of `clip:hf-hub:ORG/NAME` (fetched through huggingface_hub's cache); a
    one-line ValueError when it cannot be had or holds no CLIPModel."""
    where = spec[len(PREFIX):]
    path = hub.fetch(where, ["*.json", "*.safetensors", "*.txt"]) if hub.is_hub(where) else Path(where)
    try:
        found = (path / "config.json").is_file()
    except OSError:  # a name too long to be a path
        found = False
    if not found:
        raise ValueError(f"{cut(spec)}: no config.json in {cut(str(path))}; give clip:FOLDER, a local Hugging Face "
                         "CLIPModel folder (what save_pretrained writes)")
    return path


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{cut(str(path))}: not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cut(str(path))}: not a JSON object")
    return data


def clip_config(path: Path):
    """The folder's CLIPConfig or SiglipConfig; a one-line ValueError for another model type, or for values out of
    range or of the wrong type (check_sizes, then transformers' own validation)."""
    from transformers import CLIPConfig, SiglipConfig

    file = path / "config.json"
    raw = read_json(file)
    kind = raw.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{cut(str(path))}: model_type {cut(repr(kind))}; clip: reads a CLIPModel or SiglipModel "
                         f"folder (model_type {' or '.join(MODEL_TYPES)})")
    for side in ("text_config", "vision_config"):
        section = raw.get(side, {})
        if section is not None and not isinstance(section, dict):
            raise ValueError(f"{cut(str(file))}: {side} is a {type(section).__name__}, not a mapping")
        check_sizes(section or {}, side, file)
    check_sizes(raw, "", file, TOP_SIZES if kind == "clip" else ())
    return strict(CLIPConfig if kind == "clip" else SiglipConfig, raw, file)


# The keys that size a tower (and CLIP's projections): a positive integer each, as transformers reads them.
TOWER_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
               "max_position_embeddings", "image_size", "patch_size", "num_channels", "projection_size")
TOP_SIZES = ("projection_dim",)


def check_sizes(section: dict, name: str, file, keys=TOWER_SIZES) -> None:
    """A one-line ValueError naming the key unless each size key present is a positive integer and the width splits
    evenly into the attention heads (transformers' own check says neither which tower nor which file)."""
    where = f"{name}." if name else ""
    for key in keys:
        value = section.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{cut(str(file))}: {where}{key} is {cut(repr(value), 40)}; expected a positive integer")
    width, heads = section.get("hidden_size"), section.get("num_attention_heads")
    if isinstance(width, int) and isinstance(heads, int) and width % heads:
        raise ValueError(f"{cut(str(file))}: {where}hidden_size {width} is not a multiple of {where}"
                         f"num_attention_heads {heads}")


def strict(cls, raw: dict, file):
    """cls.from_dict(raw), with transformers' validation errors (huggingface_hub's StrictDataclassError: a value of
    the wrong type, an architecture that does not hold) as a one-line ValueError naming the file."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return cls.from_dict(raw)
    except (StrictDataclassError, TypeError, ValueError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        raise ValueError(f"{cut(str(file))}: {cut(lines[-1], 160)}") from None


def projection_width(conf) -> int:
    """The width both towers' embeddings have: CLIP's projection_dim; SigLIP has no projections, its text head maps
    to the vision tower's width."""
    if conf.model_type == "clip":
        return int(conf.projection_dim)
    text = int(getattr(conf.text_config, "projection_size", None) or conf.text_config.hidden_size)
    if text != conf.vision_config.hidden_size:
        raise ValueError(f"a SigLIP whose text head gives {text} dimensions and vision tower "
                         f"{conf.vision_config.hidden_size}: its embeddings cannot be compared")
    return text


def preprocess(path: Path, vision, kind: str = "clip") -> dict:
    """The image preprocessing the folder's image processor does: CLIP's shorter side to S and centre crop S x S, or
    SigLIP's resize of the whole image to S x S ("resize": "squash"), with its mean, std and interpolation. A CLIP
    processor that resizes to another size than it crops is refused (vltrain's transform resizes the shorter side to
    the crop size)."""
    file = path / "preprocessor_config.json"
    raw = read_json(file) if file.is_file() else {}
    if kind == "siglip":
        size = raw.get("size", {"height": vision.image_size})
        size = size.get("height", vision.image_size) if isinstance(size, dict) else int(size)
        if size != vision.image_size:
            raise ValueError(f"{cut(str(file))}: resizes to {size}, and the vision tower reads {vision.image_size}")
        resample = RESAMPLE.get(raw.get("resample", 3))
        if resample is None:
            raise ValueError(f"{cut(str(file))}: resample {raw.get('resample')!r} is none of {sorted(RESAMPLE)}")
        return {"size": int(size), "mean": [float(v) for v in raw.get("image_mean", (0.5,) * 3)],
                "std": [float(v) for v in raw.get("image_std", (0.5,) * 3)], "interpolation": resample,
                "resize": "squash"}
    crop = raw.get("crop_size", vision.image_size)
    crop = crop.get("height", vision.image_size) if isinstance(crop, dict) else int(crop)
    size = raw.get("size", crop)
    size = size.get("shortest_edge", crop) if isinstance(size, dict) else int(size)
    if crop != vision.image_size or size != crop:
        raise ValueError(f"{cut(str(file))}: resizes to {size} and crops {crop}, and the vision tower reads "
                         f"{vision.image_size}; vltrain resizes the shorter side to the tower's size and crops that")
    resample = RESAMPLE.get(raw.get("resample", 3))
    if resample is None:
        raise ValueError(f"{cut(str(file))}: resample {raw.get('resample')!r} is none of {sorted(RESAMPLE)} "
                         "(nearest, bilinear, bicubic)")
    return {"size": int(crop), "mean": [float(v) for v in raw.get("image_mean", OPENAI_MEAN)],
            "std": [float(v) for v in raw.get("image_std", OPENAI_STD)], "interpolation": resample,
            "resize": "shorter"}


def record(spec: str, side: str) -> dict:
    """What a checkpoint keeps of a CLIP tower: its source, the tower's transformers config, the projection width,
    and the image preprocessing (image side) or the longest text (text side)."""
    path = folder(spec)
    conf = clip_config(path)
    tower = conf.text_config if side == "text" else conf.vision_config
    rec = {"source": spec, "model_type": conf.model_type, "projection_dim": projection_width(conf),
           "config": json.loads(json.dumps(tower.to_dict()))}  # as JSON has it (an export's copy): string keys
    if side == "text":
        check_tokenizer(path)
        rec["max_len"] = int(conf.text_config.max_position_embeddings)
        if conf.model_type == "siglip":  # SigLIP reads every caption padded to its full length, unmasked
            rec["pad_to"] = rec["max_len"]
            rec["pad_id"] = int(conf.text_config.pad_token_id)
    else:
        rec["preprocess"] = preprocess(path, conf.vision_config, conf.model_type)
    return rec


# Two captions a usable tokenizer encodes to word tokens, and to different ones.
PROBES = ("a photo of a dog", "two red cars on a street")


def check_tokenizer(path: Path) -> None:
    """A one-line ValueError unless the tokenizer in the folder `path` (a CLIP folder, or an export's copy of its
    tokenizer) loads as a run loads it and is usable (usable_tokenizer)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for missing or broken tokenizer files
        raise ValueError(f"{cut(str(path))}: its tokenizer does not load ({type(e).__name__}: "
                         f"{cut(str(e).strip().splitlines()[0] if str(e).strip() else '', 100)})") from None
    usable_tokenizer(tok, path)


def usable_tokenizer(tok, path) -> None:
    """A one-line ValueError unless `tok` encodes a caption to more than its special tokens and two captions to
    different ids: a folder without tokenizer files gets an empty 2-token tokenizer from transformers, which maps
    every caption to the same ids, and every text to the same embedding."""
    special = set(tok.all_special_ids)
    first, second = (list(tok(text)["input_ids"]) for text in PROBES)
    if first == second or all(i in special for i in first):
        raise ValueError(f"{cut(str(path))}: no usable tokenizer: it encodes {PROBES[0]!r} as {cut(str(first), 40)} "
                         f"(special tokens only, {len(tok)} in its vocabulary), every caption alike; the folder needs "
                         "the tokenizer files save_pretrained writes (tokenizer.json, vocab.json and merges.txt, or "
                         "spiece.model)")


def tower_record(cfg, side: str) -> dict:
    """cfg.towers' record of a side (filled in when a run resolves its config), else read from the folder."""
    name = cfg.text_model if side == "text" else cfg.image_model
    rec = (cfg.towers or {}).get(side)
    return rec if rec and rec.get("source") == name else record(name, side)


def tower_classes(kind: str, side: str) -> tuple:
    """(model class, config class) of a side's tower: CLIP's or SigLIP's text or vision model."""
    import transformers

    family = "CLIP" if kind == "clip" else "Siglip"
    part = "Text" if side == "text" else "Vision"
    return getattr(transformers, f"{family}{part}Model"), getattr(transformers, f"{family}{part}Config")


def build_tower(cfg, side: str, pretrained: bool = True):
    """CLIP's or SigLIP's text or vision model for a side; pretrained: with the folder's weights, else as built (a
    checkpoint's weights replace them)."""
    rec = tower_record(cfg, side)
    cls, conf = tower_classes(rec["model_type"], side)
    where = f"model.towers.{side}.config"  # a checkpoint's or an export's copy of the folder's tower config
    if not isinstance(rec.get("config"), dict):
        raise ValueError(f"{where}: not a mapping")
    check_sizes(rec["config"], "", where)
    tower = cls(strict(conf, rec["config"], where))
    if pretrained:
        prefix = "text_model." if side == "text" else "vision_model."
        weights = {k[len(prefix):]: v for k, v in folder_weights(folder(rec["source"]), prefix).items()}
        missing, unexpected = tower.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]  # a buffer older files may lack
        if missing or unexpected:
            raise ValueError(f"{cut(rec['source'])}: the {side} tower's weights do not fit its config ("
                             f"{len(missing)} missing, {len(unexpected)} unexpected, e.g. "
                             f"{cut(str((missing or unexpected)[0]))})")
    return tower


def folder_weights(path: Path, prefix: str = "") -> dict:
    """The tensors of a Hugging Face folder's safetensors weights (one file, or shards listed by their index) whose
    names start with `prefix`; the others are not read (one tower's weights without the other's)."""
    from safetensors import safe_open

    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({path / name for name in read_json(index).get("weight_map", {}).values()})
    else:
        raise ValueError(f"{cut(str(path))}: no model.safetensors; save the model with save_pretrained (transformers "
                         "writes safetensors) — vltrain does not unpickle .bin weights")
    out = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                out.update((k, f.get_tensor(k)) for k in f.keys() if k.startswith(prefix))
        except Exception as e:  # a truncated or foreign file: safetensors raises its own types and OSError
            raise ValueError(f"{cut(str(file))}: not readable safetensors ({type(e).__name__})") from None
    return out


def _renamed(state: dict, names: dict, prefixes: dict) -> dict:
    """The tensors of `state` whose name `names` maps, or that start with a key of `prefixes` (re-prefixed); the
    others are left out."""
    out = {}
    for name, t in state.items():
        if name in names:
            out[names[name]] = t
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is not None:
            out[prefixes[prefix] + name[len(prefix):]] = t
    return out


def to_vltrain(state: dict) -> dict:
    """A CLIPModel (or SiglipModel) state dict under vltrain's names: towers re-prefixed, projections renamed,
    logit_scale as temp (SigLIP's logit_bias keeps its name)."""
    out = _renamed(state, {**RENAMES, "logit_bias": "logit_bias"}, TOWERS)
    if "logit_scale" in state:  # logits = cos * exp(logit_scale) = cos / temp (SigLIP keeps it as (1,))
        out["temp"] = torch.exp(-state["logit_scale"].double()).float().reshape(())
    return out


def to_clip(state: dict) -> dict:
    """The inverse of to_vltrain for the tensors a CLIPModel holds: towers, projections, logit_scale."""
    back = {**{v: k for k, v in RENAMES.items()}, "logit_bias": "logit_bias"}
    out = _renamed(state, back, {v: k for k, v in TOWERS.items()})
    if "temp" in state:
        out["logit_scale"] = torch.log(1 / state["temp"].double()).float().reshape(())
    return out


def init_source(spec: str) -> dict:
    """`--init-from clip:PATH` as init_weights reads a checkpoint: the folder's weights under vltrain's names and a
    model config saying what they are."""
    path = folder(spec)
    conf = clip_config(path)
    weights = to_vltrain(folder_weights(path))
    model = {"text_model": spec, "image_model": spec, "embed_dim": projection_width(conf)}
    return {"model": weights, "config": {"model": model, "preset": None}, "step": None}

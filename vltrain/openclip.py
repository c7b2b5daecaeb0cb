"""open_clip's CLIP models and transformers' CLIPModel as one another: `--init-from open_clip:ARCH:WEIGHTS` (converted
to a CLIPModel folder, then read as clip:PATH) and `vltrain export --format open_clip` (CLIP towers written as an
open_clip `local-dir:` folder).

Only open_clip's plain CLIP architecture converts, the one OpenAI's ViT models have (ViT-B-32, ViT-B-16, ViT-L-14
and their -quickgelu variants): a ViT image tower of pre-LayerNorm blocks with a class token, and open_clip's own
causal text transformer pooled at the end-of-text token. A timm or Hugging Face tower, attentional pooling, or any
other option changes the network, and is a one-line error naming the option.
"""

import json
from pathlib import Path

import torch

from vlprep import cut
from vltrain import hfclip

PREFIX = "open_clip:"
CONFIG = "open_clip_config.json"
WEIGHTS = "open_clip_model.safetensors"
# the open_clip config keys of the plain CLIP architecture, and their defaults (others change the network)
VISION_KEYS = {"image_size", "layers", "width", "patch_size", "head_width", "mlp_ratio"}
TEXT_KEYS = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}
MODEL_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "custom_text"}


def is_open_clip(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def read(spec: str) -> tuple[dict, dict, dict]:
    """(model_cfg, preprocess_cfg, state dict) of `open_clip:ARCH:WEIGHTS` (a built-in architecture name and a local
    weights file: .safetensors, or a torch file read with weights_only=True) or `open_clip:local-dir:FOLDER`."""
    where = spec[len(PREFIX):]
    if where.startswith("local-dir:"):
        folder = Path(where[len("local-dir:"):])
        if not (folder / CONFIG).is_file():
            raise ValueError(f"{cut(spec)}: no {CONFIG} in {cut(str(folder))}")
        raw = hfclip.read_json(folder / CONFIG)
        model_cfg = raw.get("model_cfg")
        preprocess = raw.get("preprocess_cfg") or {}
        files = [folder / WEIGHTS, folder / "open_clip_pytorch_model.bin", folder / "open_clip_model.pt"]
        weights = next((f for f in files if f.is_file()), None)
        if weights is None:
            raise ValueError(f"{cut(spec)}: no weights ({', '.join(f.name for f in files)}) in {cut(str(folder))}")
    else:
        arch, _, file = where.partition(":")
        model_cfg = builtin_config(arch)
        if model_cfg is None:
            raise ValueError(f"{cut(spec)}: open_clip has no architecture {cut(repr(arch))} (open_clip.list_models() "
                             "lists them); give open_clip:ARCH:WEIGHTS or open_clip:local-dir:FOLDER")
        weights = Path(file)
        preprocess = {}
        if not file or not weights.is_file():
            raise ValueError(f"{cut(spec)}: weights file {cut(repr(file))} not found; give open_clip:ARCH:WEIGHTS with "
                             "a local weights file")
    if not isinstance(model_cfg, dict):
        raise ValueError(f"{cut(spec)}: no model_cfg")
    return model_cfg, preprocess, _weights(weights)


def builtin_config(arch: str) -> dict | None:
    """open_clip's model config of a built-in architecture, read from its packaged JSON (without importing open_clip,
    whose tokenizer module sets TOKENIZERS_PARALLELISM in the environment); None when it has none by that name."""
    import importlib.util

    found = importlib.util.find_spec("open_clip")
    if found is None:
        raise ValueError("open_clip:ARCH needs open_clip's architecture list: pip install 'vlprep-vltrain[open_clip]'")
    file = Path(found.origin).parent / "model_configs" / f"{arch}.json"
    if "/" in arch or not file.is_file():
        return None
    return hfclip.read_json(file)


def _weights(path: Path) -> dict:
    """A state dict from .safetensors, or from a torch file with weights_only=True (no code runs); a checkpoint
    holding {"state_dict": ...} (open_clip's training checkpoints, "module."-prefixed under DDP) is unwrapped. Any
    other file (text, parquet, a pickle of other objects, a truncated zip) is a one-line ValueError."""
    import warnings

    from safetensors import SafetensorError

    def refuse(why: str):
        return ValueError(f"{cut(str(path))}: not an open_clip checkpoint ({why})")

    try:
        if path.suffix == ".safetensors":
            return _safe(path)
        with warnings.catch_warnings():  # the weights-only unpickler's notes on pickle protocols: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, SafetensorError) as e:
        raise refuse(f"not readable weights: {type(e).__name__}") from None
    except Exception as e:  # weights_only=True refuses what is no tensor file, with whatever error it meets first
        raise refuse(f"not readable weights: {type(e).__name__}, not a torch or safetensors file of tensors") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise refuse(f"holds a {type(state).__name__}, not a state dict")
    bad = next((k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise refuse(f"{cut(repr(bad), 40)} is a {type(state[bad]).__name__}, not a tensor")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def _safe(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def check_plain(model_cfg: dict) -> None:
    """A one-line ValueError unless model_cfg is the plain CLIP architecture (module docstring)."""
    extra = set(model_cfg) - MODEL_KEYS
    extra |= {f"vision_cfg.{k}" for k in set(model_cfg.get("vision_cfg", {})) - VISION_KEYS}
    extra |= {f"text_cfg.{k}" for k in set(model_cfg.get("text_cfg", {})) - TEXT_KEYS}
    if extra or not isinstance(model_cfg.get("vision_cfg", {}).get("layers"), int):
        what = ", ".join(sorted(extra)) or "a ResNet image tower"
        raise ValueError(f"open_clip architecture with {cut(what)}: only the plain CLIP ViT architecture (OpenAI's "
                         "ViT models) converts to CLIP towers")


def hf_config(model_cfg: dict):
    """transformers' CLIPConfig of the same network as open_clip's plain CLIP model_cfg."""
    from transformers import CLIPConfig

    check_plain(model_cfg)
    v = model_cfg["vision_cfg"]
    t = model_cfg["text_cfg"]
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"
    vision = {"hidden_size": v["width"], "num_hidden_layers": v["layers"], "image_size": v["image_size"],
              "patch_size": v["patch_size"], "num_attention_heads": v["width"] // v.get("head_width", 64),
              "intermediate_size": int(v["width"] * v.get("mlp_ratio", 4.0)), "hidden_act": act,
              "layer_norm_eps": 1e-5}
    text = {"hidden_size": t["width"], "num_hidden_layers": t["layers"], "num_attention_heads": t["heads"],
            "intermediate_size": int(t["width"] * t.get("mlp_ratio", 4.0)), "hidden_act": act,
            "vocab_size": t["vocab_size"], "max_position_embeddings": t["context_length"], "layer_norm_eps": 1e-5,
            "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 49407}
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=model_cfg["embed_dim"])


def model_cfg_of(config) -> dict:
    """open_clip's model_cfg of a CLIPConfig's text and vision configs (the inverse of hf_config)."""
    v = config.vision_config
    t = config.text_config
    acts = {v.hidden_act, t.hidden_act}
    if not acts <= {"gelu", "quick_gelu"} or len(acts) > 1 or v.hidden_size % v.num_attention_heads:
        raise ValueError(f"CLIP towers with activations {sorted(acts)}: open_clip's plain CLIP uses one of gelu and "
                         "quick_gelu in both towers")
    cfg = {"embed_dim": config.projection_dim,
           "vision_cfg": {"image_size": v.image_size, "layers": v.num_hidden_layers, "width": v.hidden_size,
                          "patch_size": v.patch_size, "head_width": v.hidden_size // v.num_attention_heads,
                          "mlp_ratio": v.intermediate_size / v.hidden_size},
           "text_cfg": {"context_length": t.max_position_embeddings, "vocab_size": t.vocab_size,
                        "width": t.hidden_size, "heads": t.num_attention_heads, "layers": t.num_hidden_layers,
                        "mlp_ratio": t.intermediate_size / t.hidden_size}}
    if acts == {"quick_gelu"}:
        cfg["quick_gelu"] = True
    return cfg


# per block: open_clip's name -> transformers' (the fused in_proj is split into q, k, v)
BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj", "mlp.c_fc": "mlp.fc1",
         "mlp.c_proj": "mlp.fc2"}
# open_clip's names outside the blocks -> transformers' (a callable changes the tensor too)
FLAT = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        "positional_embedding": "text_model.embeddings.position_embedding.weight",
        "ln_final.weight": "text_model.final_layer_norm.weight", "ln_final.bias": "text_model.final_layer_norm.bias",
        "visual.class_embedding": "vision_model.embeddings.class_embedding",
        "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
        "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
        "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
        "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
        "visual.ln_post.weight": "vision_model.post_layernorm.weight",
        "visual.ln_post.bias": "vision_model.post_layernorm.bias", "logit_scale": "logit_scale"}
TRANSPOSED = {"text_projection": "text_projection.weight", "visual.proj": "visual_projection.weight"}
TOWERS = {"transformer.resblocks.": "text_model.encoder.layers.", "visual.transformer.resblocks.":
          "vision_model.encoder.layers."}


def to_hf(state: dict) -> dict:
    """open_clip's plain CLIP state dict under CLIPModel's names (the attention's fused in_proj split in three)."""
    out = {}
    for name, t in state.items():
        if name in FLAT:
            out[FLAT[name]] = t
        elif name in TRANSPOSED:
            out[TRANSPOSED[name]] = t.t().contiguous()
        elif name == "attn_mask":
            continue  # the causal mask: a buffer CLIPTextModel builds itself
        else:
            tower = next((p for p in sorted(TOWERS, key=len, reverse=True) if name.startswith(p)), None)
            if tower is None:
                raise ValueError(f"open_clip weights: unexpected tensor {cut(repr(name))} (not the plain CLIP "
                                 "architecture)")
            index, _, rest = name[len(tower):].partition(".")
            base = f"{TOWERS[tower]}{index}."
            if rest.startswith("attn.in_proj_"):
                kind = rest.rsplit("_", 1)[1]  # weight or bias
                for part, chunk in zip(("q", "k", "v"), t.chunk(3, dim=0)):
                    out[f"{base}self_attn.{part}_proj.{kind}"] = chunk.contiguous()
            else:
                module, _, kind = rest.rpartition(".")
                out[f"{base}{BLOCK[module]}.{kind}"] = t
    return out


def from_hf(state: dict) -> dict:
    """CLIPModel's state dict under open_clip's names (the inverse of to_hf)."""
    flat = {v: k for k, v in FLAT.items()}
    transposed = {v: k for k, v in TRANSPOSED.items()}
    block = {v: k for k, v in BLOCK.items()}
    towers = {v: k for k, v in TOWERS.items()}
    out = {}
    qkv = {}
    for name, t in state.items():
        if name in flat:
            out[flat[name]] = t
        elif name in transposed:
            out[transposed[name]] = t.t().contiguous()
        elif name.endswith("position_ids"):
            continue
        else:
            tower = next(p for p in towers if name.startswith(p))
            index, _, rest = name[len(tower):].partition(".")
            base = f"{towers[tower]}{index}."
            module, _, kind = rest.rpartition(".")
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault(f"{base}attn.in_proj_{kind}", {})[module[-6]] = t
            else:
                out[f"{base}{block[module]}.{kind}"] = t
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def preprocess_of(preprocess_cfg: dict, size: int) -> dict:
    """A CLIPImageProcessor's settings from open_clip's preprocess_cfg (its defaults: OpenAI's statistics, bicubic)."""
    how = preprocess_cfg.get("interpolation", "bicubic")
    mode = preprocess_cfg.get("resize_mode", "shortest")
    if how not in ("bicubic", "bilinear") or mode != "shortest" or int(preprocess_cfg.get("size", size)) != size:
        raise ValueError(f"open_clip preprocess_cfg {cut(json.dumps(preprocess_cfg))}: vltrain resizes the shorter "
                         "side to the tower's size (bicubic or bilinear) and crops the centre")
    code = {v: k for k, v in hfclip.RESAMPLE.items()}[how]
    return {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size},
            "image_mean": list(preprocess_cfg.get("mean", hfclip.OPENAI_MEAN)),
            "image_std": list(preprocess_cfg.get("std", hfclip.OPENAI_STD)), "resample": code}


def convert(spec: str, folder: Path) -> Path:
    """Write `open_clip:...` as a CLIPModel folder (config, safetensors weights, CLIP's tokenizer, image processor),
    checked strictly: every tensor of the CLIPModel filled, none of open_clip's left over."""
    from transformers import CLIPImageProcessor, CLIPModel

    model_cfg, preprocess, state = read(spec)
    config = hf_config(model_cfg)
    model = CLIPModel(config)
    weights = to_hf(state)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"{cut(spec)}: the weights do not fit the architecture ({len(missing)} missing, "
                         f"{len(unexpected)} unexpected, e.g. {cut(str((missing or unexpected)[0]))})")
    folder.mkdir(parents=True, exist_ok=True)
    from vltrain.model import _quiet_transformers

    with _quiet_transformers():
        model.save_pretrained(str(folder))
    clip_tokenizer().save_pretrained(str(folder))
    CLIPImageProcessor(**preprocess_of(preprocess, config.vision_config.image_size)).save_pretrained(str(folder))
    return folder


def clip_tokenizer():
    """CLIP's BPE tokenizer (what open_clip's plain models use) from open_clip's packaged merges, built offline as
    transformers' own conversion builds it: 256 byte characters, each with the word-end mark, the 48,894 merges,
    and the start and end tokens (49,408 in all)."""
    import gzip
    import importlib.util

    from transformers import CLIPTokenizer

    path = Path(importlib.util.find_spec("open_clip").origin).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    chars = byte_characters()
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in merges])


def byte_characters() -> list[str]:
    """GPT-2's byte-level alphabet, which CLIP's BPE uses: each of the 256 bytes as a printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]

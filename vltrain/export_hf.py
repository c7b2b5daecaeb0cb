"""`vltrain export --format hf`: a folder that transformers loads as a CLIPModel (both towers from one CLIP) or a
VisionTextDualEncoderModel (CLIP towers of two sources) with every tensor it expects and none it does not, with the
tokenizer and image processor at the top, so `CLIPProcessor.from_pretrained(OUT)` preprocesses as vltrain does.

What no transformers class holds (the fusion encoder, ITM and MLM heads, the TOnICS aligner) goes to
vltrain_heads.safetensors under vltrain's names, and vltrain.json is the export's own record (config.json is
transformers'), so `vltrain.load(OUT)` reads the whole model back (vltrain.exportfmt.read_export).
"""

import json
import math
import os
from pathlib import Path

from safetensors.torch import save_file

from vltrain import hfclip, openclip
from vltrain.errors import TrainError
from vltrain.exportfmt import HEADS, META, untie

FORMATS = ("vltrain", "hf", "open_clip")


def check_hf(net, fmt: str = "hf") -> str:
    """The transformers class that holds `net`'s towers: CLIPModel or VisionTextDualEncoderModel; a one-line
    TrainError saying which formats can hold it otherwise."""
    cfg = net.cfg
    if not (hfclip.is_clip(cfg.text_model) and hfclip.is_clip(cfg.image_model)):
        raise TrainError(f"--format {fmt} writes CLIP towers (model.text_model and model.image_model clip:PATH, as a "
                         f"run started with --init-from clip:PATH has); this model's are {cfg.text_model} + "
                         f"{cfg.image_model}, which {'open_clip' if fmt == 'open_clip' else 'transformers'} cannot "
                         "hold: use --format vltrain (the default), "
                         "with --onnx for runtimes without vltrain")
    same = cfg.towers["text"]["source"] == cfg.towers["image"]["source"]
    kinds = {cfg.towers[side]["model_type"] for side in ("text", "image")}
    if "siglip" in kinds:
        if fmt != "hf" or not same:
            raise TrainError(f"--format {fmt}: SigLIP towers export as one SiglipModel (--format hf, both towers from "
                             "one SigLIP folder); use --format vltrain for these")
        return "SiglipModel"
    return "CLIPModel" if same else "VisionTextDualEncoderModel"


def hf_model(net, kind: str):
    """The transformers model of `kind` holding net's towers, projections and logit scale, loaded strictly (every
    tensor it expects, none it lacks)."""
    from transformers import (CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig, VisionTextDualEncoderConfig,
                              VisionTextDualEncoderModel)

    towers = net.cfg.towers
    scale = math.log(1 / float(net.temperature().detach()))
    if kind == "SiglipModel":
        from transformers import SiglipConfig, SiglipModel

        model = SiglipModel(SiglipConfig(text_config=towers["text"]["config"], vision_config=towers["image"]["config"]))
        want = model.state_dict()  # SigLIP keeps logit_scale and logit_bias as (1,)
        state = {k: v.reshape(want[k].shape) if k in want else v for k, v in hfclip.to_clip(net.state_dict()).items()}
        model.load_state_dict(state, strict=True)
        return model.eval()
    text = CLIPTextConfig.from_dict(towers["text"]["config"])
    vision = CLIPVisionConfig.from_dict(towers["image"]["config"])
    if kind == "CLIPModel":
        config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                            projection_dim=net.cfg.embed_dim, logit_scale_init_value=scale)
        model = CLIPModel(config)
    else:
        config = VisionTextDualEncoderConfig.from_vision_text_configs(vision, text, projection_dim=net.cfg.embed_dim,
                                                                     logit_scale_init_value=scale)
        model = VisionTextDualEncoderModel(config)
    # a sigmoid-ITC bias (loss.itc_kind=sigmoid) has no place in a CLIPModel: vltrain_heads keeps it (write_heads)
    model.load_state_dict({k: v for k, v in hfclip.to_clip(net.state_dict()).items() if k != "logit_bias"},
                          strict=True)
    return model.eval()


def image_processor(net):
    """CLIPImageProcessor doing vltrain's eval transform: shorter side to S (the tower's interpolation, antialiased),
    centre crop S x S, /255, the tower's mean and std."""
    from transformers import CLIPImageProcessor

    pre = net.cfg.towers["image"]["preprocess"]
    code = {v: k for k, v in hfclip.RESAMPLE.items()}[pre["interpolation"]]
    if pre.get("resize") == "squash":  # SigLIP's: the whole image to S x S
        from transformers import SiglipImageProcessor

        return SiglipImageProcessor(size={"height": pre["size"], "width": pre["size"]}, image_mean=list(pre["mean"]),
                                    image_std=list(pre["std"]), resample=code)
    return CLIPImageProcessor(size={"shortest_edge": pre["size"]}, crop_size={"height": pre["size"],
                              "width": pre["size"]}, image_mean=list(pre["mean"]), image_std=list(pre["std"]),
                              resample=code)


def write_hf(net, tokenizer, out: Path) -> dict:
    """config.json + model.safetensors (transformers'), the tokenizer and image processor files, and
    vltrain_heads.safetensors; returns {"class", "heads", "tied"} for vltrain.json."""
    from vltrain.model import _quiet_transformers

    kind = check_hf(net)
    with _quiet_transformers():  # no "Writing model shards" bar in the command's output
        hf_model(net, kind).save_pretrained(str(out))
    # the processor (tokenizer + image processor) as one: AutoProcessor.from_pretrained(OUT) gives it back
    import transformers

    family = "Siglip" if kind == "SiglipModel" else "CLIP"
    processor = getattr(transformers, f"{family}Processor")(image_processor=image_processor(net), tokenizer=tokenizer)
    processor.save_pretrained(str(out))
    return {"class": kind, **write_heads(net, out)}


def write_open_clip(net, tokenizer, out: Path) -> dict:
    """open_clip_config.json + open_clip_model.safetensors (open_clip's plain CLIP, loadable with
    `open_clip.create_model_and_transforms("local-dir:OUT")`), vltrain_heads.safetensors, and the tokenizer files
    (open_clip tokenizes with its own copy of CLIP's BPE; vltrain.load reads these)."""
    check_hf(net, "open_clip")
    tokenizer.save_pretrained(str(out))
    model = hf_model(net, "CLIPModel")  # both towers' configs in one CLIPConfig, whatever their sources
    try:
        config = {"model_cfg": openclip.model_cfg_of(model.config), "preprocess_cfg": open_clip_preprocess(net)}
    except ValueError as e:
        raise TrainError(f"--format open_clip: {e}") from None
    save_file(openclip.from_hf(model.state_dict()), str(out / openclip.WEIGHTS), metadata={"format": "pt"})
    os.chmod(out / openclip.WEIGHTS, 0o644)
    (out / openclip.CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return {"class": "open_clip", **write_heads(net, out)}


def open_clip_preprocess(net) -> dict:
    """open_clip's preprocess_cfg of vltrain's eval transform for the model."""
    pre = net.cfg.towers["image"]["preprocess"]
    return {"size": pre["size"], "mode": "RGB", "mean": list(pre["mean"]), "std": list(pre["std"]),
            "interpolation": pre["interpolation"], "resize_mode": "shortest"}


def write_heads(net, out: Path) -> dict:
    """vltrain_heads.safetensors: the tensors the other library's weights do not hold, and the exact temperature."""
    state = net.state_dict()
    _, tied = untie(state)  # the MLM decoder's weight is the text tower's word embeddings: stored once, there
    held = set(hfclip.to_vltrain(hfclip.to_clip(state)))  # what transformers' model.safetensors holds
    if "siglip" not in net.kinds.values():  # only a SiglipModel holds the sigmoid ITC's bias
        held.discard("logit_bias")
    # the temperature too, exactly: logit_scale = log(1 / temp) and back would round it in float32
    rest, _ = untie({k: v for k, v in state.items() if (k not in held or k == "temp") and k not in tied})
    save_file(rest, str(out / HEADS), metadata={"format": "pt"})
    os.chmod(out / HEADS, 0o644)  # safetensors writes 0600; an export is shared like its other files
    return {"heads": sorted(rest), "tied": tied}


def hf_readme(text: str, meta: dict, out: Path) -> str:
    """The export README for the hf and open_clip layouts: vltrain's description and scores, then its files and how
    to load it with the other library alone, and with vltrain."""
    kind = meta["hf"]["class"]
    head = text.split("## Files")[0].rstrip()
    heads = (f"- `{HEADS}`: the tensors the other library does not hold (fusion encoder, ITM and MLM heads, aligner) "
             "and the exact temperature, under vltrain's names")
    record = f"- `{META}`: the run's config, preprocessing, provenance and eval numbers"
    pre = meta["preprocessing"]
    max_len = pre["max_len"]  # what the model was trained and is evaluated with
    context = meta["config"]["model"]["towers"]["text"]["max_len"]  # the text tower's positions
    if kind == "open_clip":
        # open_clip's tokenizer pads and cuts at the tower's context length, which its model reads in full
        tokenize = ([f"text = tokenizer(['a dog'], context_length={max_len})  # cut where vltrain cuts",
                f"text = torch.nn.functional.pad(text, (0, {context - max_len}))  # to the {context} positions"]
               if max_len < context else ["text = tokenizer(['a dog'])"])
        files = [f"- `{openclip.CONFIG}`, `{openclip.WEIGHTS}`: open_clip's CLIP (towers, projections, logit scale) "
                 "and its preprocessing", heads, record,
                 f"- captions: trained and evaluated cut at {max_len} tokens" + (
                     f" (open_clip's tokenizer cuts at the tower's {context}: cut them as below)"
                     if max_len < context else " (open_clip's tokenizer cuts there too)")]
        loading = ["```python", "import open_clip", *(["import torch"] if max_len < context else []), "",
                   f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{out.name}")',
                   f'tokenizer = open_clip.get_tokenizer("local-dir:{out.name}")',
                   "img = model.encode_image(preprocess(image)[None])  # L2-normalise both", *tokenize,
                   "txt = model.encode_text(text)", "```"]
    else:
        siglip = kind == "SiglipModel"
        padding = '"max_length"' if siglip else "True"  # SigLIP reads every caption padded to its full length
        longest = pre.get("model_max_length", max_len)
        length = (f"its `model_max_length` {max_len}, the length the model was trained and is evaluated with, which "
                  "`truncation=True` cuts at" if longest == max_len else
                  f"its `model_max_length` {longest}, the length a SigLIP text tower reads every caption padded to; "
                  f"the model was trained cut at {max_len} tokens: tokenize with `truncation=True, max_length="
                  f"{max_len}`, then pad to {longest}")
        files = [f"- `config.json`, `model.safetensors`: a transformers `{kind}` (towers, projections, logit scale)",
                 "- the tokenizer and `preprocessor_config.json` (CLIPImageProcessor: vltrain's eval transform); the "
                 f"tokenizer's (and the processor's) {length}", heads, record]
        loading = ["```python", f"from transformers import {kind}, AutoProcessor", "",
                   f'model = {kind}.from_pretrained("{out.name}")',
                   f'processor = AutoProcessor.from_pretrained("{out.name}")',
                   'inputs = processor(text=["a dog"], images=[image], return_tensors="pt", '
                   f'padding={padding}, truncation=True)',
                   "img = model.get_image_features(pixel_values=inputs.pixel_values).pooler_output  # L2-normalise",
                   "txt = model.get_text_features(input_ids=inputs.input_ids" + (
                       ").pooler_output  # SigLIP reads the padded caption unmasked" if siglip else
                       ", attention_mask=inputs.attention_mask).pooler_output"), "```"]
    library = "open_clip" if kind == "open_clip" else "transformers"
    return "\n".join([head, "", "## Files", "", *files, "", "## Loading", "", f"With {library} alone (no vltrain):",
                      "", *loading, "", "With vltrain (the whole model, heads included):", "", "```python",
                      "import vltrain", "", f'model = vltrain.load("{out.name}")', "```", ""])


def hf_meta(meta: dict, info: dict, fmt: str) -> dict:
    """vltrain.json: the export's record (what config.json holds in the vltrain layout) with the layout's parts."""
    pre = {**meta["preprocessing"], "tokenizer_files": "."}  # the tokenizer lies at the top in these layouts
    return {**meta, "layout": fmt, "preprocessing": pre, "tokenizer_files": ".",
            "hf": {"class": info["class"], "heads": HEADS, "heads_tensors": info["heads"]}, "tied": info["tied"]}


def write_meta(meta: dict, out: Path) -> None:
    """vltrain.json, last and atomically: from then on the folder is a complete export."""
    tmp = out / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / META)


"""A tiny random CLIPModel folder, as `save_pretrained` writes one (config, safetensors weights, CLIP's BPE tokenizer
and image processor), built offline (the tokenizer from open_clip's packaged BPE merges: vltrain.openclip)."""

from pathlib import Path

import torch

from vltrain.openclip import clip_tokenizer

SIZE = 32  # the vision tower's input: 4 x 4 patches of 8 pixels
PROJECTION = 16


def tiny_clip(folder: Path, seed: int = 0, projection: int = PROJECTION) -> Path:
    """A random 2-layer CLIP of width 32 (text and vision) projecting to `projection`, saved in `folder`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(text_config={**tower, "vocab_size": 49408, "max_position_embeddings": 77},
                        vision_config={**tower, "image_size": SIZE, "patch_size": 8}, projection_dim=projection)
    torch.manual_seed(seed)
    model = CLIPModel(config)
    with torch.no_grad():  # not CLIP's initial 1/0.07: a value the test can tell from vltrain's default temp
        model.logit_scale.fill_(3.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    clip_tokenizer().save_pretrained(str(folder))
    CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(
        str(folder))
    return folder


OPEN_CLIP_CFG = {"embed_dim": PROJECTION,
                 "vision_cfg": {"image_size": SIZE, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
                 "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}


def tiny_open_clip(folder: Path, seed: int = 0):
    """A random open_clip CLIP of the same tiny shape, built by open_clip itself and saved as a `local-dir:` folder
    (open_clip_config.json + open_clip_model.safetensors); returns (folder, the model in eval mode)."""
    import json
    import os

    from safetensors.torch import save_file

    before = os.environ.get("TOKENIZERS_PARALLELISM")
    import open_clip  # its tokenizer module sets TOKENIZERS_PARALLELISM: put the environment back as it was

    if before is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = before
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": {}}))
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{folder}")
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return folder, model.eval()

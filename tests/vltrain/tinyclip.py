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


SIGLIP_TEXT_LEN = 16  # SigLIP pads every caption to its full length (64 in Google's models)


def sentencepiece_tokenizer(folder: Path):
    """A SigLIP tokenizer: a small SentencePiece unigram model trained here on a few sentences (Google's spiece.model
    is not packaged), with SigLIP's special tokens (</s> = 1 ends and pads a caption, <unk> = 2)."""
    import sentencepiece as spm
    from transformers import SiglipTokenizer

    words = ("a photo of the red blue green small big dog cat car tree grass sky on next to with and square circle "
             "house street man woman bird boat water field").split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 6)) for i in range(400)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(folder / "spiece"), vocab_size=50,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", minloglevel=2)
    tok = SiglipTokenizer(vocab_file=str(folder / "spiece.model"), model_max_length=SIGLIP_TEXT_LEN)
    return tok


def tiny_siglip(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer SigLIP of width 32 (text head to 32, the vision width), 16 text positions, saved in `folder`
    with its SentencePiece tokenizer and SiglipImageProcessor (the whole image to 32 x 32)."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    folder.mkdir(parents=True, exist_ok=True)
    tok = sentencepiece_tokenizer(folder)
    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = SiglipConfig(text_config={**tower, "vocab_size": tok.vocab_size, "max_position_embeddings":
                                       SIGLIP_TEXT_LEN, "pad_token_id": 1, "eos_token_id": 1},
                          vision_config={**tower, "image_size": SIZE, "patch_size": 8})
    torch.manual_seed(seed)
    model = SiglipModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(2.0)
        model.logit_bias.fill_(-3.0)
    model.save_pretrained(str(folder))
    image = SiglipImageProcessor(size={"height": SIZE, "width": SIZE})
    SiglipProcessor(image_processor=image, tokenizer=tok).save_pretrained(str(folder))
    return folder

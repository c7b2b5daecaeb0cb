"""A tiny random CLIPModel folder, as `save_pretrained` writes one (config, safetensors weights, CLIP's BPE tokenizer
and image processor), built offline: the tokenizer's vocabulary comes from open_clip's packaged BPE merges, as
transformers' own CLIP conversion builds it."""

import gzip
from pathlib import Path

import torch

SIZE = 32  # the vision tower's input: 4 x 4 patches of 8 pixels
PROJECTION = 16


def byte_characters() -> list[str]:
    """GPT-2's byte-level BPE alphabet, which CLIP's uses: each of the 256 bytes as a printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def bpe_tokenizer(folder: Path):
    """CLIP's tokenizer (49,408 tokens) from open_clip's bpe_simple_vocab_16e6.txt.gz (found without importing
    open_clip, whose tokenizer module sets TOKENIZERS_PARALLELISM in the environment)."""
    import importlib.util

    from transformers import CLIPTokenizer

    path = Path(importlib.util.find_spec("open_clip").origin).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    chars = byte_characters()
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in merges])
    tok.save_pretrained(str(folder))
    return tok


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
    bpe_tokenizer(folder)
    CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(
        str(folder))
    return folder

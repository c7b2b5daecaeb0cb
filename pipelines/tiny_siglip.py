"""Build the `siglip` and `flip` recipes' start: a tiny random SigLIP-shaped model folder, as `save_pretrained` writes
one (config, safetensors weights, a SentencePiece tokenizer, SiglipImageProcessor), which `--init-from clip:FOLDER`
reads as it reads Google's SigLIP checkpoints.

    .venv/bin/python pipelines/tiny_siglip.py OUT_FOLDER --captions SHARDS_FOLDER [--size 64] [--seed 0]

No SigLIP checkpoint installs offline here, and SigLIP's own spiece.model is not packaged, so the tokenizer is a
SentencePiece unigram model trained on the training shards' captions (single-threaded, so the same captions give the
same pieces), with SigLIP's special tokens (</s> = 1 ends and pads a caption, <unk> = 2). The towers are SigLIP's
modules at a CPU-sized width (2 layers of width 64, 8-pixel patches, 16 text positions); the weights are random from
`--seed`, and the temperature and bias are SigLIP's initial log t = log 10 and b = -10 (Zhai et al. 2023, 3.2), so
both arms of a recipe start from the same model and differ in the loss (or the patch dropout) alone. The folder is
written beside OUT and renamed into place, so a cut build leaves no half folder that would count as built.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

WIDTH = 64
LAYERS = 2
HEADS = 4
PATCH = 8
TEXT_LEN = 16
VOCAB = 1000  # pieces; the captions' own (about 2,000 short ones) may hold fewer, which SentencePiece then keeps
LOGIT_SCALE = 2.302585092994046  # log 10: SigLIP's initial temperature t' = log 10 (section 3.2)
LOGIT_BIAS = -10.0  # SigLIP's initial bias (section 3.2)


def captions(folder: Path) -> list[str]:
    """Every caption of the shard folder's parquet sidecars, in file order."""
    import pyarrow.parquet as pq

    out = []
    for f in sorted(folder.glob("*.parquet")):
        out += [c for c in pq.read_table(f, columns=["caption"]).column("caption").to_pylist() if c]
    if not out:
        raise SystemExit(f"error: {folder}: no captions in its *.parquet sidecars (a vlprep shards folder?)")
    return out


def build(out: Path, texts: list[str], size: int, seed: int) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor, SiglipTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp / "spiece"), vocab_size=VOCAB,
                                   hard_vocab_limit=False, model_type="unigram", pad_id=0, eos_id=1, unk_id=2,
                                   bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", num_threads=1,
                                   minloglevel=2)
    tok = SiglipTokenizer(vocab_file=str(tmp / "spiece.model"), model_max_length=TEXT_LEN)
    tower = {"hidden_size": WIDTH, "intermediate_size": 4 * WIDTH, "num_hidden_layers": LAYERS,
             "num_attention_heads": HEADS}
    config = SiglipConfig(text_config={**tower, "vocab_size": tok.vocab_size, "max_position_embeddings": TEXT_LEN,
                                       "pad_token_id": 1, "eos_token_id": 1},
                          vision_config={**tower, "image_size": size, "patch_size": PATCH})
    torch.manual_seed(seed)
    model = SiglipModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(LOGIT_SCALE)
        model.logit_bias.fill_(LOGIT_BIAS)
    model.save_pretrained(str(tmp))
    image = SiglipImageProcessor(size={"height": size, "width": size})
    SiglipProcessor(image_processor=image, tokenizer=tok).save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the model folder to write (replaced if present)")
    ap.add_argument("--captions", required=True, help="a vlprep shards folder whose captions train the tokenizer")
    ap.add_argument("--size", type=int, default=64, help="the vision tower's input size in pixels (a multiple of 8)")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the random weights")
    args = ap.parse_args(argv)
    if args.size < PATCH or args.size % PATCH:
        print(f"error: --size {args.size}: a positive multiple of the {PATCH}-pixel patch", file=sys.stderr)
        return 2
    out = build(Path(args.out), captions(Path(args.captions)), args.size, args.seed)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

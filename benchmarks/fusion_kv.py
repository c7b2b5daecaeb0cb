"""ITM's fusion pass with each image's cross-attention keys and values projected once (VLModel.fuse's image_rows)
against the image tokens repeated per row, measured in the same run.

Both sides fuse ITM's 3B rows (B positives, each caption with a hard-negative image, each image with a hard-negative
caption) over B images, forward and backward, as a training step does: `shared` passes the B images and each row's
index (what vltrain.objectives.matching does now); `repeated` indexes the image tokens per row and fuses without
image_rows (what it did before). The model is preset `albef`'s (packaged MiniLM, its fusion layers) on cached tokens
of the demo's shape (49 x 1280, as `vlprep features` writes for EfficientNet-Lite0 at 224), batch 32 as the demo
trains; the negatives are random (their choice costs the same). Rounds alternate the sides' order after untimed
warm-up calls; medians of per-call times and their ratio are printed, with the load average at start and end.

    .venv/bin/python benchmarks/fusion_kv.py [--batch 32] [--rounds 15] [--tiny]
"""

import argparse
import os
import statistics
import time

import torch

from vltrain.config_load import load_config
from vltrain.model import build_model, tokenizer_for

WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()


def setup(batch: int, tiny: bool):
    sets = ["model.image_model=features", "model.feature_dim=1280"]
    if tiny:
        sets = ["model.text_model=tiny", "model.image_model=features", "model.feature_dim=1280", "model.embed_dim=16",
                "model.fusion_layers=1"]
    cfg = load_config("albef", sets=sets)
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.set_unpad(4 if cfg.train.unpad else 0)  # as the trainer sets it (vltrain.session)
    tok = tokenizer_for(cfg.model.text_model)
    g = torch.Generator().manual_seed(0)
    caps = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
            for n in torch.randint(4, 14, (batch,), generator=g)]
    enc = tok(caps, padding="longest", truncation=True, max_length=cfg.data.max_len, return_tensors="pt")
    mask = enc["attention_mask"]
    with torch.no_grad():
        hidden, _ = model.encode_text(enc["input_ids"], mask)
        tokens, _ = model.encode_image(torch.randn(batch, 49, 1280, generator=g))
    own = torch.arange(batch)
    neg_image = (own + torch.randint(1, batch, (batch,), generator=g)) % batch
    neg_text = (own + torch.randint(1, batch, (batch,), generator=g)) % batch
    text = torch.cat([hidden, hidden, hidden[neg_text]]).requires_grad_()
    masks = torch.cat([mask, mask, mask[neg_text]])
    rows = torch.cat([own, neg_image, own])
    # each caption's last attended position + 1, read on the host as the trainer reads it from the CPU mask
    ends = (masks.bool() * torch.arange(1, masks.shape[1] + 1)).amax(dim=1).clamp(min=1).tolist()
    return model, text, masks, tokens.requires_grad_(), rows, ends


def call(side: str, model, text, masks, tokens, rows, ends) -> float:
    start = time.perf_counter()
    if side == "shared":
        fused = model.fuse(text, masks, tokens, ends=ends, image_rows=rows)
    else:
        fused = model.fuse(text, masks, tokens[rows], ends=ends)
    model.itm_logits(fused).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tiny", action="store_true", help="the tiny text model (1 fusion layer) instead of MiniLM")
    args = ap.parse_args()
    print(f"load at start: {os.getloadavg()}")
    setup_args = setup(args.batch, args.tiny)
    model = setup_args[0]
    print(f"batch {args.batch}: {3 * args.batch} rows over {args.batch} images, {len(model.fusion)} fusion layers, "
          f"unpad groups {model.unpad_groups}, threads {torch.get_num_threads()}")
    times = {"repeated": [], "shared": []}
    for side in ("repeated", "shared", "repeated", "shared"):  # warm-up
        call(side, *setup_args)
    for r in range(args.rounds):
        for side in (("repeated", "shared") if r % 2 == 0 else ("shared", "repeated")):
            model.zero_grad(set_to_none=True)
            times[side].append(call(side, *setup_args))
    before, after = statistics.median(times["repeated"]), statistics.median(times["shared"])
    print(f"fusion forward+backward, median of {args.rounds}: repeated {before * 1e3:.1f} ms, shared "
          f"{after * 1e3:.1f} ms: shared/repeated {after / before:.2f}x")
    print(f"load at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()

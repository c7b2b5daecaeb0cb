"""SoftMask++ (§3.2, eqs. 8-12; Appendix B; Table 5 and Table 9's ablations): word-conditional soft masks on the
image tokens, from Grad-CAM over the fusion encoder's cross-attention, and the masked pairs' ITM loss.

The extracted paper text lost its equation bodies; these rules follow its prose and ALBEF's public Grad-CAM
(docs/SOFTMASK.md says where we chose):
- Grad-CAM: g = d s+ / d A for every fusion layer's cross-attention probabilities A (B, H, L, N), where s+ is the
  positive pairs' ITM match probability summed over the batch; the map is mean over layers and heads of A * ReLU(g).
- One word per caption, uniform over its non-padding tokens ([CLS] included); its map row (B, N) becomes the mask:
  min-max normalised, rescaled so the masked weight sums to N / 2, clipped to [0, 1], M = 1 - w.
- The positive pairs, with M multiplied into their image tokens, are classified as matches again (eq. 12).
"""

import torch

SOURCES = ("gradcam", "attention", "random")


def parse_source(source: str) -> tuple[str, float]:
    """'gradcam' | 'attention' | 'random:R' -> (kind, R); ValueError naming the valid forms."""
    kind, _, arg = source.partition(":")
    if kind in ("gradcam", "attention") and not arg:
        return kind, 0.0
    if kind == "random":
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if 0 < ratio < 1:
            return kind, ratio
    raise ValueError(f"unknown loss.softmask_source {source!r}; use gradcam, attention or random:R with R in (0, 1)")


def gradcam(attns: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """Cross-attention probabilities and their gradients, (B, H, L, N) per layer -> map (B, L, N): the mean over
    layers and heads of A * ReLU(g) ("we aggregate the Grad-CAM maps from all cross-attention layers")."""
    a, g = torch.stack(attns), torch.stack(grads)  # (layers, B, H, L, N)
    return (a * g.clamp(min=0)).mean(dim=(0, 2))


def attention_map(attns: list[torch.Tensor]) -> torch.Tensor:
    """Table 9's attention masks: the cross-attention probabilities alone, mean over layers and heads -> (B, L, N)."""
    return torch.stack(attns).mean(dim=(0, 2))


def sample_words(valid: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """valid (B, L) bool (the attention mask) -> one token index per row (B,), uniform over the valid positions."""
    return torch.multinomial(valid.float(), 1, generator=generator).squeeze(1)


def soft_mask(cam: torch.Tensor) -> torch.Tensor:
    """The chosen word's map (B, N) -> soft mask M (B, N) in [0, 1], carrying no gradient.

    w = row min-max to [0, 1] (a constant row: 0.5 everywhere); w <- w * (N / 2) / sum(w), so the masked weight
    is half the patches (Appendix B); clip to [0, 1]; M = 1 - w.
    """
    cam = cam.detach().float()
    n = cam.shape[-1]
    lo, hi = cam.min(dim=-1, keepdim=True).values, cam.max(dim=-1, keepdim=True).values
    span = hi - lo
    w = torch.where(span > 0, (cam - lo) / span.clamp(min=torch.finfo(cam.dtype).tiny), torch.full_like(cam, 0.5))
    w = w * (n / 2) / w.sum(dim=-1, keepdim=True)  # sum(w) >= 1 after min-max: the row's maximum is 1
    return 1.0 - w.clamp(0.0, 1.0)


def random_mask(b: int, n: int, ratio: float, generator: torch.Generator | None = None,
                device=None) -> torch.Tensor:
    """Table 5's RandMask: a hard mask (B, N) of zeros on round(ratio * N) random tokens per row, ones elsewhere."""
    k = round(ratio * n)
    order = torch.rand(b, n, generator=generator, device=device).argsort(dim=-1)
    mask = torch.ones(b, n, device=device)
    mask.scatter_(1, order[:, :k], 0.0)
    return mask


def masks_for(source: str, positives_fused_attns: list[torch.Tensor] | None, grads: list[torch.Tensor] | None,
              valid: torch.Tensor, n_tokens: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The step's mask M (B, N) for the positive pairs from the configured source (see `parse_source`)."""
    kind, ratio = parse_source(source)
    if kind == "random":
        return random_mask(valid.shape[0], n_tokens, ratio, generator, valid.device)
    cam = gradcam(positives_fused_attns, grads) if kind == "gradcam" else attention_map(positives_fused_attns)
    words = sample_words(valid, generator)
    return soft_mask(cam[torch.arange(cam.shape[0], device=cam.device), words])


def caption_gradcam(model, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One image (1, 3, H, W) and caption (1, L): the Grad-CAM map of every caption token (L, N) and the pair's ITM
    match probability, as training computes them (`vltrain gradcam` draws them)."""
    model.eval()
    with torch.no_grad():
        tokens, _ = model.encode_image(pixels)
    with torch.enable_grad():
        hidden, _ = model.encode_text(ids, mask)
        fused, maps = model.fuse(hidden, mask, tokens, return_attn=True)
        p_match = model.itm_logits(fused).float().softmax(dim=-1)[:, 1]
        grads = torch.autograd.grad(p_match.sum(), maps)
    return gradcam([a.detach() for a in maps], list(grads))[0], float(p_match.detach())


def word_positions(tokenizer, ids: torch.Tensor, words: list[str]) -> dict[str, int]:
    """Each requested word -> the position of its first word piece in ids (1, L); ValueError for a missing word."""
    pieces = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    found = {}
    for word in words:
        first = tokenizer.tokenize(word)[:1]
        hits = [i for i, p in enumerate(pieces) if first and p == first[0]]
        if not hits:
            shown = " ".join(p for p in pieces if p not in tokenizer.all_special_tokens)
            raise ValueError(f"word {word!r} is not in the caption's tokens ({shown})")
        found[word] = hits[0]
    return found


def gradcam_figure(checkpoint, image, caption: str, words: list[str] | None, out, device: str = "auto") -> dict:
    """`vltrain gradcam`: the image, then per word its Grad-CAM map and soft mask over the image; returns a summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    from vlprep.dataset import to_rgb
    from vltrain.evaluate import pixel_transform
    from vltrain.model import load_checkpoint, resolve_device, tokenizer_for

    model, cfg = load_checkpoint(checkpoint, resolve_device(device))
    if model.fusion is None:
        raise ValueError(f"{checkpoint} has no fusion encoder (fusion_layers=0): Grad-CAM reads its cross-attention")
    try:
        rgb = to_rgb(open(image, "rb").read())
    except (OSError, Image.UnidentifiedImageError) as e:
        raise ValueError(f"cannot read image {image}: {e}") from None
    dev = next(model.parameters()).device
    pixels = pixel_transform(model, cfg["data"]["image_size"])(rgb).unsqueeze(0).to(dev)
    tok = tokenizer_for(model.cfg.text_model)
    enc = tok([caption], truncation=True, max_length=cfg["data"]["max_len"], return_tensors="pt")
    ids, mask = enc["input_ids"].to(dev), enc["attention_mask"].to(dev)
    if not words:
        pieces = tok.convert_ids_to_tokens(ids[0].tolist())
        words = [p for p in pieces if p not in tok.all_special_tokens and not p.startswith("##")][:3]
    pos = word_positions(tok, ids, words)
    cam, p_match = caption_gradcam(model, pixels, ids, mask)
    n = cam.shape[1]
    side = int(round(n ** 0.5))
    if side * side != n:
        raise ValueError(f"the image side has {n} tokens, not a square grid: nothing to draw")
    shown = np.asarray(rgb.resize((pixels.shape[-1], pixels.shape[-2])))
    fig, axes = plt.subplots(2, len(words) + 1, figsize=(3 * (len(words) + 1), 6.2), squeeze=False)
    for row in range(2):
        axes[row, 0].imshow(shown)
        axes[row, 0].set_title("image" if row == 0 else f"p(match) {p_match:.2f}", fontsize=9)
    for j, word in enumerate(words, start=1):
        row_cam = cam[pos[word]]
        for r, (grid, title) in enumerate(((row_cam, f"Grad-CAM '{word}'"),
                                           (1 - soft_mask(row_cam[None])[0], f"masked weight 1-M '{word}'"))):
            ax = axes[r, j]
            ax.imshow(shown)
            ax.imshow(grid.reshape(side, side).cpu().numpy(), cmap="jet", alpha=0.5, interpolation="bilinear",
                      extent=(0, shown.shape[1], shown.shape[0], 0))
            ax.set_title(title, fontsize=9)
    for ax in axes.flat:
        ax.axis("off")
    fig.suptitle(caption, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return {"words": {w: pos[w] for w in words}, "p_match": p_match, "tokens": n, "out": str(out)}

"""SoftMask++ (§4.1, eqs. 8-12; Appendix B; Table 5 and Table 9's ablations): word-conditional soft masks on the
image tokens, from Grad-CAM over the fusion encoder's cross-attention, and the masked pairs' ITM loss.

The extracted paper text lost its equation bodies; these rules follow its prose and ALBEF's public Grad-CAM
(docs/SOFTMASK.md says where we chose; `vltrain gradcam` draws the maps, vltrain.figures):
- Grad-CAM: g = d s+ / d A for every fusion layer's cross-attention probabilities A (B, H, L, N), where s+ is the
  positive pairs' ITM match probability summed over the batch; the map is mean over layers and heads of A * ReLU(g).
- One word per caption, uniform over its non-padding tokens ([CLS] included); its map row (B, N) becomes the mask:
  min-max normalised, rescaled so the masked weight sums to N / 2, clipped to [0, 1], M = 1 - w.
- The positive pairs, with M multiplied into their image tokens, are classified as matches again (eq. 12).
"""

import torch

from vltrain.losses import softmask_itm_loss, upcast

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


def masks_for(source: str | tuple[str, float], positives_fused_attns: list[torch.Tensor] | None,
              grads: list[torch.Tensor] | None, valid: torch.Tensor, n_tokens: int,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """The step's mask M (B, N) for the positive pairs from the configured source (`parse_source`'s string, or its
    parsed (kind, R), as LossConfig.softmask holds it)."""
    kind, ratio = parse_source(source) if isinstance(source, str) else source
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


def soft_itm_loss(model, source: tuple[str, float], pos_logits: torch.Tensor, maps: list | None,
                  text_hidden: torch.Tensor, mask: torch.Tensor, image_tokens: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
    """Eq. 12: the positive pairs again, image tokens multiplied by this step's mask M, labelled match.

    pos_logits (B, 2) are the positives' ITM logits and `maps` the ITM pass's cross-attention probabilities (rows
    0..B-1 are the positives; None for random masks); M carries no gradient.
    """
    b = pos_logits.shape[0]
    grads = None
    if maps is not None:
        if source[0] == "gradcam":
            # s+ = the positives' match probability summed over the batch; d s+ / dA for every fusion layer (the
            # rows past B, the negatives, get zeros). The maps are not parameters, so autograd.grad leaves every
            # .grad alone; retain_graph keeps the step's graph for the backward pass.
            s_pos = upcast(pos_logits).softmax(dim=-1)[:, 1].sum()
            grads = [g[:b].detach() for g in torch.autograd.grad(s_pos, maps, retain_graph=True)]
        maps = [a[:b].detach() for a in maps]
    m = masks_for(source, maps, grads, mask.bool(), image_tokens.shape[1], generator)
    return softmask_itm_loss(model.itm_logits(model.fuse(text_hidden, mask, image_tokens, patch_weights=m)))

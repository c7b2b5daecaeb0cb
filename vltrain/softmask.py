"""SoftMask++ (§4.1, eqs. 8-12; Appendix B; Table 5 and Table 9's ablations): word-conditional soft masks on the
image tokens, from Grad-CAM over the fusion encoder's cross-attention, and the masked pairs' ITM loss.

The extracted paper text lost its equation bodies; these rules follow its prose and ALBEF's public Grad-CAM
(docs/SOFTMASK.md says where we chose; `vltrain gradcam` draws the maps, vltrain.figures):
- Grad-CAM: g = d s+ / d A for every fusion layer's cross-attention probabilities A (B, H, L, N), where s+ is the
  positive pairs' ITM match probability summed over the batch; the map is mean over layers and heads of A * ReLU(g).
- One word per caption, uniform over its non-padding tokens ([CLS] included); its map row (B, N) becomes the mask:
  min-max normalised, scaled so that the weights clipped to [0, 1] sum to exactly N / 2, M = 1 - w. N counts every
  image token the fusion encoder reads, a ViT's [CLS] included (the paper says half the patches).
- The positive pairs, with M multiplied into their image tokens, are classified as matches again (eq. 12).
"""

import torch

from vltrain.config import parse_source
from vltrain.losses import softmask_itm_loss, upcast

SOURCES = ("gradcam", "attention", "random")


def gradcam(attns: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """Cross-attention probabilities and their gradients, (B, H, L, N) per layer -> map (B, L, N): the mean over
    layers and heads of A * ReLU(g) ("we aggregate the Grad-CAM maps from all cross-attention layers")."""
    a = torch.stack(attns)  # (layers, B, H, L, N)
    g = torch.stack(grads)
    return (a * g.clamp(min=0)).mean(dim=(0, 2))


def attention_map(attns: list[torch.Tensor]) -> torch.Tensor:
    """Table 9's attention masks: the cross-attention probabilities alone, mean over layers and heads -> (B, L, N)."""
    return torch.stack(attns).mean(dim=(0, 2))


def sample_words(valid: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """valid (B, L) bool (the attention mask) -> one token index per row (B,), uniform over the valid positions."""
    return torch.multinomial(valid.float(), 1, generator=generator).squeeze(1)


def fill_to(w: torch.Tensor, total: float) -> torch.Tensor:
    """Weights w (B, N) in [0, 1] -> clip(s * w, 0, 1) with a per-row scale s >= 0 solved so that each row sums to
    exactly `total` (0 < total <= N): water-filling, sort-based and closed-form, no iteration, in w's dtype.

    f(s) = sum_i min(s * w_i, 1) is continuous, piecewise linear and nondecreasing in s, with breakpoints at
    s = 1 / w_(j) for the row sorted in descending order w_(1) >= ... >= w_(N). At the j-th breakpoint the top j
    entries are at 1 and f = j + R_j / w_(j), R_j = w_(j+1) + ... + w_(N). Let k be the number of breakpoints with
    f <= total (k = 0 when sum(w) > total already): the top k entries (every w_i >= w_(k)) are 1 and the others are
    (total - k) * w_i / R_k, below 1 since f first passes total after the k-th breakpoint.

    Written so that rounding cannot lose the clipped entries: when total - k is 0 (the k-th breakpoint lands on
    total exactly, or rounds there because R_k is tiny next to 1), the old form s = (total - k) / R_k gave s = 0 and
    cleared the whole row; here the top k are 1 by their rank, whatever the rounding. w_i / R_k <= 1 is formed
    before the multiplication, so subnormal weights neither overflow nor need a clamp: no 1 / w is taken.
    Degenerate rows: p positive entries with p <= total: k = p, R_k = 0, every positive entry is 1 and every zero
    stays 0, so the row sums to p (< total unless p = total).
    Error: R_k is a suffix sum of at most N terms in [0, 1], summed smallest first, so each unclipped entry is off by
    at most about (N + 1) u relative (u the dtype's unit roundoff) and the row's total by (N + 1) u * total.
    """
    desc = w.sort(dim=-1, descending=True).values
    zero = torch.zeros_like(desc[..., :1])
    suffix = torch.cat([desc.flip(-1).cumsum(dim=-1).flip(-1), zero], dim=-1)  # R_0 .. R_N: R_j = sum of desc[j:]
    j = torch.arange(1, w.shape[-1] + 1, device=w.device, dtype=w.dtype)
    # f at s = 1 / w_(j); a zero never reaches 1 (the 0 / 0 of the branch not taken is discarded)
    at_breaks = torch.where(desc > 0, j + suffix[..., 1:] / desc, torch.full_like(desc, torch.inf))
    k = (at_breaks <= total).sum(dim=-1, keepdim=True)
    rest = suffix.gather(-1, k)
    # the k-th largest weight, or +inf when k = 0 (nothing clipped)
    top = torch.cat([torch.full_like(zero, torch.inf), desc], dim=-1).gather(-1, k)
    below = ((total - k) * (w / torch.where(rest > 0, rest, torch.ones_like(rest)))).clamp(0.0, 1.0)
    scaled = torch.where(w >= top, torch.ones_like(w), below)
    return torch.where(rest > 0, scaled, (w > 0).to(w.dtype))


def soft_mask(cam: torch.Tensor) -> torch.Tensor:
    """The chosen word's map (B, N) -> soft mask M (B, N) in [0, 1], carrying no gradient, on cam's device: float64
    for a float64 map (a float64 run's masks keep its precision), float32 for any other float dtype.

    w = row min-max to [0, 1] (a constant row: 0.5 everywhere, which already sums to N / 2); w <- clip(s * w, 0, 1)
    with the row's scale s solved (`fill_to`) so that sum(w) = N / 2 exactly: the masked weight is half the patches
    (Appendix B, eq. 9); M = 1 - w. The order is kept: a larger cam value never gets a larger M.

    Rescaling by N / 2 / sum(w) and clipping afterwards, as this function did before, lost masked weight on peaked
    maps (N = 49, target 24.5; before -> now): a Gaussian bump centred on the 7 x 7 grid, sigma 0.5 / 1 / 1.5 / 2
    patches: 6.1 / 14.4 / 20.8 / 23.4 -> 24.5; the Grad-CAM rows of steps 91-100 of a 100-step softmask run on the
    demo's cached 49-token features (320 rows, docs/SOFTMASK.md): mean 22.0, median 23.0 -> mean 24.2; the 303 rows
    with at least 25 positive entries 15.7 at the lowest -> 24.5 each, the 17 others (below) 7.0-18.2 -> 7-24.
    A row with fewer than N / 2 positive entries after the min-max (at least one entry, its minimum, is 0) cannot
    reach N / 2: its positive entries all become 1, its zeros stay 0, and it masks the count of positive entries.
    """
    cam = cam.detach() if cam.dtype == torch.float64 else cam.detach().float()
    n = cam.shape[-1]
    lo = cam.min(dim=-1, keepdim=True).values
    hi = cam.max(dim=-1, keepdim=True).values
    span = hi - lo
    w = torch.where(span > 0, (cam - lo) / span.clamp(min=torch.finfo(cam.dtype).tiny), torch.full_like(cam, 0.5))
    w = torch.where(span > 0, fill_to(w, n / 2), w)  # the constant row stays exactly 0.5
    return 1.0 - w


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
                  generator: torch.Generator, ends: list[int] | None = None) -> torch.Tensor:
    """Eq. 12: the positive pairs again, image tokens multiplied by this step's mask M, labelled match.

    pos_logits (B, 2) are the positives' ITM logits and `maps` the ITM pass's cross-attention probabilities (rows
    0..B-1 are the positives; None for random masks); M carries no gradient. `ends`: the captions' lengths known on
    the host (`VLModel.fuse`).
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
    return softmask_itm_loss(model.itm_logits(model.fuse(text_hidden, mask, image_tokens, patch_weights=m, ends=ends)))

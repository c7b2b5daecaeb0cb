"""Image-text matching on hard negatives (ALBEF 3.2: drawn by in-batch similarity; GRIT-VLP: the hardest), and
SoftMask++'s soft ITM on the positives (vltrain.softmask)."""

import torch
import torch.nn.functional as F

from vltrain.distributed import gather, max_over_ranks, world
from vltrain.losses import (hard_negative_weights, hardest_negatives, itm_loss, sample_hard_negatives,
                            sample_hard_negatives_at)
from vltrain.objectives import Draws
from vltrain.softmask import soft_itm_loss


def hard_negatives(f, w, width: int, generator: torch.Generator | Draws) -> tuple:
    """(negative caption per image, negative image per caption, has_t, has_i) from the ITC logits' pool of `width`;
    `generator` a Draws (a compiled step): drawn at its uniforms by `sample_hard_negatives_at`.

    A row whose every other caption is a duplicate of its own has no negative (has_t / has_i False): it sits out of
    ITM this step. Its draw still happens, from placeholder weights, so the generator advances as in any other step.
    """
    b = f.ids.shape[0]
    w_i2t, w_t2i = hard_negative_weights(f.logits_i2t, f.logits_t2i, None if f.same is None else f.same[:, :width],
                                         width)
    has_t = w_i2t.sum(dim=1) > 0
    has_i = w_t2i.sum(dim=1) > 0
    anywhere = 1.0 - torch.eye(b, width, device=w_i2t.device, dtype=w_i2t.dtype)
    w_i2t = torch.where(has_t[:, None], w_i2t, anywhere)
    w_t2i = torch.where(has_i[:, None], w_t2i, anywhere)
    if w.itm_negatives == "hardest":  # GRIT-VLP's released code: the top-1 of the weights, no draw
        return hardest_negatives(w_i2t), hardest_negatives(w_t2i), has_t, has_i
    # a hard negative caption for each image, then a hard negative image for each caption
    if isinstance(generator, Draws):
        return (sample_hard_negatives_at(w_i2t, generator.itm[0]), sample_hard_negatives_at(w_t2i, generator.itm[1]),
                has_t, has_i)
    return sample_hard_negatives(w_i2t, generator), sample_hard_negatives(w_t2i, generator), has_t, has_i


def matching_losses(model, f, w, generator: torch.Generator | Draws) -> dict:
    """itm_loss over B positives and their hard negatives, and softmask_itm_loss where weighted; sets f.fused."""
    b = f.ids.shape[0]
    mask = f.mask
    # The pool the negatives come from: this rank's batch (ALBEF), or with loss.itm_global_negatives under
    # torchrun every rank's (BLIP), whose token sequences are gathered with gradient, padded to the longest
    # caption of any rank (padding is masked out of the fusion's attention).
    pool_text = f.text_hidden
    pool_mask = mask
    pool_image = f.image_tokens
    text_p = f.text_hidden
    mask_p = mask
    if w.itm_global_negatives and world()[1] > 1:
        length = max_over_ranks(mask.shape[1])
        text_p = F.pad(f.text_hidden, (0, 0, 0, length - mask.shape[1]))
        mask_p = F.pad(mask, (0, length - mask.shape[1]))
        pool_text, pool_mask, pool_image = (gather(text_p, True)[0], gather(mask_p, False)[0],
                                            gather(f.image_tokens, True)[0])
    neg_text, neg_image, has_t, has_i = hard_negatives(f, w, pool_text.shape[0], generator)
    # Rows: B positives, caption i with its negative image, image i with its negative caption. Every row is fused,
    # a row without a negative (has_i / has_t False: it drew from placeholder weights) too, and left out of the loss
    # by its label: a fixed 3B rows, so nothing waits for the count of negatives (a sync per step on a GPU).
    want_maps = w.softmask_itm > 0 and w.softmask[0] != "random"
    # The length groups from the host's caption lengths: the negative captions' rows (drawn on the device) at the
    # pool's padded length
    ends = None if f.ends is None else [*f.ends, *f.ends, *[mask_p.shape[1]] * b]
    # The images once each, every row an index into them: the fusion layers project their cross-attention keys and
    # values per image, not per row (VLModel.fuse's image_rows). Under global negatives this rank's images stay
    # apart from the gathered pool, so that each copy's gradient takes the path it took when rows were copies.
    own = torch.arange(b, device=f.ids.device)
    if pool_image is f.image_tokens:
        images, rows = f.image_tokens, torch.cat([own, neg_image, own])
    else:
        images, rows = torch.cat([f.image_tokens, pool_image]), torch.cat([own, b + neg_image, own])
    fused = model.fuse(torch.cat([text_p, text_p, pool_text[neg_text]]),
                       torch.cat([mask_p, mask_p, pool_mask[neg_text]]),
                       images, return_attn=want_maps, ends=ends, image_rows=rows)
    fused, maps = fused if want_maps else (fused, None)
    if text_p is not f.text_hidden:  # back to this rank's caption length (MLM reads the positive rows)
        fused = fused[:, :mask.shape[1]]
        maps = None if maps is None else [m[..., :mask.shape[1], :] for m in maps]
    f.fused = fused
    dev = f.ids.device
    skip = torch.full((b,), -100, dtype=torch.long, device=dev)  # cross_entropy's ignore_index
    zeros = torch.zeros(b, dtype=torch.long, device=dev)
    labels = torch.cat([torch.ones(b, dtype=torch.long, device=dev), torch.where(has_i, zeros, skip),
                        torch.where(has_t, zeros, skip)])
    itm_out = model.itm_logits(fused)
    losses = {"itm_loss": itm_loss(itm_out, labels)}
    if w.softmask_itm > 0:
        losses["softmask_itm_loss"] = soft_itm_loss(model, w.softmask, itm_out[:b], maps, f.text_hidden, mask,
                                                    f.image_tokens, generator, f.ends)
    return losses

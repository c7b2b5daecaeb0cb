"""Image-text contrastive learning: the logits (CLIP / ALBEF 3.2, with ALBEF's queue and momentum keys), plain,
distilled (ALBEF 3.3), focal (SoftMask++ 3.3) and sigmoid (SigLIP 3.1) ITC, and GRIT-VLP's ITC consistency loss
(4.2)."""

import torch

from vltrain.distributed import gather, gather_objects, world
from vltrain.losses import (dedupe_targets, distill_targets, focal_itc_loss, itc_consistency_loss, itc_logits,
                            itc_loss, sigmoid_itc_loss)


def contrastive_logits(model, f, w, captions: list[str]) -> None:
    """Fill in f's temperature, keys, logits (B, B_global + Q) x2 (SigLIP's, with its bias, under loss.itc_kind=
    sigmoid) and, with loss.dedupe=caption, the duplicate map."""
    f.temp = model.temperature()
    mom = model.momentum
    f.queues = (model.image_queue, model.text_queue) if model.cfg.queue_size > 0 else (None, None)
    # ALBEF: with a momentum model the contrastive keys (in-batch and queued) are momentum features.
    image_keys, text_keys = (f.momentum[1], f.momentum[3]) if mom is not None else (f.image_feat, f.text_feat)
    # Under DDP the keys are every rank's (momentum keys without gradient), this rank's rows first so that the
    # positives stay on the diagonal: the loss is the single-process loss on the global batch. The queue takes
    # the gathered keys in rank order, so every rank's queue stays the same. Outside torchrun both are the keys.
    (f.image_keys, queue_img), (f.text_keys, queue_txt) = (gather(image_keys, mom is None),
                                                           gather(text_keys, mom is None))
    f.enqueue = (queue_img.detach(), queue_txt.detach())
    f.logits_i2t, f.logits_t2i = itc_logits(f.image_feat, f.text_feat, f.image_keys, f.text_keys, f.temp, *f.queues,
                                            w.itc_detach_keys)
    if w.itc_kind == "sigmoid":
        # SigLIP's logits t x.y + b (its bias b learnt); the ITM negatives' row softmax is the same without b
        f.logits_i2t, f.logits_t2i = f.logits_i2t + model.logit_bias, f.logits_t2i + model.logit_bias
    # loss.dedupe=caption: pairs whose captions are byte-identical (str equality of the decoded UTF-8) are not
    # negatives of each other: extra ITC positives, never ITM negatives. Token ids would not do: the tokenizer
    # lowercases and truncates, so different captions can share ids. Under torchrun the columns are every rank's
    # captions, in the keys' order (this rank's first).
    if w.dedupe == "caption":
        keys = captions
        if world()[1] > 1:
            ranks = gather_objects(list(captions))
            rank = world()[0]
            keys = ranks[rank] + [c for r, part in enumerate(ranks) if r != rank for c in part]
        f.same = torch.tensor([[a == c for c in keys] for a in captions], dtype=torch.bool, device=f.ids.device)
        f.hard = dedupe_targets(f.same, f.logits_i2t.shape[1])  # (B, B+Q), symmetric


def contrastive_losses(f, w, alpha: float, distill: bool) -> dict:
    """itc_loss (sigmoid, focal, distilled or plain, as the config says) and itc_consistency_loss, where weighted."""
    losses = {}
    if w.itc > 0:
        if w.itc_kind == "sigmoid":
            # SigLIP: this rank's images against every rank's texts (gathered with gradient, this rank's first): the
            # B x B_global block of the pairs, every block of the global B_global x B_global once over the ranks
            losses["itc_loss"] = sigmoid_itc_loss(f.logits_i2t, f.same)
        elif w.focal_gamma > 0:
            losses["itc_loss"] = focal_itc_loss(f.logits_i2t, f.logits_t2i, w.focal_gamma)
        elif distill:
            with torch.no_grad():
                logits_m_i2t, logits_m_t2i = itc_logits(f.momentum[1], f.momentum[3], f.image_keys, f.text_keys,
                                                        f.temp, *f.queues)
                targets_i2t = distill_targets(logits_m_i2t, alpha, f.hard)
                targets_t2i = distill_targets(logits_m_t2i, alpha, f.hard)
            losses["itc_loss"] = itc_loss(f.logits_i2t, f.logits_t2i, targets_i2t, targets_t2i)
        else:
            losses["itc_loss"] = itc_loss(f.logits_i2t, f.logits_t2i, f.hard, f.hard)
    if w.consistency > 0:
        losses["itc_consistency_loss"] = itc_consistency_loss(f.logits_i2t, f.logits_t2i, f.image_keys.shape[0])
    return losses

"""TOnICS' noun-query aligner (3.2): s(i, j) for every noun i and image j, and the losses L_IR and L_TR."""

from vltrain.layers import noun_states
from vltrain.losses import tonics_ir_loss, tonics_tr_loss


def aligner_losses(model, f, w, noun_mask) -> dict:
    """tonics_ir_loss / tonics_tr_loss where weighted; the sampler keeps one image out of a batch twice."""
    scores = model.align_scores(noun_states(f.text_hidden, noun_mask), f.image_tokens)
    losses = {}
    if w.tonics_ir > 0:
        losses["tonics_ir_loss"] = tonics_ir_loss(scores)
    if w.tonics_tr > 0:
        losses["tonics_tr_loss"] = tonics_tr_loss(scores)
    return losses

"""Masked language modelling through the fusion encoder (ALBEF 3.2), with the momentum model's soft targets (3.3)."""

import torch

from vltrain.losses import mlm_cap, mlm_loss, mlm_mask, mlm_rows, upcast
from vltrain.model import mask_token_id, model_tokenizer
from vltrain.objectives import Draws


def fixed_rows(labels: torch.Tensor) -> bool:
    """Whether the vocabulary head takes the masked positions at a size fixed on the host (`mlm_rows`): on a GPU,
    where a boolean index reads the count back from the device (a sync per step), and inside a compiled graph (static
    shapes). On a CPU that read costs nothing, and the boolean index scores the masked rows alone: the cap's fill rows
    would be head FLOPs for nothing (+6.6% of an albef step on the demo's 4-token captions, 4% of its time)."""
    return labels.device.type != "cpu" or torch.compiler.is_compiling()


def masked_lm_loss(model, f, w, generator: torch.Generator | Draws, tokenizer, alpha: float | torch.Tensor,
                   distill: bool, fixed: bool | None = None) -> dict:
    """mlm_loss: the masked caption fused with the image, the vocabulary head on the masked positions only
    (`generator` a Draws: its mask); and mlm_overflow (0-d): the masked positions left out past `mlm_cap`, 0 but
    with probability below 1e-9 a step (always 0 on the boolean index). `fixed`: take the positions at the fixed
    size (True) or by a boolean index (False); None: `fixed_rows` decides."""
    mask = f.mask
    if f.mlm_masked is not None:  # the text was encoded masked already; ITM's positive rows are this fusion
        masked, labels = f.mlm_masked
        fused = f.fused[:f.ids.shape[0]] if w.itm > 0 else model.fuse(f.text_hidden, mask, f.image_tokens, ends=f.ends)
    else:
        if isinstance(generator, Draws):
            masked, labels = generator.mlm
        else:
            tok = tokenizer or model_tokenizer(model)
            masked, labels = mlm_mask(f.ids, w.mlm_prob, tok.all_special_ids, mask_token_id(tok),
                                      model.text_encoder.config.vocab_size, generator)
        hidden, _ = model.encode_text(masked, mask, f.ends)
        fused = model.fuse(hidden, mask, f.image_tokens, ends=f.ends)
    # The vocabulary head runs on the masked positions only (about 15% of them): the loss reads nothing else,
    # and over MiniLM's 30,522 words the full (B, L, V) logits were the largest matmul of an ALBEF step. They are
    # taken at a size the host knows (a boolean index would read their count back from the device, a sync per
    # step): mlm_cap of the tokens that can be masked, at most the rows' real tokens (the host's `ends`; a compiled
    # step has none and takes every position, its static shape), the fill rows labelled -100 out of the loss.
    if fixed_rows(labels) if fixed is None else fixed:
        n = sum(f.ends) if f.ends is not None else labels.numel()
        rows, kept, overflow = mlm_rows(labels, mlm_cap(n, w.mlm_prob))
    else:  # the same rows in the same order as the fixed size's, without its fill rows
        rows = (labels.reshape(-1) != -100).nonzero().squeeze(1)
        kept, overflow = labels.reshape(-1)[rows], torch.zeros((), dtype=torch.int64, device=labels.device)
    logits = model.mlm_logits(fused.flatten(0, 1)[rows])  # (cap, V)
    soft = None
    if distill:
        mom = model.momentum
        image_tokens_m, _, text_hidden_m, _ = f.momentum
        with torch.no_grad():
            hidden_m = text_hidden_m if f.mlm_masked is not None else mom.encode_text(masked, mask, f.ends)[0]
            fused_m = mom.fuse(hidden_m, mask, image_tokens_m, ends=f.ends)
            soft = upcast(mom.mlm_logits(fused_m.flatten(0, 1)[rows])).softmax(dim=-1)
    return {"mlm_loss": mlm_loss(logits, kept, soft, alpha if distill else 0.0), "mlm_overflow": overflow}

"""The training objectives, one module per role, each a function of one step's `Forward`:

- contrastive: ITC logits against in-batch (all ranks') and queued keys, plain / distilled (ALBEF) / focal
  (SoftMask++) ITC and GRIT-VLP's consistency loss;
- matching: ITM on hard negatives (ALBEF sampled, GRIT-VLP hardest), with SoftMask++'s soft ITM (vltrain.softmask);
- masked_lm: MLM through the fusion encoder, distilled from the momentum model (ALBEF);
- aligner: TOnICS' noun-query aligner losses L_IR and L_TR.

vltrain.step encodes the batch once (`Forward`) and adds up the weighted losses these return.
"""

from dataclasses import dataclass

import torch


@dataclass
class Forward:
    """One step's batch encoded once, and what the objectives derive from it for the ones after them."""

    images: torch.Tensor                 # pixels (B, 3, H, W) or cached tokens (B, N, D)
    ids: torch.Tensor                    # the caption's token ids (B, L)
    mask: torch.Tensor                   # its attention mask (B, L)
    text_ids: torch.Tensor               # what the text encoder read: ids, or the MLM-masked ids (masked_text_all)
    mlm_masked: tuple | None             # (masked ids, labels) when every loss reads the masked caption
    image_tokens: torch.Tensor           # (B, N, E_fusion)
    image_feat: torch.Tensor             # (B, E), L2-normalised
    text_hidden: torch.Tensor            # (B, L, E_text)
    text_feat: torch.Tensor              # (B, E)
    momentum: tuple | None = None        # the momentum model's (image_tokens, image_feat, text_hidden, text_feat)
    ends: list | None = None             # each caption's length as host ints (row_ends), for the length groups
    # contrastive_logits fills these in:
    temp: torch.Tensor | None = None
    logits_i2t: torch.Tensor | None = None   # (B, B_global + Q)
    logits_t2i: torch.Tensor | None = None
    image_keys: torch.Tensor | None = None   # (B_global, E): every rank's keys, this rank's first
    text_keys: torch.Tensor | None = None
    queues: tuple = (None, None)             # the (E, Q) image and text queues, or (None, None)
    enqueue: tuple | None = None             # the detached (image, text) keys to enqueue after the step
    same: torch.Tensor | None = None         # loss.dedupe=caption: (B, B_global) byte-identical captions
    hard: torch.Tensor | None = None         # ... as ITC targets (B, B_global + Q)
    fused: torch.Tensor | None = None        # matching: the ITM rows' fusion output (positives first)


@dataclass
class Draws:
    """One step's random draws, made before a compiled step (train.compile=step) and passed where the step takes its
    generator: a traced graph cannot read a torch.Generator (Dynamo breaks the graph at each such draw)."""

    mlm: tuple | None = None             # mlm_mask's (masked ids, labels) (B, L) x2, from the run's generator
    itm: torch.Tensor | None = None      # (2, B) uniforms in [0, 1): row i's negative caption, then its negative image

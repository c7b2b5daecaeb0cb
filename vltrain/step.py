"""One training step: the batch encoded once (`encode`), then the named losses of vltrain.objectives, weighted."""

import torch

from vltrain.data.collate import bucket_length, pad_captions
from vltrain.losses import mlm_mask
from vltrain.model import mask_token_id, model_tokenizer
from vltrain.objectives import Draws, Forward
from vltrain.objectives.aligner import aligner_losses
from vltrain.objectives.contrastive import contrastive_logits, contrastive_losses
from vltrain.objectives.masked_lm import masked_lm_loss
from vltrain.objectives.matching import matching_losses

WEIGHTS = {"itc_loss": "itc", "itc_consistency_loss": "consistency", "itm_loss": "itm", "mlm_loss": "mlm",
           "softmask_itm_loss": "softmask_itm", "tonics_ir_loss": "tonics_ir", "tonics_tr_loss": "tonics_tr"}


def distill_alpha_at(step: int, cfg) -> float:
    """Distillation weight of the step-th optimiser step (1-based): ALBEF's alpha * min(1, i / W), i = step - 1."""
    w = cfg.loss
    if w.distill_warmup_steps <= 0:
        return w.distill_alpha
    # ALBEF's Pretrain.py counts i from 0 within the first epoch, so its first step distils with weight 0.
    return w.distill_alpha * min(1.0, (step - 1) / w.distill_warmup_steps)


def encode(model, batch: dict, w, generator: torch.Generator | Draws, tokenizer=None) -> Forward:
    """Both towers (and the momentum model's, without gradient) on the batch; with loss.masked_text_all the text
    tower reads the MLM-masked caption (SoftMask++ MMDA, 3.4), so it runs once for every loss (`generator` a
    Draws: its mask)."""
    images = batch["features"] if "features" in batch else batch["images"]
    ids = batch["input_ids"]
    mask = batch["attention_mask"]
    mlm_masked = None
    if w.masked_text_all and w.mlm > 0 and isinstance(generator, Draws):
        mlm_masked = generator.mlm
    elif w.masked_text_all and w.mlm > 0:
        tok = tokenizer or model_tokenizer(model)
        mlm_masked = mlm_mask(ids, w.mlm_prob, tok.all_special_ids, mask_token_id(tok),
                              model.text_encoder.config.vocab_size, generator)
    text_ids = ids if mlm_masked is None else mlm_masked[0]
    # The captions' lengths as the host knows them (the trainer reads the CPU mask before the batch goes to the
    # device), so that the length groups read nothing back from the device; None: read from the mask
    ends = batch.get("text_ends")
    image_tokens, image_feat = model.encode_image(images)
    text_hidden, text_feat = model.encode_text(text_ids, mask, ends)
    f = Forward(images, ids, mask, text_ids, mlm_masked, image_tokens, image_feat, text_hidden, text_feat, ends=ends)
    if model.momentum is not None:
        with torch.no_grad():
            f.momentum = (*model.momentum.encode_image(images), *model.momentum.encode_text(text_ids, mask, ends))
    return f


def train_step(model, batch: dict, w, generator: torch.Generator | Draws, tokenizer=None,
               alpha: float | torch.Tensor | None = None) -> dict:
    """Forward pass and named losses (*_loss and the weighted `total`) for one batch; grads are left to the caller.

    `w` is the run's LossConfig and `alpha` this step's distillation weight (`distill_alpha_at`; None =
    w.distill_alpha; a 0-d tensor in a compiled step). `generator` draws the MLM masks and hard negatives, or is a
    Draws holding them (`draw`: a compiled step's, made before its graph). The dict also holds `queue_feats`, the
    detached (image, text) keys (B, E) x2 to enqueue after the step.
    """
    f = encode(model, batch, w, generator, tokenizer)
    distill = w.distill_alpha > 0 and model.momentum is not None
    alpha = w.distill_alpha if alpha is None else alpha
    contrastive_logits(model, f, w, batch.get("captions"))
    losses = contrastive_losses(f, w, alpha, distill)
    if w.itm > 0:
        losses.update(matching_losses(model, f, w, generator))
    if w.mlm > 0:
        mlm = masked_lm_loss(model, f, w, generator, tokenizer, alpha, distill)
        losses["mlm_loss"] = mlm["mlm_loss"]
    if w.tonics_ir > 0 or w.tonics_tr > 0:
        losses.update(aligner_losses(model, f, w, batch["noun_mask"]))
    losses["total"] = sum(getattr(w, WEIGHTS[k]) * v for k, v in losses.items())
    if w.mlm > 0:  # a count, not a loss (so after the total), read at the flush with the losses (vltrain.runlog)
        losses["mlm_overflow"] = mlm["mlm_overflow"]
    losses["queue_feats"] = f.enqueue
    return losses


class TrainStep(torch.nn.Module):
    """`train_step` as a module's forward, so that under DDP the whole computation runs through the wrapped
    module's forward (a method call on the inner model would skip the gradient synchronisation, silently)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: dict, w, generator: torch.Generator, tokenizer, alpha: float) -> dict:
        return train_step(self.model, batch, w, generator, tokenizer, alpha)


BUCKETS = 4  # caption lengths a compiled step pads to: data.max_len's quarters, so at most 4 compilations


def draw(model, batch: dict, w, generator: torch.Generator, tokenizer=None) -> Draws:
    """The step's random draws from the run's generator, made eagerly before a compiled step: MLM's mask (as
    `mlm_mask` draws it in an eager step), then the uniforms of ITM's sampled hard negatives (2, B)."""
    ids = batch["input_ids"]
    mlm = itm = None
    if w.mlm > 0:
        tok = tokenizer or model_tokenizer(model)
        mlm = mlm_mask(ids, w.mlm_prob, tok.all_special_ids, mask_token_id(tok), model.text_encoder.config.vocab_size,
                       generator)
    if w.itm > 0 and w.itm_negatives != "hardest":
        itm = torch.rand((2, ids.shape[0]), generator=generator, device=ids.device)
    return Draws(mlm=mlm, itm=itm)


class CompiledStep:
    """train.compile=step: a step function (TrainStep, or its DDP wrapper) under torch.compile with static shapes,
    so that forward, losses and (through AOTAutograd) backward each run as one graph.

    Each batch's captions are padded to the smallest of BUCKETS lengths that holds them (`bucket_length`): one
    compilation per length, at most BUCKETS in a run, where padding all to data.max_len would pay for every padded
    token. The step's random draws are made before the graph (`draw`; a graph cannot read a torch.Generator), the
    distillation weight travels as a 0-d tensor (a float would be a constant of the graph: one compilation per
    warm-up step), and only the batch's tensors enter the graph (strings and host lists would each be guarded on).
    `compile=False` runs the same step eagerly: the numbers a compiled step is checked against; `backend`: torch.
    compile's (the tests' "aot_eager" traces the same graphs, forward and backward, without Inductor's slow code
    generation)."""

    def __init__(self, step_fn, model, max_len: int, pad_id: int, compile: bool = True, backend: str = "inductor"):
        self.model, self.max_len, self.pad_id = model, max_len, pad_id
        self.step_fn = torch.compile(step_fn, dynamic=False, backend=backend) if compile else step_fn

    def __call__(self, batch: dict, w, generator: torch.Generator, tokenizer, alpha: float) -> dict:
        batch = pad_captions(batch, bucket_length(batch["input_ids"].shape[1], self.max_len, BUCKETS), self.pad_id)
        draws = draw(self.model, batch, w, generator, tokenizer)
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
        # (a fill on the device, not a copy from the host, which would wait for the device's queue)
        alpha = torch.full((), float(alpha), device=batch["input_ids"].device)
        return self.step_fn(tensors, w, draws, None, alpha)


def wrap_ddp(model, w, device: torch.device):
    """TrainStep(model) under DistributedDataParallel (the process group must exist)."""
    # A head whose loss weight is 0 gets no gradient, which DDP must be told to expect (it costs a graph walk
    # per step, so only then).
    unused = ((model.fusion is not None and (w.itm == 0 or w.mlm == 0))
              or (model.aligner is not None and w.tonics_ir == 0 and w.tonics_tr == 0) or w.itc == 0)
    return torch.nn.parallel.DistributedDataParallel(
        TrainStep(model), device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=unused)

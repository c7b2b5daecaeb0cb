"""The training loop (`train`), one training step (`train_step`) and the lr schedule.

`train` reads top to bottom: setup (output folder, seeds, input kind, data, model, optimiser) -> resume (one
block) -> loop (step, log, curriculum check, eval, checkpoint) -> end. The loop's pieces are module-level functions
with explicit arguments; the periodic evaluation lives in vltrain.evaluate, the index samplers' set-up and the
curriculum plot in vltrain.samplers, the checkpoint format in vltrain.checkpoint.
"""

import copy
import datetime
import functools
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from torch.utils.data import DataLoader

from vlprep import VlprepError, versions
from vlprep.dataset import lock_output, release_output
from vltrain import TrainError
from vltrain import checkpoint as ckpt_io
from vltrain.config import GRIT_RATIOS, GRIT_RATIOS_BEFORE, Config, LossConfig, to_dict
from vltrain.distributed import (RankSlice, any_flags, barrier, broadcast, gather, gather_objects, init_from_env,
                                  max_over_ranks, world)
from vltrain.data import (Collate, ShardStream, count_split, data_signature, eval_transform, feature_input,
                          loader_error, to_device, train_transform)
from vltrain.evaluate import (distinct_positions, embed_split, heldout_r1, heldout_recall, plot_learning_curve,
                              val_triplet_sim)
from vltrain.losses import (dedupe_targets, distill_targets, focal_itc_loss, hard_negative_weights, hardest_negatives,
                            itc_consistency_loss, itc_logits, itc_loss, itm_loss, mlm_loss, mlm_mask,
                            sample_hard_negatives, softmask_itm_loss, tonics_ir_loss, tonics_tr_loss, upcast)
from vltrain.layers import noun_states
from vltrain.model import autocast, build_model, image_stats, resolve_device, tokenizer_for
from vltrain.samplers import GritSampler, TonicsBatchSampler, indexed_data, plot_curriculum
from vltrain.softmask import masks_for, parse_source

console = Console(stderr=True, emoji=False, soft_wrap=True)
EVAL_TRIPLETS = 1000  # triplet mode: validation retrieval over at most this many triplets (one per image)
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "result.json", "curriculum.json", "curriculum.png",
             "learning_curve.png", "tb")


class Interrupted(TrainError):
    """Ctrl-C or SIGTERM: last.pt was written; the message says how to go on."""


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate of the step-th optimiser step (1-based): linear warmup, then cosine to lr * min_ratio."""
    if step <= warmup:
        return lr * step / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    low = lr * min_ratio
    return low + (lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


def distill_alpha_at(step: int, cfg: Config) -> float:
    """Distillation weight of the step-th optimiser step (1-based): ALBEF's alpha * min(1, i / W), i = step - 1."""
    w = cfg.loss
    if w.distill_warmup_steps <= 0:
        return w.distill_alpha
    # ALBEF's Pretrain.py counts i from 0 within the first epoch, so its first step distils with weight 0.
    return w.distill_alpha * min(1.0, (step - 1) / w.distill_warmup_steps)


def train_step(model, batch: dict, w: LossConfig, generator: torch.Generator, tokenizer=None,
               alpha: float | None = None, masked_text_all: bool = False) -> dict:
    """Forward pass and named losses (*_loss and the weighted `total`) for one batch; grads are left to the caller.

    `w` is the run's loss config, `alpha` this step's distillation weight (`distill_alpha_at`; None =
    w.distill_alpha), `masked_text_all` the data option. The dict also holds `queue_feats`, the detached (image,
    text) features (B, E) x2 to enqueue after the step.
    """
    images = batch["features"] if "features" in batch else batch["images"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    mlm_masked = None
    if masked_text_all and w.mlm > 0:
        # SoftMask++ MMDA (3.4): the MLM-masked caption is the text of every loss, so the text encoder runs once.
        tok = tokenizer or tokenizer_for(model.cfg.text_model)
        mlm_masked = mlm_mask(ids, w.mlm_prob, tok.all_special_ids, tok.mask_token_id,
                              model.text_encoder.config.vocab_size, generator)
    text_ids = ids if mlm_masked is None else mlm_masked[0]
    image_tokens, image_feat = model.encode_image(images)
    text_hidden, text_feat = model.encode_text(text_ids, mask)
    temp = model.temperature()
    mom = model.momentum
    distill = w.distill_alpha > 0 and mom is not None
    alpha = w.distill_alpha if alpha is None else alpha
    queued = model.cfg.queue_size > 0
    img_q, txt_q = (model.image_queue, model.text_queue) if queued else (None, None)

    # ALBEF: with a momentum model the contrastive keys (in-batch and queued) are momentum features.
    with torch.no_grad():
        if mom is not None:
            image_tokens_m, image_feat_m = mom.encode_image(images)
            text_hidden_m, text_feat_m = mom.encode_text(text_ids, mask)
            image_keys, text_keys = image_feat_m, text_feat_m
    if mom is None:
        image_keys, text_keys = image_feat, text_feat
    # Under DDP the keys are every rank's (momentum keys without gradient), this rank's rows first so that the
    # positives stay on the diagonal: the loss is the single-process loss on the global batch. The queue takes
    # the gathered keys in rank order, so every rank's queue stays the same. Outside torchrun both are the keys.
    (image_keys, queue_img), (text_keys, queue_txt) = (gather(image_keys, mom is None),
                                                       gather(text_keys, mom is None))
    logits_i2t, logits_t2i = itc_logits(image_feat, text_feat, image_keys, text_keys, temp, img_q, txt_q,
                                        w.itc_detach_keys)  # (B, B_global+Q) x2

    # loss.dedupe=caption: pairs whose captions are byte-identical (str equality of the decoded UTF-8) are not
    # negatives of each other: extra ITC positives, never ITM negatives. Token ids would not do: the tokenizer
    # lowercases and truncates, so different captions can share ids. Under torchrun the columns are every rank's
    # captions, in the keys' order (this rank's first).
    same = None
    if w.dedupe == "caption":
        caps = batch["captions"]
        if world()[1] > 1:
            ranks = gather_objects(list(caps))
            rank = world()[0]
            keys = ranks[rank] + [c for r, part in enumerate(ranks) if r != rank for c in part]
        else:
            keys = caps
        same = torch.tensor([[a == c for c in keys] for a in caps], dtype=torch.bool, device=ids.device)  # (B, G)
    hard = None if same is None else dedupe_targets(same, logits_i2t.shape[1])  # (B, B+Q), symmetric

    losses = {}
    if w.itc > 0:
        if w.focal_gamma > 0:
            losses["itc_loss"] = focal_itc_loss(logits_i2t, logits_t2i, w.focal_gamma)
        elif distill:
            with torch.no_grad():
                logits_m_i2t, logits_m_t2i = itc_logits(image_feat_m, text_feat_m, image_keys, text_keys, temp,
                                                        img_q, txt_q)
                targets_i2t = distill_targets(logits_m_i2t, alpha, hard)
                targets_t2i = distill_targets(logits_m_t2i, alpha, hard)
            losses["itc_loss"] = itc_loss(logits_i2t, logits_t2i, targets_i2t, targets_t2i)
        else:
            losses["itc_loss"] = itc_loss(logits_i2t, logits_t2i, hard, hard)
    if w.consistency > 0:
        losses["itc_consistency_loss"] = itc_consistency_loss(logits_i2t, logits_t2i, image_keys.shape[0])

    if w.itm > 0:
        b = ids.shape[0]
        # The pool the negatives come from: this rank's batch (ALBEF), or with loss.itm_global_negatives under
        # torchrun every rank's (BLIP), whose token sequences are gathered with gradient, padded to the longest
        # caption of any rank (padding is masked out of the fusion's attention).
        pool_text, pool_mask, pool_image, text_hidden_p, mask_p = text_hidden, mask, image_tokens, text_hidden, mask
        if w.itm_global_negatives and world()[1] > 1:
            length = max_over_ranks(mask.shape[1])
            text_hidden_p = F.pad(text_hidden, (0, 0, 0, length - mask.shape[1]))
            mask_p = F.pad(mask, (0, length - mask.shape[1]))
            pool_text, pool_mask, pool_image = (gather(text_hidden_p, True)[0], gather(mask_p, False)[0],
                                                gather(image_tokens, True)[0])
        width = pool_text.shape[0]
        w_i2t, w_t2i = hard_negative_weights(logits_i2t, logits_t2i,
                                             None if same is None else same[:, :width], width)
        # A row whose every other caption is a duplicate of its own has no negative: it sits out of ITM this step
        # (its draw still happens, from placeholder weights, so the generator advances as in any other step).
        has_t, has_i = w_i2t.sum(dim=1) > 0, w_t2i.sum(dim=1) > 0
        anywhere = 1.0 - torch.eye(b, width, device=w_i2t.device, dtype=w_i2t.dtype)
        w_i2t = torch.where(has_t[:, None], w_i2t, anywhere)
        w_t2i = torch.where(has_i[:, None], w_t2i, anywhere)
        if w.itm_negatives == "hardest":  # GRIT-VLP's released code: the top-1 of the weights, no draw
            neg_text, neg_image = hardest_negatives(w_i2t), hardest_negatives(w_t2i)
        else:
            neg_text = sample_hard_negatives(w_i2t, generator)   # a hard negative caption for each image
            neg_image = sample_hard_negatives(w_t2i, generator)  # a hard negative image for each caption
        # Rows: B positives, caption i with its negative image, image i with its negative caption.
        want_maps = w.softmask_itm > 0 and parse_source(w.softmask_source)[0] != "random"
        fused = model.fuse(torch.cat([text_hidden_p, text_hidden_p[has_i], pool_text[neg_text][has_t]]),
                           torch.cat([mask_p, mask_p[has_i], pool_mask[neg_text][has_t]]),
                           torch.cat([image_tokens, pool_image[neg_image][has_i], image_tokens[has_t]]),
                           return_attn=want_maps)
        fused, maps = fused if want_maps else (fused, None)
        if text_hidden_p is not text_hidden:  # back to this rank's caption length (MLM reads the positive rows)
            fused = fused[:, :mask.shape[1]]
            maps = None if maps is None else [m[..., :mask.shape[1], :] for m in maps]
        n_neg = int(has_i.sum()) + int(has_t.sum())
        labels = torch.cat([torch.ones(b, dtype=torch.long), torch.zeros(n_neg, dtype=torch.long)]).to(ids.device)
        itm_out = model.itm_logits(fused)
        losses["itm_loss"] = itm_loss(itm_out, labels)
        if w.softmask_itm > 0:
            losses["softmask_itm_loss"] = _softmask_itm(model, w.softmask_source, itm_out[:b], maps, text_hidden, mask,
                                                        image_tokens, generator)

    if w.mlm > 0:
        if mlm_masked is not None:  # the text was encoded masked already; ITM's positive rows are this fusion
            masked, labels = mlm_masked
            fused_mlm = fused[:ids.shape[0]] if w.itm > 0 else model.fuse(text_hidden, mask, image_tokens)
        else:
            tok = tokenizer or tokenizer_for(model.cfg.text_model)
            masked, labels = mlm_mask(ids, w.mlm_prob, tok.all_special_ids, tok.mask_token_id,
                                      model.text_encoder.config.vocab_size, generator)
            hidden, _ = model.encode_text(masked, mask)
            fused_mlm = model.fuse(hidden, mask, image_tokens)
        # The vocabulary head runs on the masked positions only (about 15% of them): the loss reads nothing else,
        # and over MiniLM's 30,522 words the full (B, L, V) logits were the largest matmul of an ALBEF step.
        picked = labels != -100
        logits = model.mlm_logits(fused_mlm[picked])  # (N, V)
        soft = None
        if distill:
            with torch.no_grad():
                hidden_m = text_hidden_m if mlm_masked is not None else mom.encode_text(masked, mask)[0]
                soft = upcast(mom.mlm_logits(mom.fuse(hidden_m, mask, image_tokens_m)[picked])).softmax(dim=-1)
        losses["mlm_loss"] = mlm_loss(logits, labels[picked], soft, alpha if distill else 0.0)

    if w.tonics_ir > 0 or w.tonics_tr > 0:
        # TOnICS aligner: s(i, j) for every noun i and image j; the sampler keeps one image out of a batch twice.
        scores = model.align_scores(noun_states(text_hidden, batch["noun_mask"]), image_tokens)
        if w.tonics_ir > 0:
            losses["tonics_ir_loss"] = tonics_ir_loss(scores)
        if w.tonics_tr > 0:
            losses["tonics_tr_loss"] = tonics_tr_loss(scores)

    weights = {"itc_loss": w.itc, "itc_consistency_loss": w.consistency, "itm_loss": w.itm, "mlm_loss": w.mlm,
               "softmask_itm_loss": w.softmask_itm, "tonics_ir_loss": w.tonics_ir, "tonics_tr_loss": w.tonics_tr}
    losses["total"] = sum(weights[k] * v for k, v in losses.items())
    losses["queue_feats"] = (queue_img.detach(), queue_txt.detach())
    return losses


class TrainStep(torch.nn.Module):
    """`train_step` as a module's forward, so that under DDP the whole computation runs through the wrapped
    module's forward (a method call on the inner model would skip the gradient synchronisation, silently)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: dict, w: LossConfig, generator: torch.Generator, tokenizer, alpha: float,
                masked_text_all: bool) -> dict:
        return train_step(self.model, batch, w, generator, tokenizer, alpha, masked_text_all)


def wrap_ddp(model, w: LossConfig, device: torch.device):
    """TrainStep(model) under DistributedDataParallel (the process group must exist)."""
    # A head whose loss weight is 0 gets no gradient, which DDP must be told to expect (it costs a graph walk
    # per step, so only then).
    unused = ((model.fusion is not None and (w.itm == 0 or w.mlm == 0))
              or (model.aligner is not None and w.tonics_ir == 0 and w.tonics_tr == 0) or w.itc == 0)
    return torch.nn.parallel.DistributedDataParallel(
        TrainStep(model), device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=unused)


def _softmask_itm(model, source: str, pos_logits: torch.Tensor, maps: list | None, text_hidden: torch.Tensor,
                  mask: torch.Tensor, image_tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """SoftMask++ eq. 12: the positive pairs again, image tokens multiplied by this step's mask M, labelled match.

    pos_logits (B, 2) are the positives' ITM logits and `maps` the ITM pass's cross-attention probabilities (rows
    0..B-1 are the positives); M carries no gradient.
    """
    b = pos_logits.shape[0]
    grads = None
    if maps is not None:
        if parse_source(source)[0] == "gradcam":
            # s+ = the positives' match probability summed over the batch; d s+ / dA for every fusion layer (the
            # rows past B, the negatives, get zeros). The maps are not parameters, so autograd.grad leaves every
            # .grad alone; retain_graph keeps the step's graph for the backward pass.
            s_pos = upcast(pos_logits).softmax(dim=-1)[:, 1].sum()
            grads = [g[:b].detach() for g in torch.autograd.grad(s_pos, maps, retain_graph=True)]
        maps = [a[:b].detach() for a in maps]
    m = masks_for(source, maps, grads, mask.bool(), image_tokens.shape[1], generator)
    return softmask_itm_loss(model.itm_logits(model.fuse(text_hidden, mask, image_tokens, patch_weights=m)))


# --- helpers -----------------------------------------------------------------------------------------------------


def _ignore_sigint(worker_id: int) -> None:
    """Loader workers leave Ctrl-C to the main process, which finishes its step and saves before stopping."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _next_batch(batches, rng_state: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """next(batches) drawing augmentations from the data's own torch RNG state; returns (batch, new state)."""
    # With workers=0 the transforms run here and would share the global RNG with dropout, so a resumed run
    # replaying its epoch's first batches would crop differently. Workers have their own RNG already.
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        batch = next(batches)
        return batch, torch.get_rng_state()


def _fit_workers(cfg: Config, n_train: int, n_shards: int) -> None:
    """Fewer streaming workers when some would get no shard, or when the data fill less than a batch per worker.

    Each worker batches its own shards and drops its last partial batch, so with W workers and fewer than W * B
    training samples an epoch can yield no batch at all, and the run would wait forever.
    """
    w = cfg.data.workers
    fit = min(w, n_shards, max(1, n_train // cfg.batch_size))
    if fit < w:
        why = (f"{n_train} training samples fill fewer than one batch of {cfg.batch_size} per worker"
               if fit < n_shards else f"the data has {n_shards} shard(s), one worker's share at most")
        console.print(f"warning: data.workers {w} -> {fit}: {why}", highlight=False)
        cfg.data.workers = fit


# Undecodable samples are skipped and counted; past this share of the samples read the data is called broken.
MAX_BAD_FRACTION = 0.01
MIN_READ_FOR_BAD_CHECK = 200  # before that, one bad sample among the first few is not yet a 1% problem


def _check_bad_samples(counts, final: bool = False) -> int:
    """The undecodable samples so far; a TrainError once they are more than 1% of those read (checked after 200
    reads, or at an epoch's end)."""
    read, bad = counts.totals()
    if bad > MAX_BAD_FRACTION * read and (final or read >= MIN_READ_FOR_BAD_CHECK):
        raise TrainError(f"{bad} of {read} samples read could not be decoded ({100 * bad / read:.1f}%, more than "
                         f"{100 * MAX_BAD_FRACTION:g}%): the data is damaged; re-create it with `vlprep shards "
                         "--decode-check`, which leaves such images out")
    return bad


# --- setup helpers ------------------------------------------------------------------------------------------------


def _prepare_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a folder that holds another run unless told to resume it or to overwrite it."""
    if resume:
        if not (out / "last.pt").exists():
            raise TrainError(f"--resume: no checkpoint at {out / 'last.pt'}")
        return
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not overwrite:
        raise TrainError(f"{out} already holds a run ({', '.join(found)}); add --resume to continue it or "
                         "--overwrite to start over (or choose another --out)")
    for name in found:  # only the files a run writes: anything else in the folder is the user's
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _seed_everything(seed: int, device: torch.device) -> None:
    """A fresh run is a function of its seed: every RNG seeded, deterministic kernels where torch has them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
        torch.backends.cudnn.benchmark = False
    # warn_only: an op without a deterministic kernel warns instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    # ...without filling every new tensor first (~5 ms of a 0.2 s CPU step): that guards reads of uninitialised
    # memory, which no op here does; results do not depend on it.
    torch.utils.deterministic.fill_uninitialized_memory = False


def _resolve_input(cfg: Config) -> None:
    """Features or pixels, from the shards' meta.json (data.input auto) or as asked; sets the model to match."""
    try:
        spec = feature_input(cfg.shards, cfg.data.input)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if spec is None:
        cfg.data.input = "pixels"
        if cfg.model.image_model == "features":
            raise TrainError("model.image_model=features needs `vlprep features` output as the data")
        return
    cfg.data.input = "features"
    cfg.model.image_model, cfg.model.feature_dim, cfg.model.feature_encoder = "features", int(spec["dim"]), spec


def _resolve_workers(cfg: Config, device: torch.device) -> None:
    """data.workers -1 (auto): 0 for cached tokens on a CPU, where loading is light and worker processes only
    compete with torch's threads (and are forked anew each epoch: benchmarks/features.py), 2 otherwise."""
    if cfg.data.workers < 0:
        cfg.data.workers = 0 if cfg.data.input == "features" and device.type == "cpu" else 2


def _speed_options(cfg: Config, model, device: torch.device, use_features: bool) -> bool:
    """Apply train.tf32 / channels_last / compile; returns whether pixels go channels-last."""
    cuda = device.type == "cuda"
    if cuda:  # TF32: ~10-bit mantissa matmuls on Ampere and later, the usual trade for training speed
        on = cfg.train.tf32 != "off"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    channels_last = not use_features and (cfg.train.channels_last == "on"
                                          or (cfg.train.channels_last == "auto" and cuda))
    if channels_last:  # NHWC convolutions are the fast path of tensor cores; only 4-D weights change layout
        model.image_encoder.to(memory_format=torch.channels_last)
    if cfg.train.compile:  # in place (nn.Module.compile), so state_dict keys and checkpoints stay the same
        model.image_encoder.compile()
        model.text_encoder.compile()
    return channels_last


def _fmt_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _summary(cfg: Config, model, device, n_train: int, n_val: int, per_epoch: int, size: int = 1) -> str:
    """The start-of-run block: what will train, on what, for how long, where it goes."""
    m, w, d = cfg.model, cfg.loss, cfg.data
    trained, frozen, n_params = [], [], 0
    for name, child in model.named_children():
        if name == "momentum":
            continue
        params = list(child.parameters())
        if not params:
            continue
        k = sum(p.numel() for p in params if p.requires_grad)
        n_params += k
        (trained if k else frozen).append(name)
    if cfg.data.input == "features":
        spec = m.feature_encoder
        image = (f"cached {spec.get('encoder', '?')} tokens {spec.get('tokens')}x{spec.get('dim')} "
                 f"{spec.get('dtype', '')} (frozen, from `vlprep features`)")
    else:
        image = f"{m.image_model} on {d.image_size}px pixels ({'frozen' if m.freeze_image else 'trained'})"
    losses = ", ".join(f"{k} {v:g}" for k, v in (("itc", w.itc), ("itm", w.itm), ("mlm", w.mlm),
                                                  ("consistency", w.consistency), ("tonics_ir", w.tonics_ir),
                                                  ("tonics_tr", w.tonics_tr)) if v > 0)
    extras = [f"focal gamma {w.focal_gamma:g}"] if w.focal_gamma > 0 else []
    extras += [f"tau fixed at {m.temp:g}"] if not m.temp_learnable else []
    extras += [f"distill {w.distill_alpha:g}" + (f", ramped up over {w.distill_warmup_steps:,} steps"
                                                 if w.distill_warmup_steps > 0 else "")] if w.distill_alpha > 0 else []
    extras += [f"MLM {w.mlm_prob:.0%}"] if w.mlm > 0 else []
    dtype = "bf16 autocast" if device.type == "cuda" else "float32"
    lines = [
        f"vltrain run: preset {cfg.preset}, {cfg.steps:,} steps = {cfg.steps / max(per_epoch, 1):.1f} epochs of "
        f"{per_epoch:,} batches of {cfg.batch_size}"
        + (f" x {size} processes (DDP, global batch {cfg.batch_size * size})" if size > 1 else "")
        + f", seed {cfg.seed}",
        f"  data     {', '.join(cfg.shards)}: train {n_train:,}, held out {n_val:,} (val_frac {d.val_frac:g}); "
        f"sampler {cfg.sampler.kind}",
        f"  image    {image}",
        f"  text     {m.text_model}, max {d.max_len} tokens, {m.pooling} pooling; fusion layers {m.fusion_layers}"
        + (f" ({m.fusion_from})" if m.fusion_layers else "")
        + (f"; momentum {m.momentum_m:g}" if m.momentum else "") + f"; queue {m.queue_size:,}",
        f"  losses   {losses}" + (f" ({', '.join(extras)})" if extras else ""),
        f"  trains   {n_params / 1e6:.1f}M parameters in {', '.join(trained) or 'nothing'}"
        + (f"; frozen: {', '.join(frozen)}" if frozen else ""),
        f"  device   {device} ({dtype}); lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup_steps}",
        f"  out      {cfg.out}: last.pt every {cfg.ckpt_every} steps or {cfg.ckpt_minutes:g} min, best.pt at evals "
        f"every {cfg.eval_every} steps, metrics.jsonl, learning_curve.png, tb/",
    ]
    return "\n".join(lines)


# --- the loop's pieces --------------------------------------------------------------------------------------------


def epoch_batches(epoch: int, seed: int, dataset, sampler, collate, batch_size: int, workers: int,
                  device: torch.device) -> tuple:
    """(batch iterator, data RNG state) at the start of an epoch; both depend only on (seed, epoch)."""
    # A generator per epoch fixes the workers' seeds, so a resumed epoch replays the same augmentations.
    # Index samplers: an epoch is a GRIT pass over the data or a TOnICS curriculum period.
    seed = seed * 100_003 + epoch
    common = dict(collate_fn=collate, num_workers=workers, pin_memory=device.type == "cuda",
                  generator=torch.Generator().manual_seed(seed), worker_init_fn=_ignore_sigint)
    if sampler is not None:
        sampler.set_epoch(epoch)
        loader = DataLoader(dataset, batch_sampler=sampler, **common)
    else:
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=batch_size, drop_last=True, **common)
    return iter(loader), torch.Generator().manual_seed(seed + 1).get_state()


def checkpoint_state(model, optimizer, cfg: Config, step: int, epoch: int, consumed: int, best: float, sampler,
                     curriculum_log: list, generator: torch.Generator, data: str) -> dict:
    """What last.pt / best.pt hold: weights, optimiser, position in the data, sampler state, RNG states, config, and
    `data`, the training data's `data_signature` (computed once per run)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
            "consumed": consumed, "best": best, "config": to_dict(cfg), "data": data,
            "sampler": sampler.state_dict() if sampler is not None else None, "curriculum_log": curriculum_log,
            "rng": ckpt_io.rng_states(generator), "versions": versions()}


def save_checkpoint(path: Path, model, optimizer, cfg: Config, step: int, epoch: int, consumed: int, best: float,
                    sampler, curriculum_log: list, generator: torch.Generator, data: str,
                    every_rank: bool = True) -> None:
    """Write a checkpoint atomically. Under torchrun (every_rank) each rank's RNG states and data position are
    gathered into `ranks`; rank 0 writes and the others wait at a barrier."""
    rank, size = world()
    ranks = None
    if every_rank and size > 1:
        ranks = gather_objects({"rng": ckpt_io.rng_states(generator), "epoch": epoch, "consumed": consumed})
    if rank == 0:
        state = checkpoint_state(model, optimizer, cfg, step, epoch, consumed, best, sampler, curriculum_log,
                                 generator, data)
        if ranks is not None:
            state["ranks"] = ranks
        ckpt_io.save(state, path)
    if every_rank:
        barrier()


class _NoBoard:
    """TensorBoard stand-in for ranks other than 0 (rank 0 alone logs)."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def curriculum_check(model, sampler, view, heldout, collate, batch_size: int, triplets: bool, threshold: float,
                     step: int, names: list[str], curriculum_log: list, out: Path, device) -> dict:
    """TOnICS: held-out image retrieval R@1, and a curriculum refresh when it reaches the threshold."""
    acc = heldout_r1(model, view, heldout, collate, batch_size, triplets, device)
    refreshed = acc >= threshold
    if refreshed:
        sampler.curriculum.refresh()
    row = {"step": step, "heldout_r1": round(acc, 4), "refreshed": refreshed,
           "probs": [round(float(p), 6) for p in sampler.curriculum.probs]}
    curriculum_log.append(row)
    (out / "curriculum.json").write_text(json.dumps({"nodes": names, "log": curriculum_log}))
    plot_curriculum(curriculum_log, names, out / "curriculum.png")
    console.print(f"step {step} tonics check: held-out R@1 {acc:.2f} on {len(heldout)} "
                  f"{'refresh' if refreshed else 'no refresh'} (threshold {threshold}), "
                  f"P(entity) {sampler.curriculum.probs[0]:.3f}", highlight=False)
    return row


def _log(row: dict, rows: list, metrics_file) -> None:
    """One metrics.jsonl row, kept in `rows` for the learning curve too."""
    rows.append(row)
    metrics_file.write(json.dumps(row) + "\n")
    metrics_file.flush()


def _on_signal(stop: dict, signum, frame) -> None:
    """First Ctrl-C / SIGTERM: note it, so the loop saves after this step; a second one abandons the step."""
    if stop["signal"] is not None:
        raise KeyboardInterrupt
    stop["signal"] = signum
    console.print(f"{signal.Signals(signum).name}: finishing this step, then saving last.pt (again to abandon)",
                  highlight=False)


def _interrupted(model, optimizer, cfg: Config, step: int, epoch: int, consumed: int, best: float, sampler,
                 curriculum_log: list, generator: torch.Generator, data: str, last_path: Path) -> Interrupted:
    """Write last.pt and return the error that tells the user how to go on."""
    save_checkpoint(last_path, model, optimizer, cfg, step, epoch, consumed, best, sampler, curriculum_log, generator,
                    data)
    return Interrupted(f"stopped at step {step} of {cfg.steps}: {last_path} holds it; run the same command with "
                       "--resume to continue")


def _eta_note(done: int, elapsed: float, step: int, cfg: Config, device, use_features: bool) -> None:
    """After the first 10 steps: the measured speed and when the run will end (with a hint on a slow CPU run)."""
    sec_per_step = elapsed / done
    left = sec_per_step * (cfg.steps - step)
    end = (datetime.datetime.now() + datetime.timedelta(seconds=left)).strftime("%H:%M")
    console.print(f"{done} steps in {elapsed:.1f} s ({sec_per_step:.2f} s/step, "
                  f"{cfg.batch_size / sec_per_step:.1f} samples/s): the remaining {cfg.steps - step:,}"
                  f" steps take about {_fmt_duration(left)} (until about {end})", highlight=False)
    if left > 3600 and device.type == "cpu" and not use_features:
        console.print("hint: on a CPU, cache the image tower once with `vlprep features IN OUT` and "
                      "train on OUT: several times faster (docs/FEATURES.md)", highlight=False)


# --- the loop -----------------------------------------------------------------------------------------------------


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict:
    """Train as cfg says, writing OUT/{metrics.jsonl, tb/, last.pt, best.pt}; returns the final metrics.

    Refuses an OUT holding another run unless `resume` (continue from OUT/last.pt) or `overwrite` (start over).
    Ctrl-C / SIGTERM finish the current step, write last.pt and raise `Interrupted`.
    """
    # --- setup
    cfg = copy.deepcopy(cfg)
    out = Path(cfg.out)
    last_path, best_path, metrics_path = out / "last.pt", out / "best.pt", out / "metrics.jsonl"
    created_group, device_name = init_from_env(cfg.device)  # torchrun: join the process group
    rank, size = world()
    if size > 1:
        console.quiet = rank > 0  # rank 0 alone reports
    try:
        device = resolve_device(device_name)
    except VlprepError as e:  # the shared resolver's one-line error
        raise TrainError(str(e)) from None
    error = None
    if rank == 0:
        try:  # one run per OUT: a second `--resume` on the same folder would interleave two runs' checkpoints
            lock_output(out, "vltrain")
            _prepare_out(out, resume, overwrite)
        except (VlprepError, TrainError) as e:
            error = str(e)
    error = broadcast(error)  # every rank stops on rank 0's error instead of waiting for it
    if error is not None:
        raise TrainError(error)
    ckpt = ckpt_io.load(last_path, "--resume checkpoint") if resume else None
    saved_size = len(ckpt.get("ranks") or [None]) if ckpt is not None else size
    if saved_size != size:  # each rank's RNG states and data position are in the checkpoint
        raise TrainError(f"--resume: {last_path} was written by {saved_size} process(es) and this run has {size}; "
                         "resume with the same --nproc_per_node")
    # Every rank builds the same model from the run seed; the ranks' own draws (dropout, masks, negatives,
    # augmentation) then use per-rank seeds derived from it.
    rank_seed = cfg.seed + 1_000_003 * rank
    _seed_everything(cfg.seed, device)
    _resolve_input(cfg)
    _resolve_workers(cfg, device)

    # --- data
    tok = tokenizer_for(cfg.model.text_model)
    use_features = cfg.data.input == "features"
    mean, std, _ = image_stats(cfg.model)
    tf_train = None if use_features else train_transform(cfg.data.image_size, mean, std, cfg.data.min_crop_scale,
                                                         cfg.data.augment)
    if use_features and cfg.data.augment != "none":
        console.print(f"note: data.augment={cfg.data.augment} needs pixels; the cached tokens are fixed views, so "
                      "images are not augmented (train on the pixel dataset to augment)", highlight=False)
    tf_eval = None if use_features else eval_transform(cfg.data.image_size, mean, std)
    collate = Collate(tok, cfg.data.max_len, use_features)
    data = {}
    if cfg.sampler.kind != "random" or cfg.data.triplets:
        # TOnICS / GRIT / triplets: positions from a batch sampler, samples read through wids.
        # A GRIT checkpoint from before the sizes were saved in its state used the former default ratios.
        old_grit = ckpt is not None and isinstance(ckpt.get("sampler"), dict) and "m" not in ckpt["sampler"]
        data = indexed_data(cfg, tf_train, tf_eval, GRIT_RATIOS_BEFORE if old_grit else GRIT_RATIOS, size)
        for note in data["notes"]:
            console.print(note, highlight=False)
        sampler, train_set, n_train, n_val = data["sampler"], data["train"], len(data["train"]), len(data["val"])
        load_counts = train_set.shards.counts
    else:
        counts = count_split(cfg.shards, cfg.data.val_frac)
        n_train, n_val = counts["train"], counts["val"]
        sampler = None
        train_set = ShardStream(cfg.shards, "train", cfg.data.val_frac, tf_train, seed=cfg.seed,
                                use_features=use_features, rank=rank, world=size)
        load_counts = train_set.counts
    global_batch = cfg.batch_size * size  # --batch-size is per process
    if n_train < global_batch:
        raise TrainError(f"the training split has {n_train} {'triplets' if cfg.data.triplets else 'samples'}, fewer "
                         f"than one batch of {global_batch}; lower --batch-size or data.val_frac")
    per_epoch = n_train // global_batch  # drop_last: every batch is full (hard negatives need B >= 2)
    if sampler is None:
        if len(train_set.shards) < size:
            raise TrainError(f"the random sampler gives each process whole shards, and the data has "
                             f"{len(train_set.shards)} shard(s) for {size} processes; write more, smaller shards")
        _fit_workers(cfg, n_train // size, len(train_set.shards) // size)
    if cfg.epochs > 0:
        cfg.steps = max(1, math.ceil(cfg.epochs * per_epoch))
    if cfg.loss.distill_warmup_steps < 0:  # -1: one epoch of this training split (ALBEF); the checkpoint keeps it
        cfg.loss.distill_warmup_steps = per_epoch
    data_sig = data_signature(cfg.shards)
    asked_queue = cfg.model.queue_size
    cfg.model.queue_size = min(asked_queue, n_train)
    if ckpt is not None:
        diffs = ckpt_io.config_diff(ckpt["config"], to_dict(cfg), defaults=to_dict(Config()))
        if diffs:
            raise TrainError(f"--resume: {last_path} was trained with another config ({'; '.join(diffs[:8])}"
                             f"{'; ...' if len(diffs) > 8 else ''}); use the same options, or a new --out")
        if ckpt.get("data") not in (None, data_sig):  # None: a checkpoint from before the signature
            raise TrainError(f"--resume: the training data changed since {last_path} was written (other keys or "
                             f"captions in {', '.join(cfg.shards)}); use --overwrite to start over, or a new --out")
    if asked_queue > n_train:
        console.print(f"warning: model.queue_size {asked_queue:,} is longer than the training split ({n_train:,}): "
                      f"every sample would sit in the queue as its own negative more than once; clamped to "
                      f"{n_train:,}", highlight=False)
    tonics = isinstance(sampler, TonicsBatchSampler) and cfg.sampler.kind == "tonics"
    heldout = (distinct_positions(data["val"], cfg.sampler.heldout, cfg.seed) if tonics else None)
    if tonics and len(heldout) < 2:
        raise TrainError(f"the TOnICS refresh check needs held-out instances and the validation split has "
                         f"{len(heldout)}; raise data.val_frac")
    val_triplets = distinct_positions(data["val"], EVAL_TRIPLETS, cfg.seed) if cfg.data.triplets else None

    # --- model
    model = build_model(cfg.model)
    if ckpt is not None:
        ckpt_io.load_weights(model, ckpt["model"], last_path)
    model.to(device).train()
    channels_last = _speed_options(cfg, model, device, use_features)
    generator = torch.Generator(device=device).manual_seed(rank_seed)  # MLM masks and hard-negative draws
    step_fn = TrainStep(model) if size == 1 else wrap_ddp(model, cfg.loss, device)
    batch_sampler = sampler
    if size > 1:
        _seed_everything(rank_seed, device)
        if sampler is not None:  # every rank draws the same global batches and reads its slice of each
            batch_sampler = RankSlice(sampler, rank, size)

    # --- optimiser
    params = [p for p in model.parameters() if p.requires_grad]
    # Biases, LayerNorm weights and the temperature (all < 2-D) are not decayed.
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    # The fused kernel: on a CPU the plain per-tensor loop was a third of a cached-features step (MiniLM's 11.7M
    # word-embedding weights are updated every step); fused took 0.016 s against 0.097 s for batch 32 here.
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  fused=device.type in ("cpu", "cuda"))

    # --- resume (the data position is replayed: this epoch's batches already trained on are drawn again)
    step, epoch, consumed, best = 0, 0, 0, -1.0
    curriculum_log, rows = [], []  # TOnICS: P_S at every held-out check; metrics.jsonl rows
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        step, epoch, consumed, best = ckpt["step"], ckpt["epoch"], ckpt["consumed"], ckpt["best"]
        rng = ckpt["rng"]
        if size > 1:  # each rank continues from its own RNG states and data position
            own = ckpt["ranks"][rank]
            rng, epoch, consumed = own["rng"], own["epoch"], own["consumed"]
        if sampler is not None:
            if ckpt.get("sampler") is None:
                raise TrainError(f"{last_path} holds no sampler state: it was not written by a {cfg.sampler.kind} run")
            sampler.load_state_dict(ckpt["sampler"])
            curriculum_log = ckpt.get("curriculum_log", [])
        if metrics_path.exists():  # drop rows logged after the checkpoint: they are redone
            rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if r["step"] <= step]
    batches, data_rng = epoch_batches(epoch, rank_seed, train_set, batch_sampler, collate, cfg.batch_size,
                                      cfg.data.workers, device)
    for _ in range(consumed):
        _, data_rng = _next_batch(batches, data_rng)
    if ckpt is not None:
        ckpt_io.set_rng_states(rng, generator)
        console.print(f"resumed from step {step} of {cfg.steps} ({last_path})", highlight=False)
    console.print(_summary(cfg, model, device, n_train, n_val, per_epoch, size), highlight=False, markup=False)

    # --- loop
    metrics_file = metrics_path.open("w") if rank == 0 else open(os.devnull, "w")
    metrics_file.writelines(json.dumps(r) + "\n" for r in rows)
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(out / "tb")) if rank == 0 else _NoBoard()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"),
                        TimeRemainingColumn(), console=console, disable=not console.is_terminal)
    task = progress.add_task("train", total=cfg.steps, completed=step, rate="")
    last_eval, losses_f = None, {}
    start_step, t_start = step, time.perf_counter()
    t0, seen, last_save = time.perf_counter(), 0, time.monotonic()
    report_every = max(1, cfg.steps // 10)  # without a terminal (no bar), a progress line every 10%

    stop = {"signal": None}
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        on_signal = functools.partial(_on_signal, stop)
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with progress:
            while step < cfg.steps:
                # --- the next batch. A fault here (a damaged shard, an empty epoch, too many undecodable
                # samples) is first shared with the other ranks, so that under torchrun every rank stops at
                # once instead of waiting in the next collective for the one that failed.
                fault, batch = None, None
                try:
                    while batch is None:
                        try:
                            batch, data_rng = _next_batch(batches, data_rng)
                        except StopIteration:
                            if consumed == 0:  # never loop forever on an epoch that yields nothing
                                raise TrainError(f"epoch {epoch} gave no batch of {cfg.batch_size} from {n_train} "
                                                 "training samples; lower --batch-size or data.workers") from None
                            _check_bad_samples(load_counts, final=True)
                            epoch, consumed = epoch + 1, 0
                            batches, data_rng = epoch_batches(epoch, rank_seed, train_set, batch_sampler, collate,
                                                              cfg.batch_size, cfg.data.workers, device)
                            continue
                        if batch is None:  # every sample of this batch was undecodable (counted)
                            consumed += 1
                    bad_samples = _check_bad_samples(load_counts)
                except TrainError as e:
                    fault = e
                except Exception as e:  # a loader worker's error (or the signal reaching a worker: see below)
                    fault = loader_error(e)
                # One all-reduce under torchrun (the identity in one process): every rank stops or saves together.
                failed, stopping, save_due = any_flags([fault is not None, stop["signal"] is not None,
                                                        time.monotonic() - last_save >= 60 * cfg.ckpt_minutes])
                if stopping:  # the batch just fetched is not counted: a resume draws it again
                    raise _interrupted(model, optimizer, cfg, step, epoch, consumed, best, sampler, curriculum_log,
                                       generator, data_sig, last_path)
                if failed:
                    kept = f"; the last checkpoint {last_path} is kept" if last_path.exists() else ""
                    raise fault or TrainError(f"stopped at step {step}: another process failed (its error is "
                                              f"printed above){kept}")
                consumed += 1
                step += 1
                lr = lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                batch = to_device(batch, device)
                if channels_last:
                    batch["images"] = batch["images"].contiguous(memory_format=torch.channels_last)
                alpha = distill_alpha_at(step, cfg)
                with autocast(device):
                    losses = step_fn(batch, cfg.loss, generator, tok, alpha, cfg.data.masked_text_all)
                queue_feats = losses.pop("queue_feats")
                losses_f = {k: float(v.detach()) for k, v in losses.items()}
                finite = math.isfinite(losses_f["total"])
                if any_flags([not finite])[0]:  # every rank stops at the same step
                    kept = f"; the last good checkpoint {last_path} is kept" if last_path.exists() else ""
                    where = "" if finite else " (" + ", ".join(f"{k}={v:.4g}" for k, v in losses_f.items()) + ")"
                    raise TrainError(f"non-finite loss at step {step}{where or ' on another rank'}{kept}")
                optimizer.zero_grad(set_to_none=True)
                losses["total"].backward()
                if cfg.optim.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
                optimizer.step()
                if model.momentum is not None:
                    model.momentum_update()
                if model.cfg.queue_size:
                    model.dequeue_and_enqueue(*queue_feats)
                if isinstance(sampler, GritSampler):  # phase 1: this step's ITC features, no extra forward pass
                    sampler.collect(gather(batch["index"], False)[1], *queue_feats)  # the global batch, rank order
                seen += global_batch

                # --- progress and logging
                done, elapsed = step - start_step, time.perf_counter() - t_start
                sec_per_step = elapsed / done
                if done == 10 and cfg.steps - step > 0:
                    _eta_note(done, elapsed, step, cfg, device, use_features)
                if step % cfg.log_every == 0 or step == cfg.steps:
                    rate = seen / max(time.perf_counter() - t0, 1e-9)
                    t0, seen = time.perf_counter(), 0
                    row = {"step": step, **losses_f, "lr": lr, "samples_per_s": round(rate, 2),
                           "bad_samples": bad_samples}
                    if cfg.loss.distill_alpha > 0:
                        row["distill_alpha"] = alpha
                    _log(row, rows, metrics_file)
                    for k, v in row.items():
                        if k != "step":
                            tb.add_scalar(f"train/{k}", v, step)
                progress.update(task, completed=step, rate=f"{sec_per_step:.2f} s/step", description=f"step {step} "
                                + " ".join(f"{k.removesuffix('_loss')} {v:.3f}" for k, v in losses_f.items())
                                + f" lr {lr:.2e}")
                if progress.disable and step % report_every == 0:
                    console.print(f"step {step}/{cfg.steps} loss {losses_f['total']:.3f}, {sec_per_step:.2f} s/step, "
                                  f"eta {_fmt_duration(sec_per_step * (cfg.steps - step))}", highlight=False)

                # --- curriculum (at the end of a period, so the refreshed P_S starts with the next period)
                if tonics and step % cfg.sampler.refresh_every == 0:
                    # Rank 0 checks and decides; the others follow its decision, so every curriculum stays the same.
                    row = (curriculum_check(model, sampler, data["val"], heldout, collate, cfg.batch_size,
                                            cfg.data.triplets, cfg.sampler.threshold, step, data["names"],
                                            curriculum_log, out, device) if rank == 0 else None)
                    row = broadcast(row)
                    if rank > 0:
                        curriculum_log.append(row)
                        if row["refreshed"]:
                            sampler.curriculum.refresh()
                    _log({"step": step, "curriculum": row}, rows, metrics_file)
                    tb.add_scalar("curriculum/p_entity", row["probs"][0], step)
                    tb.add_scalar("curriculum/heldout_r1", row["heldout_r1"], step)

                # --- eval
                if rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                    if cfg.data.triplets:
                        sim = (val_triplet_sim(model, data["val"], val_triplets, collate, cfg.batch_size, device)
                               if len(val_triplets) >= 2 else None)
                    else:
                        emb = embed_split(model, cfg.shards, "val", cfg.data.val_frac, cfg.data.max_len,
                                          cfg.batch_size, cfg.data.image_size, cfg.data.workers, device, use_features)
                        sim = emb["img"] @ emb["txt"].t() if emb["n"] >= 2 else None
                    last_eval = (heldout_recall(sim, "val triplets" if cfg.data.triplets else "val samples", step)
                                 if sim is not None else None)
                    if last_eval is not None:
                        for k, v in last_eval.items():
                            if isinstance(v, float):
                                tb.add_scalar(f"val/{k}", v, step)
                        _log({"step": step, "val": last_eval}, rows, metrics_file)
                        plot_learning_curve(rows, out / "learning_curve.png")
                        if last_eval["mean_recall"] > best:
                            best = last_eval["mean_recall"]
                            save_checkpoint(best_path, model, optimizer, cfg, step, epoch, consumed, best, sampler,
                                            curriculum_log, generator, data_sig, every_rank=False)

                # --- checkpoint
                if step % cfg.ckpt_every == 0 or step == cfg.steps or save_due:
                    save_checkpoint(last_path, model, optimizer, cfg, step, epoch, consumed, best, sampler,
                                    curriculum_log, generator, data_sig)
                    last_save = time.monotonic()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        metrics_file.close()
        tb.close()

    # --- end
    if not broadcast(last_path.exists()):  # resumed at or past the final step: still leave a checkpoint behind
        save_checkpoint(last_path, model, optimizer, cfg, step, epoch, consumed, best, sampler, curriculum_log,
                        generator, data_sig)
    if rank == 0:
        release_output(out)
    if created_group:
        torch.distributed.destroy_process_group()
    return {"step": step, "losses": losses_f, "eval": last_eval, "best_mean_recall": best if best >= 0 else None,
            "out": str(out), "rank": rank, "data": data_sig}

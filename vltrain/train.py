"""The training loop (`train`), one training step (`train_step`), the lr schedule and checkpoint evaluation."""

import contextlib
import copy
import functools
import json
import math
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.utils.data import DataLoader

from vltrain.config import Config, from_dict, grit_sizes, to_dict
from vltrain.data import (Collate, IndexedShards, InstanceView, ShardStream, count_split, eval_transform, in_val,
                          train_transform)
from vltrain.evaluate import chance_recall, itm_rerank, recall_at_k, rerank_recall, zeroshot_accuracy
from vltrain.losses import (distill_targets, focal_itc_loss, hard_negative_weights, itc_consistency_loss, itc_loss,
                            itm_loss, mlm_loss, mlm_mask, sample_hard_negatives, tonics_ir_loss, tonics_tr_loss)
from vltrain.model import build_model, build_tokenizer, noun_states
from vltrain.samplers import GritSampler, TonicsBatchSampler, TonicsCurriculum, tonics_instances

console = Console(stderr=True, emoji=False)
PROMPT = "a photo of a {}"
EVAL_TRIPLETS = 1000  # triplet mode: validation retrieval over at most this many triplets (one per image)


class TrainError(RuntimeError):
    """A run that cannot go on (non-finite loss, nothing to resume, too little data); the message is one line."""


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of the step-th optimiser step (1-based): linear warmup, then cosine to lr * min_lr_ratio."""
    o = cfg.optim
    if step <= o.warmup_steps:
        return o.lr * step / max(o.warmup_steps, 1)
    progress = min(1.0, (step - o.warmup_steps) / max(cfg.steps - o.warmup_steps, 1))
    low = o.lr * o.min_lr_ratio
    return low + (o.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


@functools.lru_cache(maxsize=4)
def _tokenizer(text_model: str):
    """The tokenizer for a text model name, loaded once per process."""
    from vltrain.model import ModelConfig

    return build_tokenizer(ModelConfig(text_model=text_model))


def _with_queue(keys: torch.Tensor, queue: torch.Tensor | None) -> torch.Tensor:
    """In-batch candidates (B, E) followed by queue columns (E, Q) -> (E, B+Q)."""
    return keys.t() if queue is None else torch.cat([keys.t(), queue.clone().detach().to(keys.dtype)], dim=1)


def train_step(model, batch: dict, cfg: Config, generator: torch.Generator, tokenizer=None) -> dict:
    """Forward pass and named losses (*_loss and the weighted `total`) for one batch; grads are left to the caller.

    The dict also holds `queue_feats`, the detached (image, text) features (B, E) x2 to enqueue after the step.
    """
    w = cfg.loss
    images = batch["features"] if "features" in batch else batch["images"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    image_tokens, image_feat = model.encode_image(images)
    text_hidden, text_feat = model.encode_text(ids, mask)
    temp = model.temperature()
    mom = model.momentum
    distill = w.distill_alpha > 0 and mom is not None
    queued = model.cfg.queue_size > 0
    img_q, txt_q = (model.image_queue, model.text_queue) if queued else (None, None)

    # ALBEF: with a momentum model the contrastive keys (in-batch and queued) are momentum features.
    with torch.no_grad():
        if mom is not None:
            image_tokens_m, image_feat_m = mom.encode_image(images)
            text_hidden_m, text_feat_m = mom.encode_text(ids, mask)
            image_keys, text_keys = image_feat_m, text_feat_m
    if mom is None:
        image_keys, text_keys = image_feat, text_feat
    image_all, text_all = _with_queue(image_keys, img_q), _with_queue(text_keys, txt_q)
    logits_i2t, logits_t2i = image_feat @ text_all / temp, text_feat @ image_all / temp  # (B, B+Q) x2

    losses = {}
    if w.itc > 0:
        if w.focal_gamma > 0:
            losses["itc_loss"] = focal_itc_loss(logits_i2t, logits_t2i, w.focal_gamma)
        elif distill:
            with torch.no_grad():
                targets_i2t = distill_targets(image_feat_m @ text_all / temp, w.distill_alpha)
                targets_t2i = distill_targets(text_feat_m @ image_all / temp, w.distill_alpha)
            losses["itc_loss"] = itc_loss(logits_i2t, logits_t2i, targets_i2t, targets_t2i)
        else:
            losses["itc_loss"] = itc_loss(logits_i2t, logits_t2i)
    if w.consistency > 0:
        losses["itc_consistency_loss"] = itc_consistency_loss(logits_i2t, logits_t2i)

    if w.itm > 0:
        b = ids.shape[0]
        w_i2t, w_t2i = hard_negative_weights(logits_i2t, logits_t2i)
        neg_text = sample_hard_negatives(w_i2t, generator)   # a hard negative caption for each image
        neg_image = sample_hard_negatives(w_t2i, generator)  # a hard negative image for each caption
        fused = model.fuse(torch.cat([text_hidden, text_hidden, text_hidden[neg_text]]),
                           torch.cat([mask, mask, mask[neg_text]]),
                           torch.cat([image_tokens, image_tokens[neg_image], image_tokens]))
        labels = torch.cat([torch.ones(b, dtype=torch.long), torch.zeros(2 * b, dtype=torch.long)]).to(ids.device)
        losses["itm_loss"] = itm_loss(model.itm_logits(fused), labels)

    if w.mlm > 0:
        tok = tokenizer or _tokenizer(model.cfg.text_model)
        masked, labels = mlm_mask(ids, w.mlm_prob, tok.all_special_ids, tok.mask_token_id,
                                  model.text_encoder.config.vocab_size, generator)
        hidden, _ = model.encode_text(masked, mask)
        logits = model.mlm_logits(model.fuse(hidden, mask, image_tokens))
        soft = None
        if distill:
            with torch.no_grad():
                hidden_m, _ = mom.encode_text(masked, mask)
                soft = mom.mlm_logits(mom.fuse(hidden_m, mask, image_tokens_m)).float().softmax(dim=-1)
        losses["mlm_loss"] = mlm_loss(logits, labels, soft, w.distill_alpha if distill else 0.0)

    if w.tonics_ir > 0 or w.tonics_tr > 0:
        # TOnICS aligner: s(i, j) for every noun i and image j; the sampler keeps one image out of a batch twice.
        scores = model.align_scores(noun_states(text_hidden, batch["noun_mask"]), image_tokens)
        if w.tonics_ir > 0:
            losses["tonics_ir_loss"] = tonics_ir_loss(scores)
        if w.tonics_tr > 0:
            losses["tonics_tr_loss"] = tonics_tr_loss(scores)

    weights = {"itc_loss": w.itc, "itc_consistency_loss": w.consistency, "itm_loss": w.itm, "mlm_loss": w.mlm,
               "tonics_ir_loss": w.tonics_ir, "tonics_tr_loss": w.tonics_tr}
    losses["total"] = sum(weights[k] * v for k, v in losses.items())
    losses["queue_feats"] = (image_keys.detach(), text_keys.detach())
    return losses


# --- helpers shared by the loop and `vltrain eval` ----------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _autocast(device: torch.device):
    """bf16 autocast on CUDA; full float32 elsewhere (CPU bf16 is slow and unhelpful for small models)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _save_atomic(obj: dict, path: Path) -> None:
    """torch.save to a temporary file, then rename: a crash never leaves a half-written checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def _embed(model, folders, split: str, val_frac: float, cfg: Config, device: torch.device,
           keep_inputs: bool = False) -> dict:
    """ITC embeddings of a split in shard order: img/txt (N, E), ids/mask (N, L), captions[, inputs (N, ...)]."""
    tok = _tokenizer(model.cfg.text_model)
    use_features = cfg.data.use_features
    tf = None if use_features else eval_transform(cfg.data.image_size, model.image_mean, model.image_std)
    stream = ShardStream(folders, split, val_frac, tf, shuffle=False, use_features=use_features)
    # Its own generator: evaluation must not draw from the global RNG, or a resumed run would diverge.
    loader = DataLoader(stream, batch_size=cfg.batch_size, collate_fn=Collate(tok, cfg.data.max_len, use_features),
                        num_workers=cfg.data.workers, generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    out = {"img": [], "txt": [], "ids": [], "mask": [], "captions": [], "inputs": []}
    for batch in loader:
        batch = _to(batch, device)
        x = batch["features"] if use_features else batch["images"]
        with _autocast(device):
            _, img = model.encode_image(x)
            _, txt = model.encode_text(batch["input_ids"], batch["attention_mask"])
        out["img"].append(img.float().cpu())
        out["txt"].append(txt.float().cpu())
        pad = cfg.data.max_len - batch["input_ids"].shape[1]
        out["ids"].append(torch.nn.functional.pad(batch["input_ids"].cpu(), (0, pad), value=tok.pad_token_id or 0))
        out["mask"].append(torch.nn.functional.pad(batch["attention_mask"].cpu(), (0, pad), value=0))
        out["captions"].extend(batch["captions"])
        if keep_inputs:  # only ITM re-ranking needs the pixels again
            out["inputs"].append(x.cpu())
    model.train(was_training)
    if not out["img"]:
        return {"n": 0}
    return {"n": sum(len(t) for t in out["img"]), "captions": out["captions"],
            **{k: torch.cat(v) for k, v in out.items() if k != "captions" and v}}


def _next_batch(batches, rng_state: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """next(batches) drawing augmentations from the data's own torch RNG state; returns (batch, new state)."""
    # With workers=0 the transforms run here and would share the global RNG with dropout, so a resumed run
    # replaying its epoch's first batches would crop differently. Workers have their own RNG already.
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        batch = next(batches)
        return batch, torch.get_rng_state()


# --- index-based sampling: TOnICS, GRIT and triplets (vltrain.samplers) ------------------------------------------


def _indexed_data(cfg: Config, model) -> dict:
    """Train / val views read through wids, the batch sampler over the train view and the curriculum's node names."""
    shards = IndexedShards(cfg.shards)
    is_val = np.array([in_val(k, cfg.data.val_frac) for k in shards.keys], dtype=bool)
    use_features, s, n = cfg.data.use_features, cfg.sampler, cfg.batch_size
    tf_train = None if use_features else train_transform(cfg.data.image_size, model.image_mean, model.image_std,
                                                         cfg.data.min_crop_scale)
    tf_eval = None if use_features else eval_transform(cfg.data.image_size, model.image_mean, model.image_std)
    names = None
    if s.kind == "grit":
        splits = {"train": {"samples": np.flatnonzero(~is_val), "spans": None},
                  "val": {"samples": np.flatnonzero(is_val), "spans": None}}
        m, q = grit_sizes(cfg)
        sampler = GritSampler(len(splits["train"]["samples"]), n, m, q, cfg.seed)
    else:  # tonics, or random batches of triplets (P(entity) stays 1)
        try:
            splits = tonics_instances(s.ontology or cfg.shards[0], shards.keys, is_val, cfg.data.triplets)
        except ValueError as e:
            raise TrainError(str(e)) from None
        image_of = splits["train"]["samples"]
        if len(np.unique(image_of)) < n:
            raise TrainError(f"the training split has {len(np.unique(image_of))} distinct images with "
                             f"{'triplets' if cfg.data.triplets else 'samples'}, fewer than one batch of {n}")
        keep, dropped = [], []
        for c, pos in splits["train"]["nodes"] if s.kind == "tonics" else []:
            (keep if len(np.unique(image_of[pos])) >= n else dropped).append((c, pos))
        if s.kind == "tonics" and not keep:
            raise TrainError(f"no ontology class has {n} distinct training images, so no same-object batch can be "
                             "drawn; lower --batch-size")
        if dropped:
            console.print(f"tonics: {len(dropped)} of {len(dropped) + len(keep)} classes have fewer than {n} distinct "
                          f"training images and stay out of the curriculum: {', '.join(c for c, _ in dropped)}",
                          highlight=False)
        curriculum = TonicsCurriculum([len(p) for _, p in keep] or [1], s.alpha, s.beta)
        nodes = [p for _, p in keep] or [np.arange(len(image_of))]  # random triplets: a never-drawn dummy node
        sampler = TonicsBatchSampler(curriculum, nodes, image_of, n, s.refresh_every, cfg.seed)
        names = ["entity"] + [c for c, _ in keep]
    views = {split: InstanceView(shards, splits[split]["samples"], tf_train if split == "train" else tf_eval,
                                 use_features, splits[split]["spans"]) for split in ("train", "val")}
    return {"sampler": sampler, "names": names, **views}


def _distinct_positions(view: InstanceView, limit: int, seed: int) -> np.ndarray:
    """Up to `limit` positions of a view in a seeded random order, one per image (retrieval needs one positive)."""
    order = np.random.default_rng([seed, 99]).permutation(len(view))
    _, first = np.unique(view.samples[order], return_index=True)
    return order[np.sort(first)][:limit]


@torch.no_grad()
def _view_scores(model, view: InstanceView, positions, collate: Collate, cfg: Config, device) -> torch.Tensor:
    """Scores (n, n) of query text i against image j: the aligner's s(i, j) in triplet mode, ITC similarity otherwise."""
    was_training = model.training
    model.eval()
    nouns, tokens, txt, img = [], [], [], []
    bs = cfg.batch_size
    for a in range(0, len(positions), bs):
        batch = _to(collate([view[int(p)] for p in positions[a:a + bs]]), device)
        with _autocast(device):
            tok, i_feat = model.encode_image(batch["features"] if cfg.data.use_features else batch["images"])
            hidden, t_feat = model.encode_text(batch["input_ids"], batch["attention_mask"])
        if cfg.data.triplets:
            nouns.append(noun_states(hidden, batch["noun_mask"]).float())
            tokens.append(tok.float())
        else:
            txt.append(t_feat.float())
            img.append(i_feat.float())
    if cfg.data.triplets:
        nouns, tokens = torch.cat(nouns), torch.cat(tokens)
        scores = torch.cat([model.align_scores(nouns[a:a + bs], tokens) for a in range(0, len(nouns), bs)])
    else:
        scores = torch.cat(txt) @ torch.cat(img).t()
    model.train(was_training)
    return scores.float().cpu()


def _plot_curriculum(log: list[dict], names: list[str], path: Path, top: int = 8) -> None:
    """P(entity) and the `top` object nodes with the most final mass across steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [0] + [r["step"] for r in log]  # the curriculum starts with P(entity) = 1
    probs = np.array([np.eye(len(names))[0]] + [r["probs"] for r in log])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, probs[:, 0], color="black", lw=2, marker=".", label="entity")
    for k in (np.argsort(-probs[-1, 1:])[:top] + 1):
        ax.plot(steps, probs[:, k], label=names[k])
    ax.set(xlabel="step", ylabel="P_S(node)", ylim=(0, 1.02), title="TOnICS curriculum")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the loop -----------------------------------------------------------------------------------------------------


def train(cfg: Config, resume: bool = False) -> dict:
    """Train as cfg says, writing OUT/{metrics.jsonl, tb/, last.pt, best.pt}; returns the final metrics."""
    # --- setup
    cfg = copy.deepcopy(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    last_path, best_path = out / "last.pt", out / "best.pt"
    ckpt = None
    if resume:
        if not last_path.exists():
            raise TrainError(f"--resume: no checkpoint at {last_path}")
        ckpt = torch.load(last_path, map_location="cpu", weights_only=False)

    # --- data
    tok = _tokenizer(cfg.model.text_model)
    model = build_model(cfg.model)
    use_features = cfg.data.use_features
    collate = Collate(tok, cfg.data.max_len, use_features)
    indexed = cfg.sampler.kind != "random" or cfg.data.triplets
    if indexed:  # TOnICS / GRIT / triplets: positions from a batch sampler, samples read through wids
        data = _indexed_data(cfg, model)
        sampler, n_train = data["sampler"], len(data["train"])
    else:
        n_train = count_split(cfg.shards, cfg.data.val_frac)["train"]
        tf = None if use_features else train_transform(cfg.data.image_size, model.image_mean, model.image_std,
                                                       cfg.data.min_crop_scale)
        stream = ShardStream(cfg.shards, "train", cfg.data.val_frac, tf, seed=cfg.seed, use_features=use_features)
        sampler = None
    if n_train < cfg.batch_size:
        raise TrainError(f"the training split has {n_train} {'triplets' if cfg.data.triplets else 'samples'}, fewer "
                         f"than one batch of {cfg.batch_size}; lower --batch-size or data.val_frac")
    per_epoch = n_train // cfg.batch_size  # drop_last: every batch is full (hard negatives need B >= 2)
    if cfg.epochs > 0:
        cfg.steps = max(1, math.ceil(cfg.epochs * per_epoch))
    tonics = isinstance(sampler, TonicsBatchSampler) and cfg.sampler.kind == "tonics"

    def epoch_batches(epoch: int):
        """(batch iterator, data RNG state) at the start of an epoch; both depend only on (seed, epoch)."""
        # A generator per epoch fixes the workers' seeds, so a resumed epoch replays the same augmentations.
        # Index samplers: an epoch is a GRIT pass over the data or a TOnICS curriculum period.
        seed = cfg.seed * 100_003 + epoch
        common = dict(collate_fn=collate, num_workers=cfg.data.workers, pin_memory=device.type == "cuda",
                      generator=torch.Generator().manual_seed(seed))
        if sampler is not None:
            sampler.set_epoch(epoch)
            loader = DataLoader(data["train"], batch_sampler=sampler, **common)
        else:
            stream.set_epoch(epoch)
            loader = DataLoader(stream, batch_size=cfg.batch_size, drop_last=True, **common)
        return iter(loader), torch.Generator().manual_seed(seed + 1).get_state()

    # --- model
    model.to(device).train()
    generator = torch.Generator(device=device).manual_seed(cfg.seed)  # MLM masks and hard-negative draws

    # --- optimiser
    params = [p for p in model.parameters() if p.requires_grad]
    # Biases, LayerNorm weights and the temperature (all < 2-D) are not decayed.
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))

    step, epoch, consumed, best = 0, 0, 0, -1.0
    curriculum_log = []  # TOnICS: P_S at every held-out check
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, epoch, consumed, best = ckpt["step"], ckpt["epoch"], ckpt["consumed"], ckpt["best"]
        if sampler is not None:
            if ckpt.get("sampler") is None:
                raise TrainError(f"{last_path} holds no sampler state: it was not written by a {cfg.sampler.kind} run")
            sampler.load_state_dict(ckpt["sampler"])
            curriculum_log = ckpt.get("curriculum_log", [])
    batches, data_rng = epoch_batches(epoch)
    for _ in range(consumed):  # the exact data position: replay this epoch's batches already trained on
        _, data_rng = _next_batch(batches, data_rng)
    if ckpt is not None:
        rng = ckpt["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        generator.set_state(rng["generator"])

    def checkpoint() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
                "consumed": consumed, "best": best, "config": to_dict(cfg),
                "sampler": sampler.state_dict() if sampler is not None else None, "curriculum_log": curriculum_log,
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "generator": generator.get_state()}}

    heldout = (_distinct_positions(data["val"], cfg.sampler.heldout, cfg.seed) if tonics else None)
    if tonics and len(heldout) < 2:
        raise TrainError(f"the TOnICS refresh check needs held-out instances and the validation split has "
                         f"{len(heldout)}; raise data.val_frac")
    val_triplets = _distinct_positions(data["val"], EVAL_TRIPLETS, cfg.seed) if cfg.data.triplets else None

    def evaluate() -> dict | None:
        if cfg.data.triplets:  # the aligner's own task: noun i of a held-out triplet against image j
            if len(val_triplets) < 2:
                return None
            sim = _view_scores(model, data["val"], val_triplets, collate, cfg, device).t()
            what = "val triplets"
        else:
            emb = _embed(model, cfg.shards, "val", cfg.data.val_frac, cfg, device)
            if emb["n"] < 2:
                return None
            sim, what = emb["img"] @ emb["txt"].t(), "val samples"
        n = sim.shape[0]
        res = recall_at_k(sim, torch.arange(n))
        chance = chance_recall(n, n)
        console.print(f"step {step} eval on {n} {what}: mean recall {res['mean_recall']:.2f} | "
                      + ", ".join(f"{k} {res[k]:.1f} (chance {chance[k]:.1f})" for k in chance), highlight=False)
        return {**res, "n_val": n, "chance": chance}

    def curriculum_check() -> dict:
        """TOnICS: held-out image retrieval R@1, and a curriculum refresh when it reaches the threshold."""
        scores = _view_scores(model, data["val"], heldout, collate, cfg, device)
        acc = float((scores.argmax(dim=1) == torch.arange(len(heldout))).float().mean())
        refreshed = acc >= cfg.sampler.threshold
        if refreshed:
            sampler.curriculum.refresh()
        row = {"step": step, "heldout_r1": round(acc, 4), "refreshed": refreshed,
               "probs": [round(float(p), 6) for p in sampler.curriculum.probs]}
        curriculum_log.append(row)
        (out / "curriculum.json").write_text(json.dumps({"nodes": data["names"], "log": curriculum_log}))
        _plot_curriculum(curriculum_log, data["names"], out / "curriculum.png")
        console.print(f"step {step} tonics check: held-out R@1 {acc:.2f} on {len(heldout)} "
                      f"{'refresh' if refreshed else 'no refresh'} (threshold {cfg.sampler.threshold}), "
                      f"P(entity) {sampler.curriculum.probs[0]:.3f}", highlight=False)
        return row

    # --- loop
    metrics_path = out / "metrics.jsonl"
    kept_rows = []
    if ckpt is not None and metrics_path.exists():  # drop rows logged after the checkpoint: they are redone
        kept_rows = [line for line in metrics_path.read_text().splitlines()
                     if line.strip() and json.loads(line)["step"] <= step]
    metrics_file = metrics_path.open("w")
    metrics_file.writelines(line + "\n" for line in kept_rows)
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(out / "tb"))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=not console.is_terminal)
    task = progress.add_task("train", total=cfg.steps, completed=step)
    last_eval, losses_f = None, {}
    t0, seen = time.perf_counter(), 0
    try:
        with progress:
            while step < cfg.steps:
                try:
                    batch, data_rng = _next_batch(batches, data_rng)
                except StopIteration:
                    epoch, consumed = epoch + 1, 0
                    batches, data_rng = epoch_batches(epoch)
                    continue
                consumed += 1
                step += 1
                lr = lr_at(step, cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                batch = _to(batch, device)
                with _autocast(device):
                    losses = train_step(model, batch, cfg, generator, tok)
                queue_feats = losses.pop("queue_feats")
                losses_f = {k: float(v.detach()) for k, v in losses.items()}
                if not math.isfinite(losses_f["total"]):
                    kept = f"; the last good checkpoint {last_path} is kept" if last_path.exists() else ""
                    raise TrainError(f"non-finite loss at step {step} ("
                                     + ", ".join(f"{k}={v:.4g}" for k, v in losses_f.items()) + f"){kept}")
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
                    sampler.collect(batch["index"], *queue_feats)
                seen += cfg.batch_size

                if step % cfg.log_every == 0 or step == cfg.steps:
                    rate = seen / max(time.perf_counter() - t0, 1e-9)
                    t0, seen = time.perf_counter(), 0
                    row = {"step": step, **losses_f, "lr": lr, "samples_per_s": round(rate, 2)}
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                    for k, v in row.items():
                        if k != "step":
                            tb.add_scalar(f"train/{k}", v, step)
                progress.update(task, completed=step, description=f"step {step} " + " ".join(
                    f"{k.removesuffix('_loss')} {v:.3f}" for k, v in losses_f.items()) + f" lr {lr:.2e}")

                # --- curriculum (at the end of a period, so the refreshed P_S starts with the next period)
                if tonics and step % cfg.sampler.refresh_every == 0:
                    row = curriculum_check()
                    metrics_file.write(json.dumps({"step": step, "curriculum": row}) + "\n")
                    metrics_file.flush()
                    tb.add_scalar("curriculum/p_entity", row["probs"][0], step)
                    tb.add_scalar("curriculum/heldout_r1", row["heldout_r1"], step)

                # --- eval
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    last_eval = evaluate()
                    if last_eval is not None:
                        for k, v in last_eval.items():
                            if isinstance(v, float):
                                tb.add_scalar(f"val/{k}", v, step)
                        metrics_file.write(json.dumps({"step": step, "val": last_eval}) + "\n")
                        metrics_file.flush()
                        if last_eval["mean_recall"] > best:
                            best = last_eval["mean_recall"]
                            _save_atomic(checkpoint(), best_path)

                # --- checkpoint
                if step % cfg.ckpt_every == 0 or step == cfg.steps:
                    _save_atomic(checkpoint(), last_path)
    finally:
        metrics_file.close()
        tb.close()
    if not last_path.exists():  # resumed at or past the final step: still leave a checkpoint behind
        _save_atomic(checkpoint(), last_path)
    return {"step": step, "losses": losses_f, "eval": last_eval, "best_mean_recall": best if best >= 0 else None,
            "out": str(out)}


# --- `vltrain eval` -----------------------------------------------------------------------------------------------


def _class_label(caption: str, patterns: list[re.Pattern]) -> int | None:
    """Index of the longest class name found as whole words in the caption (case-insensitive), else None."""
    hits = [(len(p.pattern), i) for i, p in enumerate(patterns) if p.search(caption)]
    return max(hits)[1] if hits else None


@torch.no_grad()
def evaluate_checkpoint(path, shards, zeroshot=None, itm_rerank_k: int = 0, device: str = "auto") -> dict:
    """Retrieval R@1/5/10 over ALL samples of `shards` (optionally ITM re-ranked over the ITC top-k) and zero-shot.

    Zero-shot reads class names from a file (one per line) and scores "a photo of a {name}". A sample's true
    label is the class whose name appears as whole words in its caption (the longest such name when several
    do); samples whose caption names no class are skipped and counted in `zeroshot.skipped`.
    """
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"checkpoint not found: {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    cfg = from_dict(ckpt["config"])
    dev = _device(device)
    model = build_model(cfg.model)
    model.load_state_dict(ckpt["model"])
    model.to(dev).eval()
    if cfg.data.triplets:
        return _evaluate_triplets(model, cfg, [str(s) for s in shards], dev, path, ckpt.get("step"),
                                  zeroshot is not None or itm_rerank_k > 0)
    # val_frac 0 puts every sample in the "train" split: `vltrain eval` scores all samples of SHARDS.
    emb = _embed(model, [str(s) for s in shards], "train", 0.0, cfg, dev, keep_inputs=itm_rerank_k > 0)
    n = emb["n"]
    if n < 2:
        raise TrainError(f"evaluation needs at least 2 samples, found {n} in {', '.join(map(str, shards))}")
    sim = emb["img"] @ emb["txt"].t()
    txt2img = torch.arange(n)
    result = {"checkpoint": str(path), "step": ckpt.get("step"), "n_samples": n,
              "retrieval": recall_at_k(sim, txt2img), "chance": chance_recall(n, n)}

    if itm_rerank_k > 0:
        if model.fusion is None:
            raise TrainError("--itm-rerank-k needs a model with a fusion encoder (this one has fusion_layers=0)")

        def itm_score(img_idx: torch.Tensor, txt_idx: torch.Tensor) -> torch.Tensor:
            x, ids, mask = (emb["inputs"][img_idx].to(dev), emb["ids"][txt_idx].to(dev),
                            emb["mask"][txt_idx].to(dev))
            with _autocast(dev):
                tokens, _ = model.encode_image(x)
                hidden, _ = model.encode_text(ids, mask)
                return model.itm_logits(model.fuse(hidden, mask, tokens))[:, 1].float().cpu()

        result["itm_rerank"] = {"k": itm_rerank_k, **rerank_recall(*itm_rerank(sim, itm_rerank_k, itm_score), txt2img)}

    if zeroshot is not None:
        zpath = Path(zeroshot)
        if not zpath.is_file():
            raise TrainError(f"class file not found: {zpath}")
        names = [line.strip() for line in zpath.read_text().splitlines() if line.strip()]
        if not names:
            raise TrainError(f"{zpath}: no class names (one per line)")
        patterns = [re.compile(r"\b" + re.escape(c.lower()) + r"\b") for c in names]
        labels = [_class_label(c.lower(), patterns) for c in emb["captions"]]
        keep = [i for i, y in enumerate(labels) if y is not None]
        tok = _tokenizer(cfg.model.text_model)
        enc = tok([PROMPT.format(c) for c in names], padding="longest", truncation=True, max_length=cfg.data.max_len,
                  return_tensors="pt")
        with _autocast(dev):
            _, class_emb = model.encode_text(enc["input_ids"].to(dev), enc["attention_mask"].to(dev))
        zs = {"classes": len(names), "samples": len(keep), "skipped": n - len(keep), "prompt": PROMPT}
        if keep:
            zs.update(zeroshot_accuracy(emb["img"][keep], class_emb.float().cpu(),
                                        torch.tensor([labels[i] for i in keep])))
        result["zeroshot"] = zs
    return result


def _evaluate_triplets(model, cfg: Config, shards: list[str], dev, path: Path, step, extra: bool) -> dict:
    """A TOnICS aligner checkpoint: noun-to-image retrieval over the triplets of SHARDS (one per image)."""
    if extra:
        raise TrainError("--zeroshot and --itm-rerank-k need ITC / ITM heads; this is a TOnICS aligner checkpoint")
    data = IndexedShards(shards)
    try:
        inst = tonics_instances(shards[0], data.keys, np.zeros(len(data), dtype=bool), triplets=True)["train"]
    except ValueError as e:
        raise TrainError(f"a TOnICS aligner checkpoint is scored on triplets: {e}") from None
    tf = None if cfg.data.use_features else eval_transform(cfg.data.image_size, model.image_mean, model.image_std)
    view = InstanceView(data, inst["samples"], tf, cfg.data.use_features, inst["spans"])
    positions = _distinct_positions(view, len(view), cfg.seed)
    n = len(positions)
    if n < 2:
        raise TrainError(f"evaluation needs at least 2 triplets of distinct images, found {n}")
    collate = Collate(_tokenizer(cfg.model.text_model), cfg.data.max_len, cfg.data.use_features)
    sim = _view_scores(model, view, positions, collate, cfg, dev).t()  # (image, noun)
    return {"checkpoint": str(path), "step": step, "n_samples": n, "task": "noun-image retrieval, one triplet per image",
            "retrieval": recall_at_k(sim, torch.arange(n)), "chance": chance_recall(n, n)}

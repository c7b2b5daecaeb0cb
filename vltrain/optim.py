"""The optimiser the trainer and the benchmarks share: AdamW over two weight-decay groups, the lr schedule, and
one optimiser step with what follows it (ALBEF's momentum update and queue)."""

import math

import torch


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate of the step-th optimiser step (1-based): linear warmup, then cosine to lr * min_ratio."""
    if step <= warmup:
        return lr * step / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    low = lr * min_ratio
    return low + (lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model, optim, device: torch.device) -> tuple[torch.optim.AdamW, list]:
    """(AdamW, the trained parameters) for `optim` (an OptimConfig): biases, LayerNorm weights and the temperature
    (all < 2-D) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    # The fused kernel: on a CPU the plain per-tensor loop was a third of a cached-features step (MiniLM's 11.7M
    # word-embedding weights are updated every step); fused took 0.016 s against 0.097 s for batch 32 here.
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), fused=device.type in ("cpu", "cuda"))
    return optimizer, params


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def optimizer_step(model, optimizer: torch.optim.Optimizer, params: list, loss: torch.Tensor, grad_clip: float,
                   enqueue: tuple | None = None, scaler=None) -> bool:
    """Backward of `loss` (scaled by `scaler`, a torch.amp.GradScaler, when given), then `apply_gradients`."""
    optimizer.zero_grad(set_to_none=True)
    (loss if scaler is None else scaler.scale(loss)).backward()
    return apply_gradients(model, optimizer, params, grad_clip, enqueue, scaler)


def apply_gradients(model, optimizer: torch.optim.Optimizer, params: list, grad_clip: float,
                    enqueue: tuple | None = None, scaler=None) -> bool:
    """Clip the gradients the parameters hold to grad_clip (0 = no clipping), step; then the momentum model's EMA
    update and the queue's enqueue of `enqueue` (the step's detached image and text keys), for a model that has
    them. With `scaler` (a torch.amp.GradScaler: the gradients are scaled) the gradients are unscaled before the
    clip, and a step whose gradients hold an inf or NaN is skipped whole: no update, no EMA, no enqueue, and the
    scale backs off. True when the optimiser stepped."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients; records whether any is inf / NaN
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if scaler is None:
        optimizer.step()
    elif not scaler_step(scaler, optimizer):
        return False
    if model.momentum is not None:
        model.momentum_update()
    if model.cfg.queue_size and enqueue is not None:
        model.dequeue_and_enqueue(*enqueue)
    return True


def scaler_step(scaler, optimizer: torch.optim.Optimizer) -> bool:
    """`scaler.step` then `scaler.update`; False when the scaler skipped the step for inf / NaN gradients."""
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    # update() lowers the scale (backoff_factor < 1) exactly when it found inf / NaN gradients and skipped the step;
    # otherwise it keeps the scale or raises it
    return scaler.get_scale() >= before

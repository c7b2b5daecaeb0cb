"""Exact gradient accumulation (train.accum_steps = K): the towers run on B/K rows at a time, every loss on all B.

GradCache's three phases, around the ordinary `train_step`:
1. `train_step` on the whole batch with the model's tower calls (`encode_image`, `encode_text`) intercepted: each
   runs without gradient in K chunks of B/K rows (the RNG state before each chunk recorded) and returns the
   concatenated outputs as fresh leaves. Everything after the towers (ITC against the whole batch and the queue, hard
   negatives, fusion, MLM, soft ITM, the aligner) runs at full batch, with the generator drawn as K = 1 draws it.
2. Backward of the total loss: the heads get their gradients once, the leaves d(loss)/d(tower output).
3. Each chunk again with gradient, its RNG state restored (dropout draws the same masks), backpropagating its rows of
   the leaves' gradients into the tower parameters.
The losses and gradients are those of one batch of B; the towers' activations are held for B/K rows at a time.
"""

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from vltrain.optim import apply_gradients
from vltrain.step import train_step

TOWERS = ("encode_image", "encode_text")


@dataclass
class TowerCall:
    """One intercepted tower call: the real method, its full-batch arguments, each chunk's rows and RNG state, and
    the leaves it returned."""

    fn: object
    args: tuple
    chunks: list = field(default_factory=list)  # (slice of rows, RNG state before the chunk)
    leaves: tuple = ()


def rng_state(device: torch.device) -> tuple:
    """The global RNG state dropout draws from: the CPU's, and the device's on CUDA."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _rows(args: tuple, rows: slice) -> tuple:
    """The tensor and list arguments (the captions' host lengths) cut to `rows` (along dim 0); anything else as it
    is."""
    return tuple(a[rows] if isinstance(a, (torch.Tensor, list)) else a for a in args)


def _chunks(n: int, k: int) -> list[slice]:
    """n rows cut into k contiguous slices (sizes differ by at most one)."""
    bounds = [i * n // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _chunked(real, k: int, calls: list, *args):
    """`real` (a tower method) in k chunks without gradient, recorded in `calls`; its outputs as leaves. A call made
    without gradient (the momentum model's) is only chunked: there is nothing to replay."""
    n = args[0].shape[0]
    if not torch.is_grad_enabled():
        parts = [real(*_rows(args, rows)) for rows in _chunks(n, k)]
        return tuple(torch.cat(p) for p in zip(*parts))
    call = TowerCall(real, args)
    parts = []
    with torch.no_grad():
        for rows in _chunks(n, k):
            call.chunks.append((rows, rng_state(args[0].device)))
            parts.append(real(*_rows(args, rows)))
    call.leaves = tuple(torch.cat(p).requires_grad_(True) for p in zip(*parts))
    calls.append(call)
    return call.leaves


@contextlib.contextmanager
def chunked_towers(model, k: int, calls: list):
    """The tower methods of the model and of its momentum copy replaced (on the instances) by chunked, recorded,
    no-grad ones; restored after."""
    models = [model] if getattr(model, "momentum", None) is None else [model, model.momentum]
    saved = [{name: m.__dict__.get(name) for name in TOWERS} for m in models]
    for m in models:
        for name in TOWERS:
            m.__dict__[name] = functools.partial(_chunked, getattr(m, name), k, calls)
    try:
        yield
    finally:
        for m, before in zip(models, saved):
            for name in TOWERS:
                if before[name] is None:
                    del m.__dict__[name]
                else:
                    m.__dict__[name] = before[name]


def replay(calls: list, device: torch.device, amp: tuple) -> None:
    """Phase 3: every recorded chunk recomputed with gradient under its recorded RNG state and autocast (`amp`, as
    `autocast_state` gives), backpropagating its rows of the leaves' gradients into the towers."""
    for call in calls:
        grads = [leaf.grad for leaf in call.leaves]
        if all(g is None for g in grads):  # the losses read none of this call's outputs
            continue
        for rows, state in call.chunks:
            set_rng_state(state, device)
            with torch.autocast(device.type, dtype=amp[1], enabled=amp[0]):
                outs = call.fn(*_rows(call.args, rows))
            pairs = [(o, g[rows]) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def autocast_state(device: torch.device) -> tuple:
    """(enabled, dtype) of the autocast in force for `device` now."""
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


@contextlib.contextmanager
def kept_batchnorm_stats(model):
    """BatchNorm running statistics as they were before the block: the recompute must not count a batch twice."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats and m.training]
    saved = [{k: v.clone() for k, v in m.named_buffers(recurse=False) if v is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bufs in zip(norms, saved):
                for k, v in bufs.items():
                    getattr(m, k).copy_(v)


class AccumStep:
    """train_step with the towers on K chunks (call it as TrainStep), then `optimizer_step` for its backward.

    `ddp`: under torchrun, the DistributedDataParallel wrapper (`wrap_ddp`); the steps run on the inner model and
    the gradients are averaged over the ranks once per optimiser step, as DDP would."""

    def __init__(self, model, k: int, ddp=None):
        self.model = model
        self.k = k
        self.ddp = ddp
        self.calls = []
        self.after = None  # (RNG state after phase 1, autocast state, device)

    def __call__(self, batch: dict, w, generator: torch.Generator, tokenizer=None, alpha: float | None = None) -> dict:
        """Phase 1: the step's losses over the whole batch, the towers' outputs as leaves."""
        if self.ddp is not None:
            _broadcast_buffers(self.model)
        ids = batch["input_ids"]
        self.calls = []
        with chunked_towers(self.model, self.k, self.calls):
            losses = train_step(self.model, batch, w, generator, tokenizer, alpha)
        self.after = (rng_state(ids.device), autocast_state(ids.device), ids.device)
        return losses

    def optimizer_step(self, model, optimizer: torch.optim.Optimizer, params: list, loss: torch.Tensor,
                       grad_clip: float, enqueue: tuple | None = None, scaler=None) -> bool:
        """Phases 2 and 3 for the loss phase 1 returned, the ranks' gradients averaged, then `apply_gradients`."""
        state, amp, device = self.after
        optimizer.zero_grad(set_to_none=True)
        (loss if scaler is None else scaler.scale(loss)).backward()
        with kept_batchnorm_stats(self.model):
            replay(self.calls, device, amp)
        set_rng_state(state, device)  # the replay rewound it; the next step draws on from where phase 1 ended
        self.calls = []
        if self.ddp is not None:
            _average_gradients(params)
        return apply_gradients(model, optimizer, params, grad_clip, enqueue, scaler)


def accumulated_step(model, batch: dict, w, generator: torch.Generator, tokenizer, alpha: float | None, k: int,
                     optimizer, params: list, grad_clip: float, scaler=None) -> dict:
    """One whole optimiser step with K = k in one process: train_step's dict (losses detached) and `stepped`."""
    step = AccumStep(model, k)
    losses = step(batch, w, generator, tokenizer, alpha)
    enqueue = losses.pop("queue_feats")
    stepped = step.optimizer_step(model, optimizer, params, losses["total"], grad_clip, enqueue, scaler)
    return {**{key: v.detach() for key, v in losses.items()}, "queue_feats": enqueue, "stepped": stepped}


def _broadcast_buffers(model) -> None:
    """Rank 0's buffers to every rank, as DDP does before each forward."""
    for b in model.buffers():
        torch.distributed.broadcast(b, 0)


def _average_gradients(params: list) -> None:
    """Every gradient averaged over the ranks (a parameter no loss reached keeps None, on every rank alike)."""
    size = torch.distributed.get_world_size()
    for p in params:
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(size)

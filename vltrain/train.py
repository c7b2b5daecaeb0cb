"""`train`: setup -> loop -> end, and the signal handler.

The pieces live in their own modules: the set-up in vltrain.session (the training data in vltrain.trainset, the
resolved config in vltrain.resolve), the batches in vltrain.data.feed, one step's losses in vltrain.step (the
objectives in vltrain.objectives), the optimiser in vltrain.optim, checkpoints and resume in vltrain.resume, the
held-out checks in vltrain.heldout, and what the run tells the user in vltrain.runlog.
"""

import contextlib
import functools
import math
import signal
import threading
import time

import torch

from vltrain.data.feed import Feed, StopFetch
from vltrain.resume import Run, RunState, interrupted, save_checkpoint
from vltrain.heldout import curriculum_check, evaluate_heldout
from vltrain.data.collate import to_device
from vltrain.distributed import any_flags, broadcast, gather, max_over_ranks
from vltrain.errors import PeerFailed, TrainError
from vltrain.model import autocast, host_ends
from vltrain.optim import lr_at, optimizer_step, set_lr
from vltrain.runlog import RunLog
from vltrain.samplers import GritSampler
from vltrain.session import Session, setup
from vltrain.step import distill_alpha_at


def train(cfg, resume: bool = False, overwrite: bool = False, init_from=None, quiet: bool = False,
          batches=None, note: str | None = None) -> dict:
    """Train as cfg says, writing OUT/{metrics.jsonl, tb/, last.pt, best.pt}; returns the final metrics.

    Refuses an OUT holding another run unless `resume` (continue from OUT/last.pt) or `overwrite` (start over).
    `init_from` (a checkpoint or an export folder) starts a new run from its weights only: fresh optimiser, schedule
    and step 0, the architecture from cfg (vltrain.init_from.init_weights); a resume of it re-loads nothing.
    `quiet` and `batches` go to `setup`; `note`, a line said once the run is set up (before its first step).
    Ctrl-C / SIGTERM finish the current step, write last.pt and raise `vltrain.resume.Interrupted`.
    """
    s = setup(cfg, resume, overwrite, init_from, quiet, batches)
    if note:
        s.console.print(note, highlight=False, markup=False)
    with s.open_report() as report, _running(s.run, s.feed, s.console):
        loop(s, report)
    return end(s, report)


def loop(s: Session, report: RunLog) -> None:
    """Steps until s.cfg.steps, with checkpoints, evaluations and TOnICS checks on their schedules."""
    cfg = s.cfg
    run = s.run
    state = s.state
    data = s.data
    last_save = time.monotonic()
    start = state.step
    in_a_row = 0  # fp16 steps skipped for inf / NaN gradients since the last applied one
    update = optimizer_step if cfg.train.accum_steps == 1 else s.step_fn.optimizer_step  # AccumStep's phases 2, 3
    while state.step < cfg.steps:
        batch, fault = s.feed.next(state)
        # One all-reduce under torchrun (the identity in one process): every rank stops or saves together.
        failed, stopping, save_due = any_flags([fault is not None, run.stop_signal is not None,
                                                time.monotonic() - last_save >= 60 * cfg.ckpt_minutes])
        if stopping:  # the batch just fetched is not counted: a resume draws it again
            _flush(report, run)  # before the checkpoint interrupted() saves
            raise interrupted(run, state)
        if failed:
            kept = f"; the last checkpoint {run.last_path} is kept" if run.last_path.exists() else ""
            raise fault or PeerFailed(f"stopped at step {state.step}: another process failed (its error is "
                                      f"printed above){kept}")
        state.consumed += 1
        state.step += 1
        lr = lr_at(state.step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
        alpha = distill_alpha_at(state.step, cfg)
        set_lr(s.optimizer, lr)
        if "attention_mask" in batch:  # the captions' lengths from the host's copy: no read back from the device
            batch["text_ends"] = host_ends(batch["attention_mask"])
        batch = to_device(batch, s.device)
        if s.channels_last:
            batch["images"] = batch["images"].contiguous(memory_format=torch.channels_last)
        with autocast(s.device, s.precision):
            losses = s.step_fn(batch, cfg.loss, s.generator, data.tokenizer, alpha)
        queue_feats = losses.pop("queue_feats")
        if s.scaler is not None:  # fp16 (CUDA only): the check at once, see _finite
            _finite(losses, state.step, run)
        stepped = update(s.model, s.optimizer, s.params, losses["total"], cfg.optim.grad_clip, queue_feats, s.scaler)
        if isinstance(data.sampler, GritSampler):  # phase 1: this step's ITC features, no extra forward pass
            data.sampler.collect(gather(batch["index"], False)[1], *queue_feats)  # the global batch, rank order
        # DDP: every rank unscales the same all-reduced gradients, so every rank skips the same steps
        if not stepped:  # the batch stays consumed, the step is taken again from the next batch
            in_a_row = _skipped(state, in_a_row + 1)
            continue
        in_a_row = 0
        io = {**(s.feed.io() or {}), **({"skipped_steps": state.skipped} if s.scaler is not None else {})}
        report.step(state.step, losses, lr, alpha, s.feed.bad, cfg.batch_size * s.size, io or None)
        # TOnICS at the end of a period, so that a refreshed P_S starts with the next period
        curriculum = data.heldout is not None and state.step % cfg.sampler.refresh_every == 0
        saved = state.step % cfg.ckpt_every == 0 or state.step == cfg.steps or save_due
        evaluating = state.step % cfg.eval_every == 0 or state.step == cfg.steps
        if curriculum or saved or evaluating or report.due(state.step):  # the losses read, checked, reported
            _flush(report, run)
        if curriculum:
            report.curriculum(state.step, curriculum_check(run, state, data, s.rank, s.device, report.console))
        if saved:  # before the evaluation: an evaluation that fails never costs the steps trained
            save_checkpoint(run.last_path, run, state)
            last_save = time.monotonic()
        if evaluating:
            _evaluate(run, state, data, report, s.device, s.rank, saved)
    if s.resumed and start >= cfg.steps:
        # resumed at the end (a run stopped in or before its final evaluation): evaluate, train nothing again
        _evaluate(run, state, data, report, s.device, s.rank, True)


def end(s: Session, report: RunLog) -> dict:
    """The last checkpoint, OUT released, the process group left; the final metrics."""
    run = s.run
    state = s.state
    init = s.init
    if not broadcast(run.last_path.exists()):  # resumed at or past the final step: still leave a checkpoint behind
        save_checkpoint(run.last_path, run, state)
    s.release()
    if s.created_group:
        torch.distributed.destroy_process_group()
    return {"step": state.step, "losses": report.losses, "eval": report.last_eval, "out": str(s.out),
            "rank": s.rank, "best_by": s.cfg.eval.best_by, "best": state.best if state.best >= 0 else None,
            # kept for older readers: what `best` is when best.pt follows the held-out mean recall
            "best_mean_recall": state.best if state.best >= 0 and s.cfg.eval.best_by == "mean_recall" else None,
            "data": s.data_sig,
            "init_from": {k: v for k, v in init.items() if k != "notes"} if init else None}


def _evaluate(run: Run, state: RunState, data, report: RunLog, device, rank: int, saved: bool) -> None:
    """The held-out evaluation on rank 0; when it improves best and last.pt was just saved, last.pt again, so that a
    resumed run knows the best score (eval.best_by's) that best.pt holds (every rank saves: the RNG states are
    gathered)."""
    best = state.best
    if rank == 0:
        evaluate_heldout(run, state, data, report, device)
    state.best = broadcast(state.best)
    if saved and state.best != best:
        save_checkpoint(run.last_path, run, state)


MAX_SKIPS = 50  # fp16: this many steps skipped in a row means the loss scale is collapsing, not settling


def _skipped(state: RunState, in_a_row: int) -> int:
    """Count a step the loss scaler skipped (its batch stays consumed; the step, and with it the lr schedule, does
    not advance); a TrainError after MAX_SKIPS in a row. Returns `in_a_row`."""
    state.step -= 1
    state.skipped += 1
    if in_a_row >= MAX_SKIPS:
        raise TrainError(f"train.precision=fp16: {in_a_row} steps in a row had inf / NaN gradients after step "
                         f"{state.step}, so the loss scale is collapsing; use train.precision=bf16 or fp32")
    return in_a_row


NO_BAD_STEP = 1 << 62  # _flush: no non-finite step on this rank


def _flush(report: RunLog, run: Run) -> None:
    """The steps since the last flush: their losses read from the device in one transfer, checked, reported.

    The non-finite rule: a TrainError (PeerFailed on the other ranks, every rank at the same flush) naming the first
    step whose total is not finite on any rank, with the steps before it reported. The loop flushes before every
    checkpoint save, evaluation and TOnICS check, so no checkpoint holds parameters a non-finite step updated."""
    values = report.read_pending()
    mine = next(((step, losses) for step, losses in values if not math.isfinite(losses["total"])), None)
    first = -max_over_ranks(-(mine[0] if mine else NO_BAD_STEP))  # one all-reduce: the earliest on any rank
    if first == NO_BAD_STEP:
        report.flush(values)
        return
    report.flush(values, until=first)
    raise _non_finite(first, mine[1] if mine and mine[0] == first else None, run)


def _finite(losses: dict, step: int, run: Run) -> dict:
    """The step's losses read at once as floats; a TrainError on every rank at the same step when one rank's total
    is not finite. fp16's loop reads each step's losses so (it reads whether the loss scaler stepped, a sync per step
    whatever it does): a non-finite forward gives inf gradients, which would otherwise be skipped unseen."""
    losses_f = {k: float(v.detach()) for k, v in losses.items()}
    finite = math.isfinite(losses_f["total"])
    if any_flags([not finite])[0]:
        raise _non_finite(step, None if finite else losses_f, run)
    return losses_f


def _non_finite(step: int, losses: dict | None, run: Run) -> Exception:
    """The non-finite rule's error for `step`: a TrainError with this rank's losses, or PeerFailed (`losses` None)
    when another rank's total was the non-finite one."""
    kept = f"; the last good checkpoint {run.last_path} is kept" if run.last_path.exists() else ""
    where = " (" + ", ".join(f"{k}={v:.4g}" for k, v in losses.items()) + ")" if losses else ""
    # fp16 does not skip such a step as it does inf gradients: the loss scale multiplies the backward only, so
    # backing it off cannot cure a forward that overflowed
    hint = "; under fp16 autocast the forward may have overflowed: try train.precision=bf16 or fp32" \
        if run.precision == "fp16" and losses else ""
    return (PeerFailed if losses is None else TrainError)(f"non-finite loss at step {step}"
                                                         f"{where or ' on another rank'}{kept}{hint}")


def _on_signal(run: Run, feed: Feed, console, signum, frame) -> None:
    """First Ctrl-C / SIGTERM: note it, so the loop saves after this step; a second one abandons the step.

    While the loop waits for its next batch the wait is given up at once (StopFetch): a read that blocks (a hung
    mount, a FIFO as a shard) resumes after a handler that returns, and would hold the run until the data came."""
    if run.stop_signal is not None:
        raise KeyboardInterrupt
    run.stop_signal = signum
    name = signal.Signals(signum).name
    if feed.reading:
        console.print(f"{name}: giving up the read of the next batch, saving last.pt (again to abandon)",
                      highlight=False)
        raise StopFetch
    console.print(f"{name}: finishing this step, then saving last.pt (again to abandon)", highlight=False)


@contextlib.contextmanager
def _running(run: Run, feed: Feed, console):
    """Ctrl-C and SIGTERM handled by `_on_signal` while the loop runs (main thread only), the former handlers after;
    and the feed's loader workers stopped when the loop ends, however it ends (a failed run's traceback holds the
    feed, and with it workers that would outlive the run in a Python session)."""
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handler = functools.partial(_on_signal, run, feed, console)
        handlers = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        feed.close()
        for s, h in handlers.items():
            signal.signal(s, h)

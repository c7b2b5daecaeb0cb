"""`train`: set-up -> data -> model -> optimiser -> resume -> loop -> end, and the signal handler.

The pieces live in their own modules: the set-up and the training data in vltrain.runsetup, the batches in
vltrain.batches, one step's losses in vltrain.step (the objectives in vltrain.objectives), the optimiser in
vltrain.optim, checkpoints in vltrain.checkpoint, the periodic checks in vltrain.checks, and what the run tells the
user in vltrain.report.
"""

import contextlib
import copy
import functools
import math
import signal
import threading
import time
from pathlib import Path

import torch

from vlprep.outlock import release_output
from vltrain.errors import PeerFailed, TrainError
from vltrain import checkpoint as ckpt_io
from vltrain.batches import Feed, StopFetch
from vltrain.checkpoint import Run, RunState, interrupted, save_checkpoint
from vltrain.checks import curriculum_check, evaluate_heldout
from vltrain.data import data_signature, to_device
from vltrain.distributed import RankSlice, any_flags, broadcast, gather, init_from_env, world
from vltrain.model import autocast, build_model
from vltrain.optim import build_optimizer, lr_at, optimizer_step, set_lr
from vltrain.report import Report, console, earlier_rows, summary
from vltrain.runsetup import (clamp_queue, heldout_positions, init_source, keep_freed_memory, open_output,
                              resolve_input, resolve_precision, resolve_workers, seed_everything, speed_options,
                              train_device, training_data)
from vltrain.samplers import GritSampler
from vltrain.step import TrainStep, distill_alpha_at, wrap_ddp


def train(cfg, resume: bool = False, overwrite: bool = False, init_from=None) -> dict:
    """Train as cfg says, writing OUT/{metrics.jsonl, tb/, last.pt, best.pt}; returns the final metrics.

    Refuses an OUT holding another run unless `resume` (continue from OUT/last.pt) or `overwrite` (start over).
    `init_from` (a checkpoint or an export folder) starts a new run from its weights only: fresh optimiser, schedule
    and step 0, the architecture from cfg (vltrain.checkpoint.init_weights); a resume of it re-loads nothing.
    Ctrl-C / SIGTERM finish the current step, write last.pt and raise `vltrain.checkpoint.Interrupted`.
    """
    # --- set-up (every rank builds the same model from the run seed; its own draws use a per-rank seed)
    cfg, out = copy.deepcopy(cfg), Path(cfg.out)
    created_group, device_name = init_from_env(cfg.device)  # torchrun: join the process group
    rank, size = world()
    console.quiet = size > 1 and rank > 0  # rank 0 alone reports
    device = train_device(device_name)
    if device.type == "cpu":
        keep_freed_memory()
    # --init-from is read before OUT is touched: an unreadable source leaves OUT as it was
    source = init_source(init_from, out, resume, overwrite)
    open_output(out, resume, overwrite, rank)
    ckpt = ckpt_io.load(out / "last.pt", "--resume checkpoint") if resume else None
    if ckpt is not None:
        ckpt_io.check_ranks(ckpt, out / "last.pt", size)
    rank_seed = cfg.seed + 1_000_003 * rank
    seed_everything(cfg.seed, device)
    resolve_input(cfg)
    resolve_workers(cfg, device)

    # --- data
    data = training_data(cfg, ckpt, rank, size)
    data_sig, clamped = data_signature(cfg.shards), clamp_queue(cfg, data.n_train)
    if ckpt is not None:
        ckpt_io.check_resumable(ckpt, cfg, data_sig, out / "last.pt")
    if clamped:
        console.print(clamped, highlight=False)
    heldout_positions(cfg, data)

    # --- model
    model = build_model(cfg.model) if ckpt is None else ckpt_io.model_from(ckpt, out / "last.pt")
    init = (ckpt or {}).get("init_from")  # a resumed run keeps its record; its weights are in last.pt
    if source is not None:
        init, source = ckpt_io.init_weights(model, source, init_from), None
        console.print(_init_line(init), highlight=False, markup=False)
        for note in init["notes"]:
            console.print(note, highlight=False, markup=False)
    model.to(device).train()
    channels_last = speed_options(cfg, model, device, data.use_features)
    precision, why = resolve_precision(cfg, model, device, ckpt, rank)
    generator = torch.Generator(device=device).manual_seed(rank_seed)  # MLM masks and hard-negative draws
    step_fn = TrainStep(model) if size == 1 else wrap_ddp(model, cfg.loss, device)
    if size > 1:
        seed_everything(rank_seed, device)
    # every rank draws the same global batches and reads its slice of each
    batch_sampler = RankSlice(data.sampler, rank, size) if size > 1 and data.sampler is not None else data.sampler

    # --- optimiser
    optimizer, params = build_optimizer(model, cfg.optim, device)
    run = Run(cfg, model, optimizer, data.sampler, generator, data_sig, out, init_from=init, precision=precision)

    # --- resume (the data position is replayed: this epoch's batches already trained on are drawn again)
    state, rng = ckpt_io.restore(ckpt, run, rank, size) if ckpt is not None else (RunState(), None)
    rows = earlier_rows(out / "metrics.jsonl", state.step) if ckpt is not None else []
    feed = Feed(data, batch_sampler, rank_seed, cfg.batch_size, cfg.data.workers, device)  # closed by _running
    feed.start(state)
    if ckpt is not None:
        ckpt_io.set_rng_states(rng, generator)
        began = f"; the run began from --init-from {init['path']}" if init else ""
        console.print(f"resumed from step {state.step} of {cfg.steps} ({run.last_path}){began}", highlight=False)
    console.print(summary(cfg, model, device, data.n_train, data.n_val, data.per_epoch, size, (precision, why)),
                  highlight=False, markup=False)

    # --- loop
    last_save, start = time.monotonic(), state.step
    with Report(cfg, out, rank, rows, state.step, device, data.use_features) as report, _running(run, feed):
        while state.step < cfg.steps:
            batch, fault = feed.next(state)
            # One all-reduce under torchrun (the identity in one process): every rank stops or saves together.
            failed, stopping, save_due = any_flags([fault is not None, run.stop_signal is not None,
                                                    time.monotonic() - last_save >= 60 * cfg.ckpt_minutes])
            if stopping:  # the batch just fetched is not counted: a resume draws it again
                raise interrupted(run, state)
            if failed:
                kept = f"; the last checkpoint {run.last_path} is kept" if run.last_path.exists() else ""
                raise fault or PeerFailed(f"stopped at step {state.step}: another process failed (its error is "
                                          f"printed above){kept}")
            state.consumed, state.step = state.consumed + 1, state.step + 1
            lr, alpha = lr_at(state.step, cfg.optim.lr, cfg.optim.warmup_steps, cfg.steps,
                              cfg.optim.min_lr_ratio), distill_alpha_at(state.step, cfg)
            set_lr(optimizer, lr)
            batch = to_device(batch, device)
            if channels_last:
                batch["images"] = batch["images"].contiguous(memory_format=torch.channels_last)
            with autocast(device, precision):
                losses = step_fn(batch, cfg.loss, generator, data.tokenizer, alpha)
            queue_feats = losses.pop("queue_feats")
            losses_f = _finite(losses, state.step, run)
            optimizer_step(model, optimizer, params, losses["total"], cfg.optim.grad_clip, queue_feats)
            if isinstance(data.sampler, GritSampler):  # phase 1: this step's ITC features, no extra forward pass
                data.sampler.collect(gather(batch["index"], False)[1], *queue_feats)  # the global batch, rank order
            report.step(state.step, losses_f, lr, alpha, feed.bad, cfg.batch_size * size, feed.io())
            # TOnICS at the end of a period, so that a refreshed P_S starts with the next period
            if data.heldout is not None and state.step % cfg.sampler.refresh_every == 0:
                report.curriculum(state.step, curriculum_check(run, state, data, rank, device))
            saved = state.step % cfg.ckpt_every == 0 or state.step == cfg.steps or save_due
            if saved:  # before the evaluation: an evaluation that fails never costs the steps trained
                save_checkpoint(run.last_path, run, state)
                last_save = time.monotonic()
            if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
                _evaluate(run, state, data, report, device, rank, saved)
        if ckpt is not None and start >= cfg.steps:
            # resumed at the end (a run stopped in or before its final evaluation): evaluate, train nothing again
            _evaluate(run, state, data, report, device, rank, True)

    # --- end
    if not broadcast(run.last_path.exists()):  # resumed at or past the final step: still leave a checkpoint behind
        save_checkpoint(run.last_path, run, state)
    if rank == 0:
        release_output(out)
    if created_group:
        torch.distributed.destroy_process_group()
    return {"step": state.step, "losses": report.losses, "eval": report.last_eval, "out": str(out), "rank": rank,
            "best_mean_recall": state.best if state.best >= 0 else None, "data": data_sig,
            "init_from": {k: v for k, v in init.items() if k != "notes"} if init else None}


def _init_line(init: dict) -> str:
    """init_weights' record as one line: counts per top-level module (the six largest), then the EMA copy and queues."""
    def counts(n: int, modules: dict, unit: str = "") -> str:
        shown = [f"{name} {c}" for name, c in list(modules.items())[:6]] + (["..."] if len(modules) > 6 else [])
        return f"{n}{unit} ({', '.join(shown)})" if shown else f"{n}{unit}"

    m, src = init["modules"], f" (step {init['step']}, preset {init['preset']})" if init.get("step") is not None else ""
    line = (f"init-from {init['path']}{src}: loaded {counts(init['loaded'], m['loaded'], ' tensors')}; new "
            f"{counts(init['new'], m['new'])}; dropped {counts(init['dropped'], m['dropped'])}")
    if init["momentum_copied"]:
        line += f"; momentum copy: {init['momentum_copied']} from the online weights"
    return line + ("; queues start fresh" if init["queues_fresh"] else "")


def _evaluate(run: Run, state: RunState, data, report: Report, device, rank: int, saved: bool) -> None:
    """The held-out evaluation on rank 0; when it improves best and last.pt was just saved, last.pt again, so that a
    resumed run knows the best mean recall that best.pt holds (every rank saves: the RNG states are gathered)."""
    best = state.best
    if rank == 0:
        evaluate_heldout(run, state, data, report, device)
    state.best = broadcast(state.best)
    if saved and state.best != best:
        save_checkpoint(run.last_path, run, state)


def _finite(losses: dict, step: int, run: Run) -> dict:
    """The step's losses as floats; a TrainError on every rank at the same step when one rank's total is not finite."""
    losses_f = {k: float(v.detach()) for k, v in losses.items()}
    finite = math.isfinite(losses_f["total"])
    if any_flags([not finite])[0]:
        kept = f"; the last good checkpoint {run.last_path} is kept" if run.last_path.exists() else ""
        where = "" if finite else " (" + ", ".join(f"{k}={v:.4g}" for k, v in losses_f.items()) + ")"
        raise (PeerFailed if finite else TrainError)(f"non-finite loss at step {step}{where or ' on another rank'}"
                                                     f"{kept}")
    return losses_f


def _on_signal(run: Run, feed: Feed, signum, frame) -> None:
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
def _running(run: Run, feed: Feed):
    """Ctrl-C and SIGTERM handled by `_on_signal` while the loop runs (main thread only), the former handlers after;
    and the feed's loader workers stopped when the loop ends, however it ends (a failed run's traceback holds the
    feed, and with it workers that would outlive the run in a Python session)."""
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handler = functools.partial(_on_signal, run, feed)
        handlers = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        feed.close()
        for s, h in handlers.items():
            signal.signal(s, h)

"""What a run tells the user: the start summary, the speed and ETA, the progress bar (or a line every 10% without a
terminal), metrics.jsonl and TensorBoard, all behind `RunLog`. Only rank 0 writes files."""

import datetime
import json
import math
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from vlprep.urls import redact
from vltrain.errors import TrainError
from vltrain.figures import plot_learning_curve
from vltrain.tracking import Trackers



def make_console(quiet: bool = False) -> Console:
    """The terminal a run reports to (stderr); a quiet one prints nothing (torchrun's other ranks, a library caller)."""
    return Console(stderr=True, emoji=False, soft_wrap=True, quiet=quiet)


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "forever"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 1e7:  # under about 4 months
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 31_557_600:.3g} years"


def time_left(sec_per_step: float, steps: int) -> float:
    """Seconds for `steps` more steps; inf when the product is beyond a float (--steps with hundreds of digits)."""
    try:
        return sec_per_step * steps
    except OverflowError:
        return math.inf


def end_time(left: float) -> str:
    """`until about HH:MM`, or a plain word when now + left is beyond any date datetime can hold (year 9999)."""
    try:
        return "until about " + (datetime.datetime.now() + datetime.timedelta(seconds=left)).strftime("%H:%M")
    except (OverflowError, ValueError):
        return "ending beyond any date this clock can print"


def init_line(init: dict) -> str:
    """init_weights' record as one line: counts per top-level module (the six largest), then the EMA copy and queues."""
    def counts(n: int, modules: dict, unit: str = "") -> str:
        shown = [f"{name} {c}" for name, c in list(modules.items())[:6]] + (["..."] if len(modules) > 6 else [])
        return f"{n}{unit} ({', '.join(shown)})" if shown else f"{n}{unit}"

    m = init["modules"]
    src = f" (step {init['step']}, preset {init['preset']})" if init.get("step") is not None else ""
    line = (f"init-from {init['path']}{src}: loaded {counts(init['loaded'], m['loaded'], ' tensors')}; new "
            f"{counts(init['new'], m['new'])}; dropped {counts(init['dropped'], m['dropped'])}")
    if init["momentum_copied"]:
        line += f"; momentum copy: {init['momentum_copied']} from the online weights"
    return line + ("; queues start fresh" if init["queues_fresh"] else "")


def summary(cfg, model, device, n_train: int, n_val: int, per_epoch: int, size: int = 1,
            precision: tuple[str, str] = ("fp32", ""), ddp: bool = False) -> str:
    """The start-of-run block: what will train, on what, for how long, where it goes (`ddp`: the step runs under
    DistributedDataParallel, which torchrun gives even one process)."""
    m = cfg.model
    w = cfg.loss
    d = cfg.data
    trained = []
    frozen = []
    n_params = 0
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
    pooling = "CLIP's end-of-text" if m.text_model.startswith("clip:") else m.pooling
    p, why = precision
    others = [name for name in cfg.train.report_to if name != "tensorboard"]
    reports = f"; reports to {', '.join(others)}" if others else ""
    dtype = {"bf16": "bf16 autocast", "fp16": "fp16 autocast, loss scaling"}.get(p, "float32")
    dtype += f", {why}" if why else ""
    lines = [
        f"vltrain run: preset {cfg.preset}, {cfg.steps:,} steps = {cfg.steps / max(per_epoch, 1):.1f} epochs of "
        f"{per_epoch:,} batches of {cfg.batch_size}"
        + (f" x {size} process{'es' if size > 1 else ''} (DDP, global batch {cfg.batch_size * size})"
           if ddp or size > 1 else "")
        + f", seed {cfg.seed}",
        f"  data     {', '.join(map(redact, cfg.shards))}: train {n_train:,}, held out {n_val:,} "
        f"(val_frac {d.val_frac:g}"
        + (f"; the first {d.val_max:,} scored per evaluation, data.val_max" if 0 < d.val_max < n_val else "")
        + "); "
        f"sampler {cfg.sampler.kind}",
        f"  image    {image}",
        f"  text     {m.text_model}, max {d.max_len} tokens, {pooling} pooling; fusion layers {m.fusion_layers}"
        + (f" ({m.fusion_from})" if m.fusion_layers else "")
        + (f"; momentum {m.momentum_m:g}" if m.momentum else "") + f"; queue {m.queue_size:,}",
        f"  losses   {losses}" + (f" ({', '.join(extras)})" if extras else ""),
        f"  trains   {n_params / 1e6:.1f}M parameters in {', '.join(trained) or 'nothing'}"
        + (f"; frozen: {', '.join(frozen)}" if frozen else ""),
        f"  device   {device} ({dtype}); lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup_steps}",
        f"  out      {cfg.out}: last.pt every {cfg.ckpt_every} steps or {cfg.ckpt_minutes:g} min, best.pt at evals "
        f"every {cfg.eval_every} steps"
        + (f" (by {cfg.eval.best_by}; zero-shot on {cfg.eval.zeroshot_folder})" if cfg.eval.zeroshot_folder else "")
        + ", metrics.jsonl, learning_curve.png"
        + (", tb/" if "tensorboard" in cfg.train.report_to else "") + reports,
    ]
    return "\n".join(lines)


def earlier_rows(path: Path, step: int) -> list[dict]:
    """A resumed run's metrics.jsonl rows up to its checkpoint's step (the rows after it are redone).

    A last line cut short (the process killed while it wrote a row after its checkpoint) is dropped with the other
    rows to redo; a row that does not read anywhere else is a TrainError naming its line (the file was edited or
    damaged, and rewriting it would lose the rows after it)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no step")
        except ValueError:
            if n == len(lines) and not path.read_bytes().endswith(b"\n"):  # the torn tail of a killed write
                break
            raise TrainError(f"--resume: {path} line {n} is not a metrics row (edited or damaged?); repair or remove "
                             "that line, or move metrics.jsonl aside to resume without the earlier rows") from None
        rows.append(row)
    return [r for r in rows if r["step"] <= step]


class _NoBoard:
    """TensorBoard stand-in for ranks other than 0 (rank 0 alone logs)."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class RunLog:
    """One run's reporting, a context manager: metrics.jsonl (kept in `rows` for the learning curve), TensorBoard
    under tb/ and the other trackers of train.report_to, the progress bar and the speed lines. `rows` are the earlier
    rows of a resumed run."""

    def __init__(self, cfg, out: Path, rank: int, rows: list[dict], step: int, device, use_features: bool,
                 console: Console):
        self.console = console
        self.cfg, self.out, self.rows, self.device, self.use_features = cfg, out, rows, device, use_features
        self.trackers = Trackers(cfg, out, rank, console)  # first: a tracker that cannot start leaves nothing open
        self.metrics = (out / "metrics.jsonl").open("w") if rank == 0 else open(os.devnull, "w")
        self.metrics.writelines(json.dumps(r) + "\n" for r in rows)
        from torch.utils.tensorboard import SummaryWriter  # slow to import: only once a run starts

        board = rank == 0 and "tensorboard" in cfg.train.report_to
        self.tb = SummaryWriter(str(out / "tb")) if board else _NoBoard()
        for row in rows:  # a tracker that is new to the run gets its earlier rows (one that had them skips them)
            self.trackers.log(row)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), console=console, disable=not console.is_terminal)
        self.task = self.progress.add_task("train", total=cfg.steps, completed=step, rate="")
        self.start_step, self.losses, self.last_eval = step, {}, None
        self.pending = []  # steps recorded since the last flush: (step, loss names, loss tensors, row fields, time)
        self.report_every = max(1, cfg.steps // 10)  # without a terminal (no bar), a progress line every 10%
        self.t_start = self.t0 = time.perf_counter()
        self.seen = 0

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)
        self.metrics.close()
        self.tb.close()
        self.trackers.finish(self.last_eval, exc[0] is None)

    def log(self, row: dict) -> None:
        """One metrics.jsonl row."""
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        self.trackers.log(row)

    def step(self, step: int, losses: dict, lr: float, alpha: float, bad: int, samples: int,
             io: dict | None = None) -> None:
        """After an optimiser step: its losses (0-d tensors, detached here) kept on their device with the row's other
        fields and the time, until `flush` reads every pending step in one transfer and reports them. Reading a
        loss every step would make the host wait for the device's queue to drain each step."""
        self.pending.append((step, list(losses), [v.detach() for v in losses.values()], (lr, alpha, bad, samples, io),
                             time.perf_counter()))

    def due(self, step: int) -> bool:
        """Whether `step` writes something (a metrics row, the ETA note, a progress line without a terminal), so the
        loop flushes after it; every rank answers alike (the loop's other flushes come before checkpoints,
        evaluations and TOnICS checks)."""
        return (step % self.cfg.log_every == 0 or step == self.cfg.steps or step - self.start_step == 10
                or (self.progress.disable and step % self.report_every == 0))

    def read_pending(self) -> list[tuple[int, dict]]:
        """Every pending step's (step, {name: float}), in step order, read from the device in one transfer."""
        if not self.pending:
            return []
        flat = iter(torch.stack([v for p in self.pending for v in p[2]]).tolist())
        return [(p[0], {k: next(flat) for k in p[1]}) for p in self.pending]

    def flush(self, values: list[tuple[int, dict]], until: int | None = None) -> None:
        """Report the pending steps before step `until` (None: all of them) with `read_pending`'s `values` (rows,
        progress, ETA note, at the times the steps ended); the pending ones are dropped."""
        for (step, names, _, (lr, alpha, bad, samples, io), now), (_, losses) in zip(self.pending, values):
            if until is not None and step >= until:
                break
            self._report(step, losses, lr, alpha, bad, samples, io, now)
        self.pending = []

    def _report(self, step: int, losses: dict, lr: float, alpha: float, bad: int, samples: int, io: dict | None,
                now: float) -> None:
        """One optimiser step's report, as of `now` (when it ended): the ETA note after 10 steps, a row every
        log_every steps, the progress; `io` (remote data: read_retries, shards_skipped) joins the row."""
        cfg = self.cfg
        # MLM's masked positions past the vocabulary head's cap (vltrain.losses.mlm_cap; below 1e-9 a step): said
        # at once, and a field of the step's row, only when there were any
        overflow = int(losses.pop("mlm_overflow", 0))
        if overflow:
            self.console.print(f"step {step}: MLM masked {overflow} positions past its cap; they were left out of "
                               "this step's loss", highlight=False)
        self.losses, self.seen = losses, self.seen + samples
        done = step - self.start_step
        elapsed = now - self.t_start
        sec_per_step = elapsed / done
        if done == 10 and cfg.steps - step > 0:
            self._eta_note(done, elapsed, step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            rate = self.seen / max(now - self.t0, 1e-9)
            self.t0, self.seen = now, 0
            row = {"step": step, **losses, "lr": lr, "samples_per_s": round(rate, 2), "bad_samples": bad, **(io or {})}
            if overflow:
                row["mlm_overflow"] = overflow
            if cfg.loss.distill_alpha > 0:
                row["distill_alpha"] = alpha
            self.log(row)
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(f"train/{k}", v, step)
        self.progress.update(self.task, completed=step, rate=f"{sec_per_step:.2f} s/step", description=f"step {step} "
                             + " ".join(f"{k.removesuffix('_loss')} {v:.3f}" for k, v in losses.items())
                             + f" lr {lr:.2e}")
        if self.progress.disable and step % self.report_every == 0:
            self.console.print(f"step {step}/{cfg.steps} loss {losses['total']:.3f}, {sec_per_step:.2f} s/step, "
                          f"eta {fmt_duration(time_left(sec_per_step, cfg.steps - step))}", highlight=False)

    def curriculum(self, step: int, row: dict) -> None:
        self.log({"step": step, "curriculum": row})
        self.tb.add_scalar("curriculum/p_entity", row["probs"][0], step)
        self.tb.add_scalar("curriculum/heldout_r1", row["heldout_r1"], step)

    def val(self, step: int, result: dict) -> None:
        """A held-out evaluation: TensorBoard, a metrics row and the learning curve redrawn."""
        for k, v in result.items():
            if isinstance(v, float):
                self.tb.add_scalar(f"val/{k}", v, step)
        self.log({"step": step, "val": result})
        plot_learning_curve(self.rows, self.out / "learning_curve.png")

    def _eta_note(self, done: int, elapsed: float, step: int) -> None:
        """After the first 10 steps: the measured speed and when the run will end (with a hint on a slow CPU run)."""
        cfg = self.cfg
        sec_per_step = elapsed / done
        left = time_left(sec_per_step, cfg.steps - step)
        self.console.print(f"{done} steps in {elapsed:.1f} s ({sec_per_step:.2f} s/step, "
                      f"{cfg.batch_size / sec_per_step:.1f} samples/s): the remaining {cfg.steps - step:,}"
                      f" steps take about {fmt_duration(left)} ({end_time(left)})", highlight=False)
        if left > 3600 and self.device.type == "cpu" and not self.use_features:
            self.console.print("hint: on a CPU, cache the image tower once with `vlprep features IN OUT` and "
                          "train on OUT: several times faster (docs/FEATURES.md)", highlight=False)

"""A run's checkpoints: Run, RunState, save_checkpoint, the resume checks, restore, RNG states; a run in object
storage uploaded after every checkpoint (`upload`)."""

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vlprep import objstore, versions
from vlprep.output import Out, publish
from vlprep.urls import redact
from vltrain.checkpoint import save
from vltrain.config import Config, to_dict
from vltrain.config_load import upgrade
from vltrain.distributed import barrier, gather_objects, world
from vltrain.errors import TrainError
from vltrain.model import VLModel


def rng_states(generator: torch.Generator) -> dict:
    """Every RNG a run draws from, as tensors and plain data."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "generator": generator.get_state()}


def set_rng_states(rng: dict, generator: torch.Generator) -> None:
    """Restore what `rng_states` saved."""
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    generator.set_state(rng["generator"])


# Keys a resumed run may change: how long it runs, where and how it reports, how it loads data, the speed options,
# what its evaluations score besides held-out retrieval (eval.best_by stays: it says what the checkpoint's `best` is).
# Keys added with a default that is not the behaviour from before them: a checkpoint older than the key ran as this.
BEFORE_KEY = {"data.bucket": 0, "train.precision": "fp32", "train.unpad": False, "data.val_max": 0}
RESUMABLE = {"steps", "epochs", "out", "device", "log_every", "eval_every", "ckpt_every", "ckpt_minutes",
             "data.workers", "data.prefetch", "train.tf32", "train.channels_last", "train.compile",
             "train.grad_checkpointing", "train.report_to", "eval.zeroshot_folder", "eval.zeroshot_templates"}


def config_diff(saved: dict, now: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """'key: saved -> now' for every config key that differs, dotted, skipping RESUMABLE keys.

    A key absent from `saved` (a checkpoint older than the key) counts as its value in `defaults`, the dataclass
    defaults, which keep the behaviour from before the key existed."""
    diffs = []
    defaults = defaults or {}
    # The preset first: when it differs, it explains most of the other differences.
    for key in sorted(set(saved) | set(now), key=lambda k: (k != "preset", str(k))):
        dotted = prefix + str(key)
        a = saved.get(key, defaults.get(key))
        b = now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = defaults.get(key)
            diffs += config_diff(a, b, dotted + ".", sub if isinstance(sub, dict) else None)
        elif dotted not in RESUMABLE and a != b:
            older = " (absent from this older checkpoint)" if key not in saved and key in defaults else ""
            diffs.append(f"{dotted}: {a!r}{older} -> {b!r}")
    return diffs


class Interrupted(TrainError):
    """Ctrl-C or SIGTERM: last.pt was written; the message says how to go on. `signum`: the signal that stopped the
    run (the exit status is 128 + it, as a shell reports a process the signal killed: 130, 143)."""

    def __init__(self, message: str, signum: int = 2):
        super().__init__(message)
        self.signum = signum


@dataclass
class RunState:
    """Where a run is: optimiser steps taken, data epoch and batches consumed in it (a step that fp16's loss scaler
    skipped consumed its batch), best held-out mean recall, TOnICS' curriculum log (P_S at every held-out check),
    and the steps skipped so far."""

    step: int = 0
    epoch: int = 0
    consumed: int = 0
    best: float = -1.0
    curriculum_log: list = field(default_factory=list)
    skipped: int = 0  # fp16 steps the loss scaler skipped (inf / NaN gradients)


@dataclass
class Run:
    """A run's fixed parts: what every checkpoint of it saves besides the RunState."""

    cfg: Config
    model: VLModel
    optimizer: torch.optim.Optimizer
    sampler: object  # GritSampler / TonicsBatchSampler, or None for the streamed random sampler
    generator: torch.Generator  # MLM masks, hard-negative draws, soft masks
    data_sig: str  # the training data's signature (vltrain.data.shards.data_signature)
    out: Path
    stop_signal: int | None = None  # set by the signal handler: save after this step and stop
    init_from: dict | None = None  # --init-from: where the weights came from (init_weights' record), kept by resumes
    precision: str = "fp32"  # what train.precision resolved to (fp32 / bf16 / fp16); a resumed run keeps it
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler; its scale is saved and restored
    remote: Out | None = None  # a URL OUT (s3://, gs://): `out` is its staging folder, uploaded after each save

    @property
    def last_path(self) -> Path:
        return self.out / "last.pt"

    def shown(self, name: str) -> str:
        """Where file `name` of OUT is, as the user names it: the URL (redacted) for a run in object storage."""
        return redact(objstore.join(self.remote.url, name)) if self.remote is not None else str(self.out / name)

    @property
    def best_path(self) -> Path:
        return self.out / "best.pt"


def checkpoint_state(run: Run, state: RunState) -> dict:
    """What last.pt / best.pt hold: weights, optimiser, position in the data, sampler state, RNG states, config,
    `data`, the training data's signature (computed once per run), and `init_from` for a run started from other
    weights (init_weights' record, so that a resumed run still says where it began)."""
    return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "step": state.step,
            "epoch": state.epoch, "consumed": state.consumed, "best": state.best, "config": to_dict(run.cfg),
            "data": run.data_sig, "sampler": run.sampler.state_dict() if run.sampler is not None else None,
            "curriculum_log": state.curriculum_log, "rng": rng_states(run.generator), "versions": versions(),
            "precision": run.precision,
            **({"scaler": run.scaler.state_dict(), "skipped_steps": state.skipped} if run.scaler is not None else {}),
            **({"init_from": run.init_from} if run.init_from else {})}


def save_checkpoint(path: Path, run: Run, state: RunState, every_rank: bool = True) -> None:
    """Write a checkpoint atomically. Under torchrun (every_rank) each rank's RNG states and data position are
    gathered into `ranks`; rank 0 writes and the others wait at a barrier."""
    rank, size = world()
    ranks = None
    if every_rank and size > 1:
        ranks = gather_objects({"rng": rng_states(run.generator), "epoch": state.epoch, "consumed": state.consumed})
    if rank == 0:
        saved = checkpoint_state(run, state)
        if ranks is not None:
            saved["ranks"] = ranks
        save(saved, path)
        upload(run.remote)
    if every_rank:
        barrier()


def stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def upload(place: Out | None) -> None:
    """A URL OUT's files changed since their last upload, from its staging folder: each a whole object under its
    final key (vlprep.output.publish), last.pt the very last, so that the bucket's last.pt always has the metrics
    rows, best.pt and figures of its step beside it (a best.pt newer than last.pt is fine: a resume keeps the run's
    best mean recall from last.pt). Nothing for a local OUT. tb/'s event file is sent as it stands (TensorBoard
    reads a cut last record as not yet written)."""
    if place is None or place.url is None:
        return
    changed = []
    for p in sorted(place.root.rglob("*")):
        name = p.relative_to(place.root).as_posix()
        if p.is_file() and not p.name.endswith(".tmp") and place.sent.get(name) != stamp(p):
            changed.append(name)
    changed.sort(key=lambda n: n == "last.pt")  # stable: every other file first, in name order
    publish(place, changed, keep=changed)


def interrupted(run: Run, state: RunState) -> Interrupted:
    """Write last.pt and return the error that tells the user how to go on."""
    save_checkpoint(run.last_path, run, state)
    return Interrupted(f"stopped at step {state.step} of {run.cfg.steps}: {run.shown('last.pt')} holds it; run the "
                       "same command with --resume to continue", run.stop_signal or 2)


def check_ranks(ckpt: dict, path: Path, size: int) -> None:
    """A TrainError unless `ckpt` was written by as many processes as this run has."""
    saved_size = len(ckpt.get("ranks") or [None])
    if saved_size != size:  # each rank's RNG states and data position are in the checkpoint
        raise TrainError(f"--resume: {path} was written by {saved_size} process(es) and this run has {size}; "
                         "resume with the same --nproc_per_node")


def check_resumable(ckpt: dict, cfg: Config, data: str, path: Path) -> None:
    """A TrainError unless `ckpt` continues this run: the same config (but RESUMABLE keys) and training data."""
    defaults = to_dict(Config())
    for dotted, value in BEFORE_KEY.items():  # an older checkpoint ran as these keys' former behaviour
        section, key = dotted.split(".")
        defaults[section][key] = value
    diffs = config_diff(upgrade(ckpt["config"]), to_dict(cfg), defaults=defaults)
    if diffs:
        raise TrainError(f"--resume: {path} was trained with another config ({'; '.join(diffs[:8])}"
                         f"{'; ...' if len(diffs) > 8 else ''}); use the same options, or a new --out")
    if ckpt.get("data") not in (None, data):  # None: a checkpoint from before the signature
        raise TrainError(f"--resume: the training data changed since {path} was written (other keys or captions in "
                         f"{', '.join(map(redact, cfg.shards))}); use --overwrite to start over, or a new --out")


def restore(ckpt: dict, run: Run, rank: int, size: int) -> tuple[RunState, dict]:
    """Optimiser and sampler state from a resume checkpoint; returns (the RunState, this rank's RNG states), the
    RNG states to set once the data position has been replayed."""
    run.optimizer.load_state_dict(ckpt["optimizer"])
    state = RunState(ckpt["step"], ckpt["epoch"], ckpt["consumed"], ckpt["best"], skipped=ckpt.get("skipped_steps", 0))
    if run.scaler is not None and ckpt.get("scaler") is not None:  # the scale goes on where the run left it
        run.scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt["rng"]
    if size > 1:  # each rank continues from its own RNG states and data position
        own = ckpt["ranks"][rank]
        rng, state.epoch, state.consumed = own["rng"], own["epoch"], own["consumed"]
    if run.sampler is not None:
        if ckpt.get("sampler") is None:
            raise TrainError(f"{run.last_path} holds no sampler state: it was not written by a "
                             f"{run.cfg.sampler.kind} run")
        run.sampler.load_state_dict(ckpt["sampler"])
        state.curriculum_log = ckpt.get("curriculum_log", [])
    return state, rng

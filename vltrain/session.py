"""`setup`: a run's pieces before its first step (output folder, seeds, device, the resolved config and training
data, model, speed options, precision, step function, optimiser, resume and feed), as a `Session` that `train`,
the benchmarks and the pipelines share.

A run in object storage (`--out s3://...` or gs://) trains in a local staging folder (vlprep.output.staging), takes
OUT's lock object (vlprep.outlock.lock_url) and uploads after every checkpoint save (vltrain.resume.upload);
`--resume` downloads last.pt, best.pt and metrics.jsonl from it first."""

import copy
import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from vlprep import VlprepError, objstore
from vlprep.output import Out, staging
from vlprep.outlock import OutLock, lock_output, lock_url
from vlprep.urls import redact, redact_text
from vltrain.accum import AccumStep
from vltrain.checkpoint import check_config, load, model_from
from vltrain import hfclip, openclip
from vltrain.config import Config, ConfigError, ModelConfig
from vltrain.data.feed import Feed
from vltrain.data.shards import data_signature
from vltrain.distributed import RankSlice, broadcast, init_from_env, world
from vltrain.errors import TrainError
from vltrain.exportfmt import CONFIG, META, WEIGHTS, is_export
from vltrain.init_from import check_out_apart, init_weights
from vltrain.model import autocast, bf16_supported, build_model, resolve_device
from vltrain.optim import build_optimizer
from vltrain.resolve import resolve_towers
from vltrain.resume import Run, RunState, check_ranks, check_resumable, restore, set_rng_states, stamp, upload
from vltrain.runlog import RunLog, earlier_rows, init_line, make_console, summary
from vltrain.step import CompiledStep, TrainStep, wrap_ddp
from vltrain.tracking import check_installed
from vltrain.trainset import TrainData, heldout_positions, prepare

OPEN_CLIP_DIR = "open_clip-init"  # --init-from open_clip:...: the CLIPModel folder it is converted into
RUN_FILES = ("last.pt", "best.pt", "metrics.jsonl", "result.json", "curriculum.json", "curriculum.png",
             "learning_curve.png", "tb", "tracking.json", OPEN_CLIP_DIR)


# --- the output folder, seeds, device ------------------------------------------------------------------------


def remote_url(out) -> str | None:
    """OUT's canonical URL when the run lives in object storage (s3://, gs://); None for a local folder."""
    if isinstance(out, str) and objstore.scheme(out) in objstore.WRITABLE:
        return objstore.norm(out)
    return None


def refuse_earlier(where: str, found: list[str], resume: bool, overwrite: bool, export: bool) -> None:
    """prepare_out's refusals for an OUT (`where`, as shown) holding the earlier run files `found` and no last.pt
    to resume (`export`: it is a `vltrain export` folder)."""
    if resume:
        if "best.pt" in found:
            raise TrainError(f"--resume: {where} holds best.pt but no last.pt (a run stopped after an evaluation and "
                             "before its first checkpoint), so there is nothing to resume and starting over would "
                             "replace best.pt; move best.pt elsewhere, or choose another --out")
        if export:
            raise TrainError(f"--resume: {where} is a `vltrain export` folder and holds no last.pt: an export has no "
                             "optimiser state to resume; start a new run from it with --init-from and another --out")
    elif found and not overwrite:
        raise TrainError(f"{where} already holds a run ({', '.join(found)}); add --resume to continue it or "
                         "--overwrite to start over (or choose another --out)")


def prepare_out(out: Path, resume: bool, overwrite: bool) -> tuple[bool, list[str]]:
    """Refuse to train into a folder that holds another run unless told to resume it or to overwrite it; returns
    (whether the run resumes OUT/last.pt, the files of an earlier run it deleted).

    --resume on an OUT without last.pt starts the run (open_clip's `--resume latest`), so that one command line
    serves the first start and every restart (torchrun --max-restarts). The files of a start that left no
    checkpoint (killed before its first one: metrics.jsonl, tb/, ...) are deleted as --overwrite deletes them, since
    starting over is what a restart needs; a checkpoint never is: best.pt without last.pt is a one-line refusal, and
    so is a `vltrain export` folder, which has no optimiser state to resume."""
    if resume and (out / "last.pt").exists():
        return True, []
    found = [name for name in RUN_FILES if (out / name).exists()]
    refuse_earlier(str(out), found, resume, overwrite, out.is_dir() and is_export(out))
    for name in found:  # only the files a run writes: anything else in the folder is the user's
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return False, found


# What --resume downloads from a URL OUT (tb/ stays in the bucket: the resumed run writes a new event file beside it)
PULLED = ("last.pt", "best.pt", "metrics.jsonl", "tracking.json", OPEN_CLIP_DIR)


def run_objects(url: str) -> list[str]:
    """Every object under URL OUT `url`, named relative to it (tb/events..., open_clip-init/config.json)."""
    fs, path = objstore.filesystem(url)
    base = path.rstrip("/") + "/"
    fs.invalidate_cache(path)
    found = objstore.retried(url, lambda: fs.find(base))
    return sorted(p[len(base):] for p in found if p.startswith(base))


def prepare_remote(place: Out, resume: bool, overwrite: bool) -> tuple[bool, list[str]]:
    """prepare_out for a URL OUT (called under its lock): its listing checked by the same rules, its staging folder
    emptied, and for --resume of a run with last.pt the files PULLED downloaded into it (recorded as sent, so that
    only what the run changes goes back); an earlier start's objects deleted as prepare_out deletes its files."""
    url = place.url
    names = run_objects(url)
    shutil.rmtree(place.root, ignore_errors=True)
    place.root.mkdir(parents=True)
    if resume and "last.pt" in names:
        for name in names:
            if name.split("/")[0] in PULLED:
                local = place.root / name
                local.parent.mkdir(parents=True, exist_ok=True)
                objstore.get_file(objstore.join(url, name), local)
                place.sent[name] = stamp(local)
        return True, []
    top = {name.split("/")[0] for name in names}
    found = [name for name in RUN_FILES if name in top]
    refuse_earlier(redact(url), found, resume, overwrite, bool(top & {CONFIG, WEIGHTS, META}))
    objstore.remove(objstore.join(url, name) for name in names if name.split("/")[0] in found)
    return False, found


def open_output(out: Path, resume: bool, overwrite: bool, rank: int,
                place: Out | None = None) -> tuple[OutLock | None, bool, list[str]]:
    """Rank 0 locks OUT and prepares it (`prepare_out`; a URL OUT `place`: its lock object and `prepare_remote`),
    returning (the lock, None on other ranks; whether the run resumes OUT/last.pt, and the files of an earlier start
    deleted, on every rank); under torchrun every rank stops on rank 0's error instead of waiting."""
    error = None
    lock = None
    resuming, removed = False, []
    if rank == 0:
        try:  # one run per OUT: a second `--resume` on the same folder would interleave two runs' checkpoints
            if place is None:
                lock = lock_output(out, "vltrain")
                resuming, removed = prepare_out(out, resume, overwrite)
            else:
                lock = lock_url(place.url, "vltrain")
                resuming, removed = prepare_remote(place, resume, overwrite)
        except (VlprepError, TrainError) as e:
            error = redact_text(str(e))
    error, resuming, removed = broadcast((error, resuming, removed))
    if error is not None:
        if lock is not None:
            lock.release()
        raise TrainError(error)
    if place is not None and rank > 0 and resuming and not (out / "last.pt").exists():
        # a rank on another machine than rank 0's: its own copy, under a name of its own (its node's ranks share out)
        mine = out / f"last.pt.rank{rank}"
        out.mkdir(parents=True, exist_ok=True)
        objstore.get_file(objstore.join(place.url, "last.pt"), mine)
        os.replace(mine, out / "last.pt")
    return lock, resuming, removed


def init_source(init_from, out: Path, resuming: bool, overwrite: bool) -> dict | None:
    """--init-from's checkpoint or export, read (CheckpointError: one line), or None without it, and when the run
    resumes OUT/last.pt, which holds the weights already (`same_init` checks the source against its record);
    refused when it is OUT's own checkpoint, which --overwrite would delete."""
    if init_from is None or resuming:
        return None
    try:
        if hfclip.is_clip(str(init_from)):  # a pretrained CLIP folder: its weights under vltrain's names
            return hfclip.init_source(str(init_from))
        if openclip.is_open_clip(str(init_from)):  # checked here, converted once OUT is ready (setup)
            openclip.hf_config(openclip.read(str(init_from))[0])
            return None
    except ValueError as e:
        raise TrainError(f"--init-from {e}") from None
    path = Path(init_from)
    if overwrite and deleted_by_overwrite(path, out):
        raise TrainError(f"--init-from {path} is a checkpoint of the run in {out}, which --overwrite deletes; copy it "
                         "elsewhere first, or choose another --out")
    source = load(path, "--init-from")
    check_config(source, f"--init-from {path}")  # its config is read for notes: checked as every reader checks it
    return source


def same_init(given, ckpt: dict, path: Path) -> None:
    """--resume with --init-from X: a one-line TrainError unless X is the source OUT/last.pt's run began from (the
    same string, or the same file or folder once resolved, clip:/open_clip:local-dir: prefixes alike)."""
    recorded = (ckpt.get("init_from") or {}).get("path")
    if recorded is None:
        raise TrainError(f"--resume: {path} is a run that did not begin from --init-from; drop --init-from {given}, "
                         "or choose another --out")
    a, b = str(given), str(recorded)
    if a == b:
        return
    prefix = next((p for p in (hfclip.PREFIX, f"{openclip.PREFIX}local-dir:") if a.startswith(p)), "")
    try:
        same = b.startswith(prefix) and Path(a[len(prefix):]).resolve() == Path(b[len(prefix):]).resolve()
    except (OSError, RuntimeError):  # a link loop: not the recorded source
        same = False
    if not same:
        raise TrainError(f"--resume: the run in {path} began from --init-from {b}, not {a}; give the same "
                         "--init-from (or none: the checkpoint holds the weights), or choose another --out")


def clip_spec(init_from, out: Path) -> str | None:
    """The clip: folder an --init-from names: clip:PATH itself, open_clip:... the CLIPModel folder it is converted
    into (OUT/open_clip-init); None for a checkpoint or an export."""
    name = "" if init_from is None else str(init_from)
    if hfclip.is_clip(name):
        return name
    return f"{hfclip.PREFIX}{out / OPEN_CLIP_DIR}" if openclip.is_open_clip(name) else None


def convert_open_clip(init_from, out: Path, rank: int) -> dict | None:
    """--init-from open_clip:...: rank 0 converts it into OUT/open_clip-init (the others wait for it); returns the
    folder's weights as init_weights reads them. None for any other --init-from."""
    if init_from is None or not openclip.is_open_clip(str(init_from)):
        return None
    error = None
    if rank == 0:
        try:
            openclip.convert(str(init_from), out / OPEN_CLIP_DIR)
        except ValueError as e:
            error = f"--init-from {e}"
    error = broadcast(error)
    if error is not None:
        raise TrainError(error)
    return hfclip.init_source(clip_spec(init_from, out))


def clip_start(cfg: Config, spec: str | None) -> Config:
    """--init-from clip:PATH (or open_clip:..., converted): the run's text and image towers become that CLIP's
    (model.text_model and model.image_model set to it); another tower in the config is a one-line ConfigError."""
    if spec is None:
        return cfg
    default = ModelConfig()
    for key in ("text_model", "image_model"):
        if getattr(cfg.model, key) not in (getattr(default, key), spec):
            raise ConfigError(f"--init-from {spec} makes the run's towers that CLIP's, and model.{key} is "
                              f"{getattr(cfg.model, key)}: leave model.{key} out")
    cfg = copy.deepcopy(cfg)
    cfg.model.text_model = spec
    cfg.model.image_model = spec
    return cfg


def deleted_by_overwrite(path: Path, out: Path) -> bool:
    """Whether `path` is, or lies in, a file that --overwrite deletes from OUT (RUN_FILES): resolved paths, so that a
    link (or a second name for OUT) pointing into the run is caught as well as its own name."""
    try:
        where = path.resolve()
        targets = [(out / name).resolve() for name in RUN_FILES]
    except (OSError, RuntimeError):  # a link loop: load says the path is not a checkpoint
        return False
    return any(where == t or t in where.parents for t in targets)


def train_device(name: str) -> torch.device:
    try:
        return resolve_device(name)
    except VlprepError as e:  # the shared resolver's one-line error
        raise TrainError(str(e)) from None


def seed_everything(seed: int, device: torch.device) -> None:
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
    # ...without filling every new tensor first (a cost on every step): that guards reads of uninitialised memory,
    # which no op here does; results do not depend on it.
    torch.utils.deterministic.fill_uninitialized_memory = False


def speed_options(cfg: Config, model, device: torch.device, use_features: bool) -> bool:
    """Apply the train.* speed options (tf32, channels_last, unpad, grad_checkpointing, compile); returns whether
    pixels go channels-last."""
    cuda = device.type == "cuda"
    if cuda:  # TF32: ~10-bit mantissa matmuls on Ampere and later, the usual trade for training speed
        on = cfg.train.tf32 != "off"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    # auto: on CUDA, and for a frozen image tower on a CPU, whose no-grad forward is faster in NHWC
    channels_last = not use_features and (cfg.train.channels_last == "on"
                                          or (cfg.train.channels_last == "auto" and (cuda or cfg.model.freeze_image)))
    if channels_last:  # NHWC convolutions are the fast path of tensor cores; only 4-D weights change layout
        model.image_encoder.to(memory_format=torch.channels_last)
    # Up to 4 groups: GRIT's and TOnICS' batches (never length-bucketed) and every ITM / MLM pass stop paying for
    # padding; a bucketed batch is one group
    # (not under train.compile=step: a batch's groups are cut from its captions' lengths, a shape per batch)
    model.set_unpad(4 if cfg.train.unpad and cfg.train.compile != "step" else 0)
    if cfg.train.grad_checkpointing:  # before compile, which traces the checkpointed forward
        model.set_grad_checkpointing(True)
    if cfg.train.compile == "towers":  # in place (nn.Module.compile), so state_dict keys and checkpoints stay the same
        model.image_encoder.compile()
        model.text_encoder.compile()
    return channels_last


def resolve_precision(cfg: Config, model, device: torch.device, ckpt: dict | None, rank: int) -> tuple[str, str]:
    """(fp32, bf16 or fp16: what train.precision means for this run, the reason in a few words). A resumed run keeps
    its checkpoint's (fp32 before the key existed). `auto`: on CUDA bf16 where the card computes it natively, else
    fp16; on a CPU with bf16 arithmetic (AVX512_BF16, AMX) bf16 when a quick check of the model's text tower finds
    it at least BF16_GAIN times faster, else fp32. Under torchrun rank 0 decides for every rank."""
    if ckpt is not None:
        p = ckpt.get("precision", "fp32")
        return p, "as the resumed run"
    asked = cfg.train.precision
    if asked == "fp32":
        return "fp32", "train.precision=fp32"
    if asked == "fp16":
        return "fp16", "train.precision=fp16" + (", slow on a CPU" if device.type == "cpu" else "")
    supported = bf16_supported(device)
    where = "CPU" if device.type == "cpu" else "device"
    if asked == "bf16":
        if not supported:
            raise TrainError(f"train.precision=bf16: this {where} has no bf16 arithmetic (a CPU needs "
                             "AVX512_BF16 or AMX, a GPU compute capability 8.0 or more), so torch would emulate "
                             f"it, slower than fp32; use {'fp16, ' if device.type == 'cuda' else ''}fp32 or auto")
        return "bf16", "train.precision=bf16"
    if device.type == "cuda":
        return ("bf16", "auto on CUDA with native bf16") if supported else ("fp16", "auto on CUDA without native bf16")
    if not supported:
        return "fp32", "auto: no bf16 arithmetic here"
    width = model.text_encoder.config.hidden_size
    if width < BF16_MIN_WIDTH:  # decided without timing: such matmuls gain nothing, and the result stays reproducible
        return "fp32", f"auto: a {width}-wide text tower is too small to gain from bf16"
    gain = broadcast(bf16_gain(model, cfg.batch_size, min(16, cfg.data.max_len)) if rank == 0 else None)
    return ("bf16" if gain >= BF16_GAIN else "fp32"), f"auto: bf16 ran {gain:.1f}x fp32 in a quick check"


def keep_freed_memory() -> bool:
    """glibc only: serve large allocations from the heap and keep freed memory in the process. By default glibc
    maps every block over 32 MB (MiniLM's word-embedding gradient is 47 MB, made anew each step) with mmap and
    returns it on free, so each step zero-fills fresh pages through page faults, a large share of a `clip` step on
    cached tokens. The cost: memory freed late in a run stays with the process. Returns whether it took effect (False off glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return False
    m_trim_threshold = -1  # glibc's malloc.h
    m_mmap_max = -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2 ** 31 - 1))


BF16_GAIN = 1.1  # auto takes bf16 on a CPU only when it is at least this much faster
BF16_MIN_WIDTH = 256  # auto keeps fp32 on a CPU for narrower text towers (the tests' tiny model is 32 wide)


def bf16_gain(model, batch: int, length: int, reps: int = 3) -> float:
    """fp32 time / bf16 time of the text tower's forward on a (batch, length) caption batch, medians of `reps`
    alternating calls after one of each (no gradient; the backward's matmuls gain alike)."""
    ids = torch.full((batch, length), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    times = {"fp32": [], "bf16": []}
    training = model.training
    model.eval()  # no dropout draws: the run's random numbers are the same whether or not the check ran
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for i in range(reps + 1):
            for p in ("fp32", "bf16"):
                t0 = time.perf_counter()
                with autocast(torch.device("cpu"), p):
                    model.encode_text(ids, mask)
                if i:
                    times[p].append(time.perf_counter() - t0)
    model.train(training)
    return statistics.median(times["fp32"]) / statistics.median(times["bf16"])




# --- the session ------------------------------------------------------------------------------------------------


@dataclass
class Session:
    """A run's pieces, ready for its first step; `cfg` is the resolved, read-only config."""

    cfg: Config
    out: Path
    device: torch.device
    rank: int
    size: int
    created_group: bool     # setup joined the torchrun process group: the run leaves it at its end
    data: TrainData
    data_sig: str           # the training data's signature (vltrain.data.shards.data_signature)
    model: torch.nn.Module
    step_fn: object         # TrainStep, or its DDP wrapper under torchrun; AccumStep for train.accum_steps > 1
    optimizer: torch.optim.Optimizer
    params: list
    generator: torch.Generator  # MLM masks and hard-negative draws
    run: Run
    state: RunState
    feed: Feed
    precision: str          # fp32, bf16 or fp16
    channels_last: bool     # pixels go channels-last
    resumed: bool
    init: dict | None = None    # --init-from's record, kept by resumes
    rows: list = field(default_factory=list)  # metrics.jsonl's rows before the resumed step
    lock: OutLock | None = None  # OUT's lock, held by rank 0 until `release`
    console: Console | None = None  # where the run reports (quiet on torchrun's other ranks or when asked)
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler (None in fp32 and bf16)

    def open_report(self) -> RunLog:
        """The loop's RunLog (metrics.jsonl, TensorBoard, progress), opened now."""
        return RunLog(self.cfg, self.out, self.rank, self.rows, self.state.step, self.device,
                      self.data.use_features, self.console)

    def close(self) -> None:
        """The feed's loader stopped and OUT released, for a caller that uses the pieces without `train`'s loop."""
        self.feed.close()
        self.release()

    def release(self) -> None:
        """Let other runs write OUT again (once; a second call does nothing). A run in object storage first uploads
        what changed since its last checkpoint (the final evaluation's rows, figures, tb/; last.pt last) and removes
        its staging folder (rank 0)."""
        remote = self.run.remote
        if remote is not None and self.rank == 0 and remote.root.exists():
            upload(remote)
            shutil.rmtree(remote.root, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()


def setup(cfg: Config, resume: bool = False, overwrite: bool = False, init_from=None, quiet: bool = False,
          batches=None) -> Session:
    """Everything before a run's first step, as `train` does it. `quiet`: print nothing (rank 0 alone prints under
    torchrun anyway); `batches`: an iterable of collated batches that stands in for the loader (one pass an epoch)."""
    # every rank builds the same model from the run seed; its own draws use a per-rank seed
    url = remote_url(cfg.out)  # a run in object storage: OUT is the staging folder, `place` its URL
    out = staging(url) if url else Path(cfg.out)
    place = Out(out, url) if url else None
    shown = redact(url) if url else str(out)
    created_group, device_name = init_from_env(cfg.device)  # torchrun: join the process group
    rank, size = world()
    console = make_console(quiet or (size > 1 and rank > 0))
    device = train_device(device_name)
    if device.type == "cpu":
        keep_freed_memory()
    check_installed(cfg.train.report_to)  # a missing extra stops the run before OUT is touched
    # OUT in a dataset or an --init-from folder: one line, nothing written
    check_out_apart(url or out, cfg.shards, init_from, cfg.eval.zeroshot_folder)
    # --resume continues OUT/last.pt, and starts the run where there is none yet (a first start and every restart
    # are one command line). Rank 0 looks, for every rank; prepare_out looks again under OUT's lock.
    last = objstore.join(url, "last.pt") if url else None
    resuming = resume and broadcast((objstore.exists(last) if url else (out / "last.pt").exists()) if rank == 0
                                    else None)
    # --init-from is read before OUT is touched: an unreadable source leaves OUT as it was
    source = init_source(init_from, out, resuming, overwrite)
    if not resuming:  # --init-from clip:PATH names the towers; an unreadable clip: folder is one line, OUT untouched
        cfg = clip_start(cfg, clip_spec(init_from, out))
        if not openclip.is_open_clip(str(init_from)):  # (an open_clip source was checked by init_source)
            resolve_towers(cfg)
    lock, resumed, removed = open_output(out, resume, overwrite, rank, place)
    if resumed != resuming:  # another process wrote or removed last.pt between the look and the lock
        if lock is not None:
            lock.release()
        where = redact(last) if url else out / "last.pt"
        raise TrainError(f"--resume: {where} {'appeared' if resumed else 'went away'} while this run started "
                         "(another process writes OUT); run the command again")
    if resume and not resuming:
        again = f" (deleted an earlier start's {', '.join(removed)})" if removed else ""
        console.print(f"--resume: no checkpoint in {shown} yet, starting the run{again}", highlight=False,
                      markup=False)
    if not resuming:
        source = convert_open_clip(init_from, out, rank) or source
    ckpt = load(out / "last.pt", "--resume checkpoint") if resuming else None
    if ckpt is not None:
        check_ranks(ckpt, out / "last.pt", size)
        if init_from is not None:
            same_init(init_from, ckpt, out / "last.pt")
    rank_seed = cfg.seed + 1_000_003 * rank
    seed_everything(cfg.seed, device)

    # --- data, then the config resolved against it (read-only from here on)
    if resuming:  # a run begun from --init-from clip:PATH finds the name in its checkpoint's record
        cfg = clip_start(cfg, clip_spec(((ckpt or {}).get("init_from") or {}).get("path"), out))
    cfg, data, notes = prepare(cfg, device, ckpt, rank, size)
    data_sig = data_signature(cfg.shards)
    if ckpt is not None:
        check_resumable(ckpt, cfg, data_sig, out / "last.pt")
    for note in notes:  # after the resume checks, whose refusal would make them moot
        console.print(note, highlight=False)
    heldout_positions(cfg, data)

    # --- model
    # a pretrained CLIP's towers are built empty when --init-from loads them anyway (not read twice)
    pretrained = source is None or clip_spec(init_from, out) is None
    model = build_model(cfg.model, pretrained) if ckpt is None else model_from(ckpt, out / "last.pt")
    init = (ckpt or {}).get("init_from")  # a resumed run keeps its record; its weights are in last.pt
    if source is not None:
        init = init_weights(model, source, init_from)
        source = None
        console.print(init_line(init), highlight=False, markup=False)
        for note in init["notes"]:
            console.print(note, highlight=False, markup=False)
    model.to(device).train()
    channels_last = speed_options(cfg, model, device, data.use_features)
    precision, why = resolve_precision(cfg, model, device, ckpt, rank)
    generator = torch.Generator(device=device).manual_seed(rank_seed)
    ddp = created_group or size > 1
    step_fn = wrap_ddp(model, cfg.loss, device) if ddp else TrainStep(model)
    if cfg.train.accum_steps > 1:  # towers in chunks; under torchrun the gradients are averaged by hand
        step_fn = AccumStep(model, cfg.train.accum_steps, step_fn if ddp else None)
    if cfg.train.compile == "step":  # the function compiled, not the model: state_dict keys stay the same
        pad = data.tokenizer.pad_token_id
        step_fn = CompiledStep(step_fn, model, cfg.data.max_len, 0 if pad is None else pad)
    if size > 1:
        seed_everything(rank_seed, device)
    # every rank draws the same global batches and reads its slice of each
    batch_sampler = RankSlice(data.sampler, rank, size) if size > 1 and data.sampler is not None else data.sampler

    # --- optimiser
    optimizer, params = build_optimizer(model, cfg.optim, device)
    # fp16 gradients underflow unscaled; bf16 has float32's exponent range and needs no scaling
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    run = Run(cfg, model, optimizer, data.sampler, generator, data_sig, out, init_from=init, precision=precision,
              scaler=scaler, remote=place)

    # --- resume (the data position is replayed: this epoch's batches already trained on are drawn again)
    state, rng = restore(ckpt, run, rank, size) if ckpt is not None else (RunState(), None)
    rows = earlier_rows(out / "metrics.jsonl", state.step) if ckpt is not None else []
    feed = Feed(data, batch_sampler, rank_seed, cfg.batch_size, cfg.data.workers, device, batches,
                prefetch=cfg.data.prefetch)
    feed.start(state)
    if ckpt is not None:
        set_rng_states(rng, generator)
        began = f"; the run began from --init-from {init['path']}" if init else ""
        console.print(f"resumed from step {state.step} of {cfg.steps} ({run.shown('last.pt')}){began}",
                      highlight=False)
    console.print(summary(cfg, model, device, data.n_train, data.n_val, data.per_epoch, size, (precision, why), ddp),
                  highlight=False, markup=False)
    return Session(cfg=cfg, out=out, device=device, rank=rank, size=size, created_group=created_group, data=data,
                   data_sig=data_sig, model=model, step_fn=step_fn, optimizer=optimizer, params=params,
                   generator=generator, run=run, state=state, feed=feed, precision=precision,
                   channels_last=channels_last, resumed=ckpt is not None, init=init, rows=rows, lock=lock,
                   console=console, scaler=scaler)

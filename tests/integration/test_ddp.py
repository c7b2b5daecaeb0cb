"""DDP: two CPU processes on gloo against one process on the global batch, and `torchrun -m vltrain run`.

The equality test spawns 2 ranks that each run `wrap_ddp(model)` (the trainer's DDP path) on half of a fixed
global batch of 8; the single process runs `train_step` on all 8. Models are in eval mode so that dropout and the
tiny CNN's BatchNorm batch statistics (per-rank by nature) are out of the comparison.

Both sides compute in float64. The test checks the DDP algorithm (what is gathered, summed and averaged), and the
two sides add the same terms in different orders (per rank, then across ranks), so in float32 they differ by
rounding that depends on the CPU's kernels: ~1e-6 on a word-embedding gradient that sums many cancelling terms,
and a parameter whose gradient is that close to zero moves by about +-lr under AdamW whichever way rounding tips
it. In float64 the same rounding is ~1e-16, so the tolerances below hold on any x86-64 CPU.
"""

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
# Before any process group exists: its functions' default `group=group.WORLD` is bound when the module is first
# imported (vltrain.distributed.gather imports it lazily), and a rank in this process (two_ranks) would bind it to
# a group that the next fixture's group replaces.
import torch.distributed.nn.functional  # noqa: F401
import torch.multiprocessing as mp
from typer.testing import CliRunner

from vltrain import step as step_mod
from vltrain.cli import app
from vltrain.config_load import load_config
from vltrain.distributed import RankSlice, gather
from vltrain.model import build_model, tokenizer_for

from tests.vltrain.test_samplers import onto  # noqa: F401  (the module-scoped TOnICS dataset fixture)
from tests.vltrain.test_train import TINY, shards  # noqa: F401  (the module-scoped shard fixture)

B = 8  # global batch; 4 per rank
CAPTIONS = [f"a {w} number {i}" for i, w in enumerate(["red", "cat", "dog", "tree", "car", "boat", "sun", "moon"])]
# clip: in-batch ITC, features gathered with gradient. momentum: ALBEF's momentum keys (gathered without
# gradient), distillation and a queue that takes the gathered keys. ITM / MLM are off because their negatives come
# from the local batch and their masks are drawn per rank (ALBEF's choice), so they are not the single-process ones.
CASES = {
    "clip": ("clip", []),
    "momentum": ("albef", ["model.fusion_layers=1", "model.queue_size=24", "loss.itm=0", "loss.mlm=0",
                           "loss.distill_warmup_steps=0"]),
    # GRIT's ITC with stop-gradient keys and the consistency loss (fusion heads at weight 0: find_unused_parameters)
    "grit": ("grit", ["model.fusion_layers=1", "loss.itm=0", "loss.mlm=0"]),
    # GRIT-VLP's ALBEFBase: no momentum model, plain in-batch ITC with features gathered with gradient
    "albef-base": ("albef-base", ["model.fusion_layers=1", "loss.itm=0", "loss.mlm=0"]),
    # BLIP's global ITM negatives (the top-1, so that no draw differs) with caption dedupe across ranks: ITM is
    # then the single-process ITM. Each rank's captions are padded to its own longest, as the collate pads them.
    "itm-global": ("albef-base", ["model.fusion_layers=1", "loss.mlm=0", "loss.itm_negatives=hardest",
                                  "loss.itm_global_negatives=true", "loss.dedupe=caption"]),
    # caption dedupe alone: ITC positives across ranks
    "dedupe": ("clip", ["loss.dedupe=caption"]),
    # SigLIP's sigmoid loss: this rank's images against every rank's texts (gathered with gradient), its bias trained;
    # with caption dedupe, duplicates within and across ranks are positive pairs
    "sigmoid": ("clip", ["loss.itc_kind=sigmoid"]),
    "sigmoid-dedupe": ("clip", ["loss.itc_kind=sigmoid", "loss.dedupe=caption"]),
}
# Duplicates within a rank (2, 3) and across ranks (1 on rank 0, 5 on rank 1), and one longer caption on rank 0.
DUPLICATES = {"itm-global": {3: CAPTIONS[2], 5: CAPTIONS[1], 0: "a red number 0 on a long white table"},
              "dedupe": {3: CAPTIONS[2], 5: CAPTIONS[1]}, "sigmoid-dedupe": {3: CAPTIONS[2], 5: CAPTIONS[1]}}


def config(case: str):
    preset, sets = CASES[case]
    return load_config(preset, sets=[s for s in TINY if not s.startswith(("log_every", "optim"))] + sets)


def global_batch(cfg, case: str) -> dict:
    captions = [DUPLICATES.get(case, {}).get(i, c) for i, c in enumerate(CAPTIONS)]
    tok = tokenizer_for(cfg.model.text_model)
    enc = tok(captions, padding="longest", truncation=True, max_length=cfg.data.max_len, return_tensors="pt")
    images = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return {"images": images, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "captions": captions}


def rank_batch(batch: dict, rank: int, size: int) -> dict:
    """This rank's rows of the global batch, its captions padded to its own longest (as the collate pads them)."""
    n = B // size
    local = {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}
    length = int(local["attention_mask"].sum(dim=1).max())
    local["input_ids"], local["attention_mask"] = local["input_ids"][:, :length], local["attention_mask"][:, :length]
    return local


ADAM_EPS = 1e-8  # AdamW's default, as the trainer uses it
RANKS_TIMEOUT = datetime.timedelta(seconds=300)  # a rank that died leaves the other waiting this long at most


def one_step(step_fn, model, batch, cfg) -> dict:
    """Forward, backward, enqueue; the ITC loss, every gradient and the queue afterwards."""
    losses = step_fn(batch, cfg.loss, torch.Generator().manual_seed(0), None, cfg.loss.distill_alpha)
    losses["total"].backward()
    if model.cfg.queue_size:
        model.dequeue_and_enqueue(*losses["queue_feats"])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    queue = (model.image_queue.clone(), int(model.queue_ptr)) if model.cfg.queue_size else None
    # then one optimiser step, as the trainer takes it (AdamW, the trainer's defaults)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                            weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas), eps=ADAM_EPS)
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    itm = float(losses["itm_loss"].detach()) if "itm_loss" in losses else None
    return {"itc": float(losses["itc_loss"].detach()), "itm": itm, "grads": grads, "queue": queue, "params": params}


def single_process(case: str) -> dict:
    cfg = config(case)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(cfg.model).eval()
        return one_step(step_mod.TrainStep(model), model, global_batch(cfg, case), cfg)
    finally:
        torch.set_default_dtype(before)


def _ranks(rank: int, size: int, init: str, folder: Path) -> None:
    """Every case on this rank, one after another in one process group (a process start per case cost ~10 s)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=RANKS_TIMEOUT)
    try:
        torch.set_default_dtype(torch.float64)
        for case in CASES:
            try:
                cfg = config(case)
                torch.manual_seed(0)  # every rank builds the same model, as train() does from the run seed
                model = build_model(cfg.model).eval()
                local = rank_batch(global_batch(cfg, case), rank, size)
                n = B // size
                out = one_step(step_mod.wrap_ddp(model, cfg.loss, torch.device("cpu")), model, local, cfg)
                order, ranked = gather(torch.arange(n) + rank * n, False)
                out["order"] = (order.tolist(), ranked.tolist())
            except Exception as e:
                e.add_note(f"case {case}, rank {rank}")
                raise
            torch.save(out, folder / f"{case}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def two_ranks(ranks, folder: Path) -> None:
    """`ranks(rank, 2, init, folder)` as rank 0 in this process and rank 1 in a spawned one: two processes in one gloo
    group, as two spawned ranks were, but one interpreter fewer starts and imports torch and transformers (~4 s
    each). This process' default dtype, RNG state and process group are as they were afterwards."""
    init = f"file://{folder / 'rdzv'}"
    child = mp.get_context("spawn").Process(target=ranks, args=(1, 2, init, folder), daemon=True)
    child.start()
    dtype = torch.get_default_dtype()
    try:
        with torch.random.fork_rng(devices=[]):
            ranks(0, 2, init, folder)
        child.join(RANKS_TIMEOUT.total_seconds())
    finally:
        torch.set_default_dtype(dtype)
        if child.is_alive():  # rank 0 failed: rank 1 waits in a collective that will not come
            child.kill()
            child.join()
    assert child.exitcode == 0, f"rank 1 exited with {child.exitcode}"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's results on ranks 0 and 1, from one pair of gloo ranks (this process and one spawned) for all
    the cases."""
    folder = tmp_path_factory.mktemp("ddp")
    two_ranks(_ranks, folder)
    return {case: [torch.load(folder / f"{case}-{r}.pt", weights_only=True) for r in (0, 1)] for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_two_gloo_ranks_equal_one_process_on_the_global_batch(case, ddp):
    ranks, one = ddp[case], single_process(case)
    # Each rank's loss is the mean over its rows against every rank's keys, so their mean is the global loss.
    assert (ranks[0]["itc"] + ranks[1]["itc"]) / 2 == pytest.approx(one["itc"], rel=1e-6, abs=1e-7)
    assert ranks[0]["itc"] != pytest.approx(ranks[1]["itc"], rel=1e-6)  # the ranks did see different rows
    if one["itm"] is not None:  # 2 x 3B/2 rows against 3B rows: the mean of the two is the global ITM loss
        assert (ranks[0]["itm"] + ranks[1]["itm"]) / 2 == pytest.approx(one["itm"], rel=1e-6, abs=1e-7)
    assert set(ranks[0]["grads"]) == set(one["grads"]) and one["grads"]
    assert all(g.dtype == torch.float64 for g in one["grads"].values())
    for name, g in one["grads"].items():
        # DDP's averaged gradient equals the single-process gradient, and it is the same on both ranks. float64
        # summation in another order: error ~ n * 1.1e-16 * sum|terms|, with n < 1e3 terms of size < 10 here.
        torch.testing.assert_close(ranks[0]["grads"][name], g, rtol=1e-9, atol=1e-11, msg=name)
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
    # One AdamW step from zero state moves p by lr * g / (|g| + eps) (+ the same decoupled decay on both sides),
    # a function of g whose slope is at most 1 / eps: the step may differ by lr * |dg| / eps where the two
    # gradients differ by dg, plus a few float64 ulps of p.
    lr, eps = config(case).optim.lr, ADAM_EPS
    for n, p in one["params"].items():
        dg = (ranks[0]["grads"][n] - one["grads"][n]).abs() if n in one["grads"] else torch.zeros_like(p)
        limit = lr * dg / eps + 4 * torch.finfo(torch.float64).eps * (p.abs() + lr)
        worst = float(((ranks[0]["params"][n] - p).abs() - limit).max())
        assert worst <= 0, f"{n}: parameters after one AdamW step differ by more than lr * |dg| / eps"
    for n, p in one["params"].items():  # and the ranks hold the same model afterwards
        assert torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]), n
    if one["queue"] is not None:  # the queue enqueued the gathered keys, in rank order, on every rank
        for r in ranks:
            torch.testing.assert_close(r["queue"][0], one["queue"][0], rtol=1e-9, atol=1e-12)
            assert r["queue"][1] == one["queue"][1] == B
    # gather: local rows first for the loss, rank order for the queue and the samplers
    assert ranks[1]["order"] == ([4, 5, 6, 7, 0, 1, 2, 3], list(range(8)))
    assert ranks[0]["order"] == (list(range(8)), list(range(8)))


def test_rank_slice_splits_each_global_batch_contiguously():
    batches = [list(range(8)), list(range(8, 16))]
    assert [list(RankSlice(batches, r, 2)) for r in (0, 1)] == [[[0, 1, 2, 3], [8, 9, 10, 11]],
                                                                [[4, 5, 6, 7], [12, 13, 14, 15]]]


def torchrun(shards, out, *args, nproc: int = 2) -> subprocess.CompletedProcess:
    sets = [x for s in TINY for x in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "vltrain", "run", str(shards), "--out", str(out), "--batch-size", "4", "--device", "cpu", *sets, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


COMMON = ["--preset", "albef", "--set", "model.fusion_layers=1", "--set", "model.queue_size=16",
          "--set", "optim.min_lr_ratio=1.0", "--set", "optim.warmup_steps=0", "--set", "data.val_frac=0.2"]


def metric_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "total" in r]


@pytest.fixture(scope="module")
def four_steps(shards, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One `torchrun --nproc_per_node=2` run of 4 steps, its folder and process (read-only: two tests check it)."""
    out = tmp_path_factory.mktemp("four") / "full"
    return out, torchrun(shards, out, *COMMON, "--steps", "4")


def test_torchrun_two_processes_train_and_write_one_checkpoint(four_steps):
    """`torchrun --nproc_per_node=2 -m vltrain run`: rank 0 writes one checkpoint holding both ranks' states, and
    alone logs and reports."""
    full, r = four_steps
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ckpt = torch.load(full / "last.pt", weights_only=True)
    assert ckpt["step"] == 4 and len(ckpt["ranks"]) == 2
    assert not torch.equal(ckpt["ranks"][0]["rng"]["generator"], ckpt["ranks"][1]["rng"]["generator"])
    assert sorted(p.name for p in full.glob("*.pt*")) == ["best.pt", "last.pt"]
    assert [r["step"] for r in metric_rows(full)] == [1, 2, 3, 4]  # rank 0 alone logs
    assert r.stderr.count("vltrain run: preset albef") == 1  # and reports
    assert json.loads((full / "result.json").read_text())["step"] == 4


def test_torchrun_one_process_trains_through_ddp_as_a_plain_run_does(shards, tmp_path):
    """`torchrun --nproc_per_node=1` joins a process group and wraps the step in DDP (the path a one-GPU check
    exercises on NCCL), and its losses are a plain run's bit for bit: DDP's all-reduce over one rank averages one
    gradient (a division by 1), and both runs use one intra-op thread, so their kernels add alike."""
    r = torchrun(shards, tmp_path / "ddp", *COMMON, "--steps", "3", nproc=1)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "x 1 process (DDP, global batch 4)" in r.stderr
    # The plain run in this process (the process boundary is not the claim), with the worker's one thread.
    sets = [x for s in TINY for x in ("--set", s)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = CliRunner().invoke(app, ["run", str(shards), "--out", str(tmp_path / "plain"), "--batch-size", "4",
                                         "--device", "cpu", *sets, *COMMON, "--steps", "3"])
    finally:
        torch.set_num_threads(threads)
    assert plain.exit_code == 0, plain.output[-4000:]
    assert "vltrain run: preset albef" in plain.output and "DDP" not in plain.output
    ddp_rows = metric_rows(tmp_path / "ddp")
    plain_rows = metric_rows(tmp_path / "plain")
    assert [r["step"] for r in ddp_rows] == [1, 2, 3]
    for key in ("total", "itc_loss", "itm_loss", "mlm_loss"):
        assert [r[key] for r in ddp_rows] == [r[key] for r in plain_rows], key


def test_torchrun_grit_groups_across_ranks(shards, tmp_path):
    """GRIT under torchrun: the grouped epochs (built from features gathered over both ranks) run to the end."""
    r = torchrun(shards, tmp_path / "grit", "--preset", "grit", "--set", "model.fusion_layers=1", "--set",
                 "data.val_frac=0.2", "--steps", "6")
    assert r.returncode == 0, r.stderr[-4000:]
    ckpt = torch.load(tmp_path / "grit" / "last.pt", weights_only=True)
    # ~19 training pairs make 2 global batches of 8 an epoch: epochs 1 and 2 were grouped from collected features
    assert (ckpt["step"], ckpt["epoch"]) == (6, 2) and len(ckpt["ranks"]) == 2


def test_torchrun_tonics_runs_its_curriculum_checks_on_rank_0(onto, tmp_path):
    """TOnICS under torchrun: same-object global batches of 2 x 4 split over the ranks, the held-out checks run on
    rank 0 (threshold 0: every check refreshes) and their decisions are broadcast without a hang."""
    common = ["--preset", "tonics", "--set", "sampler.refresh_every=3", "--set", "sampler.threshold=0",
              "--set", "data.val_frac=0.25", "--set", "eval_every=100"]
    r = torchrun(onto, tmp_path / "full", *common, "--steps", "6")
    assert r.returncode == 0, r.stderr[-4000:]
    log = json.loads((tmp_path / "full" / "curriculum.json").read_text())
    assert [row["step"] for row in log["log"]] == [3, 6] and log["log"][-1]["probs"][0] == pytest.approx(0.81)
    ckpt = torch.load(tmp_path / "full" / "last.pt", weights_only=True)
    assert len(ckpt["ranks"]) == 2 and len(ckpt["curriculum_log"]) == 2


def _worker_of_rank(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker process with RANK=rank (read from /proc)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc")
def test_sigterm_to_one_rank_saves_a_resumable_checkpoint_and_nobody_hangs(shards, tmp_path):
    sets = [x for s in TINY for x in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vltrain",
           "run", str(shards), "--out", str(out), "--batch-size", "4", "--device", "cpu", *sets, *COMMON,
           "--steps", "100000", "--set", "ckpt_every=100000", "--set", "eval_every=100000"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and len(metric_rows(out)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        worker = _worker_of_rank(proc.pid, 1)
        assert worker is not None
        os.kill(worker, signal.SIGTERM)  # rank 1 only
        _, err = proc.communicate(timeout=120)  # rank 0 must not wait forever for rank 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "--resume to continue" in err
    step = torch.load(out / "last.pt", weights_only=True)["step"]
    assert step >= 2
    r = torchrun(shards, out, *COMMON, "--steps", str(step + 1), "--resume")
    assert r.returncode == 0, r.stderr[-4000:]
    assert torch.load(out / "last.pt", weights_only=True)["step"] == step + 1


def test_a_loader_fault_on_one_rank_stops_every_rank_with_its_error(shards, tmp_path):
    """A damaged shard read by one rank only: that rank reports the shard in one line and the other stops at the
    same step ("another process failed") instead of waiting in the next collective until torchrun's timeout."""
    import shutil

    from tests.vlprep.test_safety import corrupt_header

    damaged = tmp_path / "ds"
    shutil.copytree(shards, damaged)
    corrupt_header(damaged / "shard-000002.tar", 1)
    t0 = time.monotonic()
    r = torchrun(damaged, tmp_path / "run", *COMMON, "--steps", "200", "--set", "data.workers=0")
    assert r.returncode != 0
    assert time.monotonic() - t0 < 120
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    # one line, from the failing rank (rank 0 prints it), not "another process failed" from the other as well
    assert len(errors) == 1 and re.match(r"error: rank [01]: .*shard-000002.tar: the tar holds 1 samples", errors[0]
                                         ), r.stderr[-3000:]


def test_an_empty_epoch_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """Shards of 9 and 3 pairs: the rank that reads the 3 has no batch of 4, and says so once; nobody waits."""
    from tests.conftest import colour_pairs

    uneven = colour_pairs(tmp_path / "uneven", 12, per_shard=9)
    t0 = time.monotonic()
    r = torchrun(uneven, tmp_path / "run", "--preset", "clip", "--steps", "20")
    assert r.returncode != 0 and time.monotonic() - t0 < 120
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.match(r"error: rank [01]: epoch 0 gave this process \(rank [01]\) no batch of 4",
                                         errors[0]), r.stderr[-3000:]


def test_a_config_error_under_torchrun_is_printed_once(shards, tmp_path):
    """Every rank refuses the same option; the job says so in one line, not one line per process."""
    r = torchrun(shards, tmp_path / "run", "--set", "optim.lr=-1", "--steps", "2")
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: optim.lr=-1.0 is outside its range [0, inf) (peak learning rate; 0 keeps the weights "
                      "(a frozen check run))"], r.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_resume_continues_exactly(shards, four_steps, tmp_path):
    """Under torchrun, 4 steps and 2 + 2 with --resume give the same losses bit for bit (each rank restores its
    own RNG states and data position); a resume with another process count is a one-line error.

    The other count is one plain process, run in this one: the refusal compares the checkpoint's ranks with this
    run's world size, which is 1 whether torchrun started one process or nobody did, so the process boundary is not
    the claim (a torchrun launch cost ~10 s)."""
    full, r = four_steps
    assert r.returncode == 0, r.stderr[-4000:]
    r = torchrun(shards, tmp_path / "part", *COMMON, "--steps", "2")
    assert r.returncode == 0, r.stderr[-4000:]
    r = torchrun(shards, tmp_path / "part", *COMMON, "--steps", "4", "--resume")
    assert r.returncode == 0, r.stderr[-4000:]
    full, part = metric_rows(full), metric_rows(tmp_path / "part")
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    for key in ("total", "itc_loss", "itm_loss", "mlm_loss"):
        assert [r[key] for r in part] == [r[key] for r in full], key  # bit for bit

    sets = [x for s in TINY for x in ("--set", s)]
    r = CliRunner().invoke(app, ["run", str(shards), "--out", str(tmp_path / "part"), "--batch-size", "4", "--device",
                                 "cpu", *sets, *COMMON, "--steps", "6", "--resume"])
    assert r.exit_code == 2 and "written by 2 process(es) and this run has 1" in r.output, r.output[-3000:]
    assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1, r.output[-3000:]


def test_grit_ranks_read_slices_of_the_single_process_order():
    """GRIT under DDP: each rank's sampler (same seed) draws the single-process global batches of N x 2 and reads
    its half; collecting the gathered global batch keeps every rank's next grouped epoch the same as one process'."""
    from vltrain.samplers import GritSampler

    def sampler():
        return GritSampler(64, 16, 32, 64, seed=3)  # global batch 16 = 2 ranks x 8

    one, ranks = sampler(), [sampler(), sampler()]
    g = torch.Generator().manual_seed(0)
    for epoch in range(2):
        for s in (one, *ranks):
            s.set_epoch(epoch)
        single = list(one)
        sliced = [list(RankSlice(s, r, 2)) for r, s in enumerate(ranks)]
        assert [a + b for a, b in zip(*sliced)] == [list(b) for b in single]
        assert all(len(b) == 8 for b in sliced[0])
        for batch in single:  # the trainer collects the global batch, gathered in rank order, on every rank
            img = torch.nn.functional.normalize(torch.randn(16, 4, generator=g), dim=-1)
            txt = torch.nn.functional.normalize(torch.randn(16, 4, generator=g), dim=-1)
            for s in (one, *ranks):
                s.collect(torch.as_tensor(batch), img, txt)
    assert epoch == 1 and single != [list(b) for b in sampler()]  # epoch 1 was grouped, not the first permutation

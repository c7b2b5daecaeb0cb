"""torchrun beyond one node: two launchers joined by a c10d rendezvous, and a run that torchrun restarts by itself.

Two "nodes" here are two torchrun launchers on this machine (`--nnodes 2 --nproc_per_node 1`, node ranks 0 and 1,
gloo), meeting at a c10d rendezvous on a free local port; they see OUT as nodes on a shared filesystem would. The
restart test is torchrun's own recovery: `--max-restarts 1`, one rank's worker killed with SIGKILL mid-run, every
rank started again, and the same `--resume` command line continuing from OUT/last.pt.

Both compare metrics.jsonl losses bit for bit with one uninterrupted `torchrun --standalone --nproc_per_node 2` run
of the same steps (test_ddp.py's albef tiny config): the same two ranks, each with its own RNG seed and data slice,
and one intra-op thread each, compute the same numbers whichever launcher started them and however often they were
restarted from a checkpoint (test_ddp's `test_torchrun_resume_continues_exactly` shows the resume part).
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.integration.test_ddp import COMMON, _worker_of_rank, metric_rows, torchrun
from tests.vltrain.test_train import TINY, shards  # noqa: F401  (the module-scoped shard fixture)

pytestmark = pytest.mark.slow

STEPS = 40  # enough that the restart test kills a rank mid-run (a step takes ~0.1-0.3 s here), cheap for the rest
KEYS = ("total", "itc_loss", "itm_loss", "mlm_loss")
EVERY_STEP = ["--set", "ckpt_every=1"]  # last.pt at every step: the restart loses no step it logged


def run_args(shards, out) -> list[str]:  # noqa: F811
    """`-m vltrain run ...` as test_ddp's torchrun helper gives it, with the run's STEPS."""
    sets = [x for s in TINY for x in ("--set", s)]
    return ["-m", "vltrain", "run", str(shards), "--out", str(out), "--batch-size", "4", "--device", "cpu", *sets,
            *COMMON, "--steps", str(STEPS)]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs: list[subprocess.Popen]) -> None:
    """Each launcher and everything it started (its own process group) killed and waited for, if still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> Path:  # noqa: F811
    """One uninterrupted `torchrun --standalone --nproc_per_node 2` run of STEPS steps, last.pt at every step (as
    the restart test runs it; checkpoints change no number), its folder."""
    out = tmp_path_factory.mktemp("multinode") / "reference"
    r = torchrun(shards, out, *COMMON, "--steps", str(STEPS), *EVERY_STEP)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [row["step"] for row in metric_rows(out)] == list(range(1, STEPS + 1))
    return out


def test_two_launchers_with_c10d_rendezvous_train_as_two_local_processes(shards, reference, tmp_path):  # noqa: F811
    """`torchrun --nnodes 2 --nproc_per_node 1 --node-rank 0|1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT`, one
    launcher per node: a process group across the launchers, one checkpoint holding both ranks' states, rank 0
    alone logging, and the losses of the two-process standalone run bit for bit."""
    out = tmp_path / "run"
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    procs = []
    try:
        for node in (0, 1):  # node 0 hosts the rendezvous store; node 1 only connects to it (is_host)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                   *run_args(shards, out), *EVERY_STEP]
            procs.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        stop(procs)
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    errs = [err for _, err in results]
    assert sum(e.count("vltrain run: preset albef") for e in errs) == 1  # rank 0 alone reports, on one launcher
    assert sum("x 2 processes (DDP, global batch 8)" in e for e in errs) == 1, errs[0][-2000:] + errs[1][-2000:]
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["step"] == STEPS and len(ckpt["ranks"]) == 2
    rows, ref = metric_rows(out), metric_rows(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in KEYS:
        assert [r[key] for r in rows] == [r[key] for r in ref], key  # bit for bit


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc")
def test_torchrun_restarts_a_killed_rank_and_the_run_continues_from_last_pt(shards, reference, tmp_path):  # noqa: F811
    """`torchrun --standalone --nproc_per_node 2 --max-restarts 1 -m vltrain run ... --resume`: the first start finds
    no checkpoint and starts the run; rank 1's worker killed with SIGKILL once last.pt holds step 2 or later makes
    torchrun stop rank 0 and start both again, the same command line resumes OUT/last.pt, and the run ends 0 with
    every step logged once and the uninterrupted run's losses bit for bit (from the checkpoint on included)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "1", *run_args(shards, out), *EVERY_STEP, "--resume"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # a row for step 3 is written after last.pt of step 2 (the loop saves, then takes the next step)
        while not ((out / "metrics.jsonl").exists() and len(metric_rows(out)) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        worker = _worker_of_rank(proc.pid, 1)
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        stop([proc])
    assert proc.returncode == 0, err[-6000:]
    assert f"--resume: no checkpoint in {out} yet, starting the run" in err  # the first start
    resumed = [ln for ln in err.splitlines() if ln.startswith("resumed from step")]
    assert len(resumed) == 1, err[-6000:]  # the restart
    step = int(resumed[0].split()[3])
    assert 2 <= step < STEPS, resumed[0]
    assert torch.load(out / "last.pt", weights_only=True)["step"] == STEPS
    rows, ref = metric_rows(out), metric_rows(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once: the lost ones redone
    for key in KEYS:
        assert [r[key] for r in rows] == [r[key] for r in ref], key  # bit for bit

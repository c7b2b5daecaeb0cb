"""train.accum_steps under DDP: two gloo ranks with K = 2 against two gloo ranks with K = 1 (the trainer's DDP path).

As tests/integration/test_ddp.py: float64, models in eval mode (no dropout), the same global batch of 8 split 4 + 4.
K = 2 runs the towers on 2 rows at a time on each rank and averages the gradients over the ranks by hand; the
losses, gradients and parameters after one AdamW step must be K = 1's up to float64 rounding (the tolerances of
tests/vltrain/test_accum.py: REL = 1e-10 of a gradient plus ATOL = 1e-12, and lr * ATOL-or-REL-sized gradient
differences / eps for the AdamW step).
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integration.test_ddp import (ADAM_EPS, B, COMMON, RANKS_TIMEOUT, config, global_batch, metric_rows,
                                       rank_batch, torchrun, two_ranks)
from tests.vltrain.test_train import shards  # noqa: F401  (the module-scoped shard fixture)
from vltrain.accum import AccumStep
from vltrain.model import build_model
from vltrain.optim import build_optimizer, optimizer_step
from vltrain.step import wrap_ddp

REL = 1e-10
ATOL = 1e-12


CASES = ["clip", "momentum"]


def _ranks(rank: int, size: int, init: str, folder: Path) -> None:
    """Every case with K = 1 and K = 2 on this rank, in one process group (a process start per run cost ~10 s)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=RANKS_TIMEOUT)
    try:
        torch.set_default_dtype(torch.float64)
        for case in CASES:
            for k in (1, 2):
                try:
                    cfg = config(case)
                    torch.manual_seed(0)
                    model = build_model(cfg.model).eval()
                    local = rank_batch(global_batch(cfg, case), rank, size)
                    cpu = torch.device("cpu")
                    ddp = wrap_ddp(model, cfg.loss, cpu)
                    optimizer, params = build_optimizer(model, cfg.optim, cpu)
                    step = ddp if k == 1 else AccumStep(model, k, ddp)
                    update = optimizer_step if k == 1 else step.optimizer_step
                    losses = step(local, cfg.loss, torch.Generator().manual_seed(0), None, cfg.loss.distill_alpha)
                    update(model, optimizer, params, losses["total"], 0.0, losses.pop("queue_feats"))
                except Exception as e:
                    e.add_note(f"case {case}, K = {k}, rank {rank}")
                    raise
                grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                torch.save({"total": float(losses["total"].detach()), "grads": grads,
                            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                            "queue_ptr": int(model.queue_ptr) if model.cfg.queue_size else None},
                           folder / f"{case}-{k}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each case's results by (K, rank), from one pair of gloo ranks (this process and one spawned:
    tests.integration.test_ddp.two_ranks) for every case and K."""
    folder = tmp_path_factory.mktemp("accum")
    two_ranks(_ranks, folder)
    return {case: {(k, r): torch.load(folder / f"{case}-{k}-{r}.pt", weights_only=True)
                   for k in (1, 2) for r in (0, 1)} for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_two_gloo_ranks_with_accum_steps_2_equal_accum_steps_1(case, runs):
    results = runs[case]
    lr = config(case).optim.lr
    for rank in (0, 1):
        one = results[(1, rank)]
        two = results[(2, rank)]
        assert two["total"] == pytest.approx(one["total"], rel=REL)
        assert set(two["grads"]) == set(one["grads"]) and one["grads"]
        for n, g in one["grads"].items():
            assert float((two["grads"][n] - g).abs().max()) <= REL * float(g.abs().max()) + ATOL, n
        for n, p in one["params"].items():
            dg = REL * float(one["grads"][n].abs().max()) + ATOL if n in one["grads"] else 0.0
            assert float((two["params"][n] - p).abs().max()) <= lr * dg / ADAM_EPS + 1e-15, n
        assert two["queue_ptr"] == one["queue_ptr"] and one["queue_ptr"] in (None, B)
    for n, p in results[(2, 0)]["params"].items():  # the ranks hold the same model afterwards
        assert torch.equal(p, results[(2, 1)]["params"][n]), n


def test_torchrun_trains_with_accum_steps(shards, tmp_path):  # noqa: F811
    """`torchrun -m vltrain run --set train.accum_steps=2`: the trainer's wiring under DDP runs to the end."""
    r = torchrun(shards, tmp_path / "accum", *COMMON, "--set", "train.accum_steps=2", "--steps", "3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert [row["step"] for row in metric_rows(tmp_path / "accum")] == [1, 2, 3]

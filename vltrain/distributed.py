"""torchrun / DDP plumbing: process-group set-up from the env vars, feature gathers, the rank's slice of a batch.

A plain `vltrain run` never initialises a process group, and every helper here is then the identity (world size 1),
so single-process training runs exactly the code it ran before DDP existed.
"""

import datetime
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from vltrain.errors import TrainError

ERROR_WAIT = 2.0  # seconds rank 0 waits for the other ranks' errors before it prints them (below)


def world() -> tuple[int, int]:
    """(rank, world size): (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str) -> tuple[bool, str]:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU) when launched by torchrun, one process included,
    so that `torchrun --nproc_per_node=1` runs the same DDP path as N processes do; returns (whether this call
    created the group, the device this rank trains on). A plain `vltrain run` (no WORLD_SIZE) joins nothing."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "TORCHELASTIC_RUN_ID" in os.environ  # torchrun sets it for every process it starts
    if (size <= 1 and not launched) or dist.is_initialized():
        return False, device
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise TrainError(f"WORLD_SIZE={size} but RANK / MASTER_ADDR are not set: launch with `torchrun "
                         "--nproc_per_node=N -m vltrain run ...`")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        if device.startswith("cuda:"):
            raise TrainError(f"--device {device}: under torchrun each process takes the GPU of its LOCAL_RANK; "
                             "give --device cuda (or auto)")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    store = attempt_store()
    if store is None:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=int(os.environ["RANK"]), world_size=size)
    return True, device


def attempt_store():
    """The process group's store under torchrun: the agent's store under a prefix of this restart, or None where
    torchrun gives each restart a store of its own (env:// then finds it).

    torchrun's agent keeps one key-value store for the whole job (it shares its rendezvous store with the ranks, as
    torch does by default now) and env:// uses it without a per-restart prefix, so after `--max-restarts` restarted
    the ranks the store still holds the failed attempt's keys: gloo's full-mesh connect (NCCL's unique id alike)
    can read a dead rank's address and then waits on it or fails ("Connection refused"; 3 of 5 restarts here, none
    of 5 with the prefix). A prefix per TORCHELASTIC_RESTART_COUNT keeps each attempt's keys apart, as torchrun's
    own env:// did before the store was shared."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=default_pg_timeout)
    return dist.PrefixStore(f"vltrain/attempt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def gather(x: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (B, ...) rows -> (local rows first, then the other ranks' in rank order; all in rank order).

    grad=True gathers with autograd (the other ranks' rows pass their gradient back to where they came from);
    grad=False is ALBEF's concat_all_gather (momentum keys, queue entries, sampler positions).
    """
    rank, size = world()
    if size == 1:
        return x, x
    if grad:
        import torch.distributed.nn.functional as dist_fn

        # Deprecated in favour of _functional_collectives.all_gather_tensor_autograd, whose backward is a
        # reduce-scatter that gloo lacks (it aborts the process here); this one falls back to all-to-all on gloo.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            parts = list(dist_fn.all_gather(x))
        parts[rank] = x  # the local rows keep their own graph; the others' gradients go back through the gather
    else:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.detach().contiguous())
    return torch.cat([parts[rank]] + parts[:rank] + parts[rank + 1:]), torch.cat(parts)


def any_flags(flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over the ranks (one all-reduce), so that every rank stops or saves at the same step."""
    if world()[1] == 1:
        return flags
    t = torch.tensor([float(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def max_over_ranks(n: int) -> int:
    """The largest of every rank's `n` (one all-reduce); `n` outside torchrun."""
    if world()[1] == 1:
        return n
    t = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (all_gather_object); [obj] outside torchrun."""
    size = world()[1]
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's picklable `obj` on every rank."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


class RankSlice:
    """This rank's contiguous slice of each global batch of an index batch sampler (every rank builds the same
    global order from the same seed); set_epoch, state and the samplers' own methods pass through."""

    def __init__(self, sampler, rank: int, size: int):
        self.sampler, self.rank, self.size = sampler, rank, size

    def __iter__(self):
        for batch in self.sampler:
            n = len(batch) // self.size
            yield batch[self.rank * n:(self.rank + 1) * n]

    def __len__(self):
        return len(self.sampler)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def _launcher_store():
    """torchrun's own key-value store (its agent keeps it, so it outlives any rank), under a prefix of this run's id
    and restart; None outside torchrun or when it cannot be reached."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=2 * ERROR_WAIT))
        prefix = f"vltrain/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
        return dist.PrefixStore(prefix, store)
    except (RuntimeError, ValueError, KeyError, OSError):
        return None


def report_error(message: str, echo: Callable[[str], None], peer: bool = False) -> None:
    """`echo(message)` once per torchrun job, not once per rank.

    Every failing rank posts its line to torchrun's store. Rank 0 waits up to ERROR_WAIT s for the other ranks' lines
    and echoes each distinct one once, in rank order: a line that not every rank posted is prefixed with the rank it
    came from, and `peer` lines ("another process failed") are left out when a rank posted its own error. Another
    rank echoes its own line only when rank 0 has not said within twice that wait that it echoed them (rank 0 is
    then busy or hung elsewhere, and torchrun is about to stop it). Outside torchrun: `echo(message)`."""
    store = _launcher_store()
    if store is None:
        echo(message)
        return
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    try:
        store.set(f"error/{rank}", ("peer:" if peer else "own:") + message)
        if rank > 0:
            store.wait(["error/echoed"], datetime.timedelta(seconds=2 * ERROR_WAIT))
            return
        keys = [f"error/{r}" for r in range(size)]
        deadline = time.monotonic() + ERROR_WAIT
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        posted = [(r, store.get(k).decode()) for r, k in enumerate(keys) if store.check([k])]
    except (RuntimeError, OSError):  # the store went away, or rank 0 never echoed: say it here
        echo(message if rank == 0 else f"rank {rank}: {message}")
        return
    own = [(r, m.partition(":")[2]) for r, m in posted if m.startswith("own:")]
    lines = own or [(r, m.partition(":")[2]) for r, m in posted]
    ranks_of: dict[str, list[int]] = {}
    for r, m in lines:
        ranks_of.setdefault(m, []).append(r)
    for m, ranks in ranks_of.items():
        everyone = len(ranks) == size
        echo(m if everyone else f"rank {', '.join(map(str, ranks))}: {m}")
    store.set("error/echoed", "1")

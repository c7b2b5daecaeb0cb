"""`vltrain.distributed.attempt_store`: under torchrun each restart's process group keeps its keys apart in the
agent's one store, so a restarted rank never reads the failed attempt's addresses (docs/TRAINING.md, "Several nodes,
and runs that restart by themselves")."""

import datetime

import torch.distributed as dist

from vltrain.distributed import attempt_store


def test_each_restart_reads_only_its_own_keys(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_store()
    first.set("rank_0", "the failed attempt's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = attempt_store()
    assert not again.check(["rank_0"])  # the restart waits for its own rank 0's key, not the dead one's
    again.set("rank_0", "the restart's address")
    assert first.get("rank_0") == b"the failed attempt's address" and again.get("rank_0") == b"the restart's address"
    # a torchrun whose restarts get stores of their own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): env:// as before
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_store() is None

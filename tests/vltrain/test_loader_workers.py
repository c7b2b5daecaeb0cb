"""data.workers auto from the node (the CPUs this process may use, shared by torchrun's local ranks) and
data.prefetch (the DataLoader's prefetch_factor): the rule, the note a run prints, and the range checks."""

import re

import pytest
import torch

from tests.conftest import colour_pairs
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.data.feed import Feed, make_loader
from vltrain.resolve import DataFacts, auto_workers, resolve
from vltrain.trainset import prepare

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.max_len=16", "data.val_frac=0", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("workers"), 16, per_shard=4)


def expected(cpus: int, ranks: int) -> int:
    """The rule re-derived by hand: each rank's share of the CPUs, one kept for the rank itself, 1..16."""
    share = cpus // ranks - 1
    if share < 1:
        return 1
    return 16 if share > 16 else share


@pytest.mark.parametrize("ranks", [1, 2, 8])
@pytest.mark.parametrize("cpus", [1, 4, 64, 128])
def test_auto_workers_share_the_cpus_between_the_local_ranks(cpus, ranks):
    for device in ("cuda", "cpu"):
        for kind in ("pixels", "features") if device == "cuda" else ("pixels",):
            workers, note = auto_workers(cpus, ranks, kind, device)
            assert workers == expected(cpus, ranks), (cpus, ranks, device, kind)
            assert note.startswith(f"note: data.workers auto: {workers} ({cpus} CPUs for this process / {ranks} "
                                   f"local rank{'s' if ranks > 1 else ''} - 1 for the main process")
    assert auto_workers(cpus, ranks, "features", "cpu")[0] == 0  # cached tokens on a CPU: the main process loads


def test_the_note_says_when_the_cap_or_the_floor_decided():
    assert auto_workers(8, 1, "pixels", "cuda")[1] == ("note: data.workers auto: 7 (8 CPUs for this process / 1 "
                                                       "local rank - 1 for the main process)")
    assert auto_workers(128, 1, "pixels", "cuda")[1].endswith("- 1 for the main process, capped at 16)")
    assert auto_workers(4, 8, "pixels", "cuda")[1].endswith("- 1 for the main process, at least 1)")
    assert auto_workers(17, 1, "pixels", "cuda")[1].endswith("- 1 for the main process)")  # exactly 16: no cap said


@pytest.mark.parametrize("cpus,ranks", [(64, 8), (4, 1), (128, 2), (1, 1)])
def test_resolve_reads_the_affinity_set_and_local_world_size(monkeypatch, cpus, ranks):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    cfg = load_config("clip", shards=["unused"], batch_size=8)
    pixels = DataFacts(features=None, n_train=800, per_epoch=100)
    resolved, notes = resolve(cfg, torch.device("cpu"), pixels)
    assert resolved.data.workers == expected(cpus, ranks)
    assert [n for n in notes if "data.workers" in n] == [auto_workers(cpus, ranks, "pixels", "cpu")[1]]
    features = DataFacts(features={"dim": 64, "encoder": "tiny"}, n_train=800, per_epoch=100)
    assert resolve(cfg, torch.device("cpu"), features)[0].data.workers == 0
    assert resolve(cfg, torch.device("cuda"), features)[0].data.workers == expected(cpus, ranks)


def test_without_torchrun_one_rank_has_the_node(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config("clip", shards=["unused"], batch_size=8)
    assert resolve(cfg, torch.device("cpu"), DataFacts(None, 800, 100))[0].data.workers == 11


def test_fit_workers_still_lowers_the_auto_choice(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = load_config("clip", shards=["unused"], batch_size=8)
    resolved, notes = resolve(cfg, torch.device("cpu"), DataFacts(None, 800, 100, streamed=(800, 5)))
    assert resolved.data.workers == 5
    assert notes[:2] == [auto_workers(64, 1, "pixels", "cpu")[1],
                         "warning: data.workers 16 -> 5: the data has 5 shard(s), one worker's share at most"]


def test_an_explicit_worker_count_is_kept_without_a_note(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    cfg = load_config("clip", sets=["data.workers=3"], shards=["unused"], batch_size=8)
    resolved, notes = resolve(cfg, torch.device("cpu"), DataFacts(None, 800, 100))
    assert resolved.data.workers == 3 and not [n for n in notes if "data.workers" in n]


def test_a_run_is_told_the_workers_it_chose(pairs, monkeypatch):
    """prepare's notes are what `vltrain run` prints before its first step (session.setup prints each)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = load_config("clip", None, TINY, shards=[str(pairs)], steps=1, batch_size=4, device="cpu")
    resolved, _, notes = prepare(cfg, torch.device("cpu"))
    assert resolved.data.workers == 2
    assert "note: data.workers auto: 2 (3 CPUs for this process / 1 local rank - 1 for the main process)" in notes


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i])


@pytest.mark.parametrize("workers,prefetch,factor", [(2, 4, 4), (1, 1, 1), (2, -1, 2), (0, -1, None), (0, 3, None)])
def test_prefetch_reaches_the_dataloader(workers, prefetch, factor):
    loader = make_loader(0, Numbers(), None, torch.utils.data.default_collate, 4, workers, torch.device("cpu"),
                         prefetch)
    # -1 leaves torch its default (2 batches a worker); without workers torch takes no prefetch_factor at all
    assert loader.prefetch_factor == factor and loader.num_workers == workers


def test_the_feed_hands_prefetch_to_its_loader():
    class Data:
        train, collate = Numbers(), staticmethod(torch.utils.data.default_collate)

    Data.train.set_epoch = lambda epoch: None
    feed = Feed(Data(), None, 0, 4, 1, torch.device("cpu"), prefetch=3)
    feed._open(0)
    try:
        assert feed.loader.prefetch_factor == 3
        assert sorted(int(x) for b in feed.batches for x in b) == list(range(8))
    finally:
        feed.close()


def test_prefetch_without_workers_is_ignored_with_a_note():
    cfg = load_config("clip", sets=["data.workers=0", "data.prefetch=4"], shards=["unused"], batch_size=8)
    resolved, notes = resolve(cfg, torch.device("cpu"), DataFacts(None, 800, 100))
    assert resolved.data.prefetch == 4 and resolved.data.workers == 0
    assert ("note: data.prefetch 4 is ignored: data.workers is 0 (batches are loaded in the main process when the "
            "step asks)") in notes
    cfg = load_config("clip", sets=["data.workers=2", "data.prefetch=4"], shards=["unused"], batch_size=8)
    assert not [n for n in resolve(cfg, torch.device("cpu"), DataFacts(None, 800, 100))[1] if "prefetch" in n]


@pytest.mark.parametrize("key,value", [("data.prefetch", -2), ("data.workers", -2), ("data.prefetch", 1.5)])
def test_out_of_range_loader_keys_are_one_line(key, value):
    with pytest.raises(ConfigError) as e:
        load_config("clip", sets=[f"{key}={value}"])
    assert "\n" not in str(e.value) and str(e.value).startswith(key), str(e.value)


def test_prefetch_zero_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=re.escape("data.prefetch=0 would have the loader workers prepare no "
                                                    "batch; give the batches each worker prepares ahead (>= 1), or "
                                                    "-1 for torch's default (2)") + "$"):
        load_config("clip", sets=["data.prefetch=0"])
    assert load_config("clip", sets=["data.prefetch=8"]).data.prefetch == 8
    assert load_config("clip").data.prefetch == -1

"""`resolve` and `setup`: the run's config is resolved once into a new, read-only config, and every preset trains
from the Session that setup builds."""

import dataclasses

import pytest
import torch

from tests.conftest import ontology_dataset
from vltrain.config import PRESETS
from vltrain.config_load import load_config
from vltrain.resolve import DataFacts, resolve
from vltrain.session import setup
from vltrain.train import train

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=16", "data.val_frac=0.25", "eval_every=3", "ckpt_every=3", "optim.warmup_steps=1"]
PER_PRESET = {  # the tiny BERT has 2 layers: split 1 + 1; queues and GRIT's search space sized for 36 pairs
    "albef": ["model.fusion_layers=1", "model.queue_size=16"],
    "albef-base": ["model.fusion_layers=1"],
    "grit": ["model.fusion_layers=1", "sampler.search_space=8", "sampler.queue_size=16"],
    "tonics": ["sampler.refresh_every=2", "sampler.threshold=0"],
    "tonics-ir": ["sampler.refresh_every=2", "sampler.threshold=0"],
    "fistful": ["model.queue_size=16"],
    "softmask": ["model.fusion_layers=1", "model.queue_size=16"],
}


@pytest.fixture(scope="module")
def onto(tmp_path_factory):
    return ontology_dataset(tmp_path_factory.mktemp("session"))


def assignments(cfg) -> list:
    """One assignment to the top level and one to every section of cfg, each as a callable."""
    sections = [f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
    out = [lambda: setattr(cfg, "steps", 7)]
    for name in sections:
        section = getattr(cfg, name)
        key = dataclasses.fields(section)[0].name
        out.append(lambda s=section, k=key: setattr(s, k, getattr(s, k)))
    return out


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_from_a_resolved_read_only_config(onto, tmp_path, preset):
    cfg = load_config(preset, None, TINY + PER_PRESET.get(preset, []), shards=[str(onto)], out=str(tmp_path / "run"),
                      steps=3, batch_size=4, device="cpu")
    asked = dataclasses.asdict(cfg)
    s = setup(cfg, quiet=True)
    s.close()
    for assign in assignments(s.cfg):
        with pytest.raises(dataclasses.FrozenInstanceError):
            assign()
    assert dataclasses.asdict(cfg) == asked  # the caller's config is left as it was
    r = s.cfg
    assert r.data.input == "pixels" and r.data.workers >= 0 and r.steps == 3
    assert r.loss.distill_warmup_steps >= 0 and r.model.queue_size <= s.data.n_train
    changed = dataclasses.replace(r, steps=5)  # the way to a changed copy
    assert changed.steps == 5 and r.steps == 3
    result = train(cfg, overwrite=True)
    assert result["step"] == 3 and all(torch.isfinite(torch.tensor(v)) for v in result["losses"].values())


def test_resolve_fills_the_derived_values_and_says_what_it_changed():
    cfg = load_config("albef", None, ["data.workers=4", "model.queue_size=100"], shards=["unused"], epochs=2.5,
                      batch_size=8)
    facts = DataFacts(features={"dim": 64, "encoder": "tiny"}, n_train=40, per_epoch=5, streamed=(40, 2))
    resolved, notes = resolve(cfg, torch.device("cpu"), facts)
    assert resolved.data.input == "features" and resolved.model.image_model == "features"
    assert resolved.model.feature_dim == 64
    assert resolved.steps == 13 and resolved.loss.distill_warmup_steps == 5  # ceil(2.5 * 5); one epoch
    assert resolved.data.workers == 2 and resolved.model.queue_size == 40
    assert notes == ["warning: data.workers 4 -> 2: the data has 2 shard(s), one worker's share at most",
                     "warning: model.queue_size 100 is longer than the training split (40): every sample would sit "
                     "in the queue as its own negative more than once; clamped to 40"]
    assert cfg.data.input == "auto" and cfg.data.workers == 4 and cfg.model.queue_size == 100  # a new config


def test_a_quiet_setup_prints_nothing_and_feeds_the_batches_it_is_given(onto, tmp_path, capsys):
    cfg = load_config("clip", None, TINY, shards=[str(onto)], out=str(tmp_path / "run"), steps=2, batch_size=4,
                      device="cpu")
    s = setup(cfg, quiet=True)
    batch, fault = s.feed.next(s.state)
    s.close()
    assert fault is None and batch is not None
    assert capsys.readouterr().err == ""
    s = setup(cfg, overwrite=True, quiet=True, batches=[batch])
    fed = []
    for _ in range(3):  # one pass an epoch: the list again at each turnover
        fed.append(s.feed.next(s.state)[0])
        s.state.consumed += 1  # as the loop counts a step's batch
    s.close()
    assert all(b is batch for b in fed) and s.state.epoch == 2
    s = setup(cfg, overwrite=True, batches=[batch])  # quiet belongs to that session: the next one reports again
    s.close()
    assert "clip" in capsys.readouterr().err


@pytest.mark.slow  # two set-ups that start a loader worker each
def test_data_prefetch_reaches_the_runs_loader(onto, tmp_path):
    """data.prefetch is the loader's prefetch_factor in the run setup builds (torch's default 2 when -1)."""
    sets = [x for x in TINY if not x.startswith("data.workers")] + ["data.workers=1"]
    for value, expected in (("3", 3), ("-1", 2)):
        cfg = load_config("clip", None, sets + [f"data.prefetch={value}"], shards=[str(onto)],
                          out=str(tmp_path / value), steps=2, batch_size=4, device="cpu")
        s = setup(cfg, quiet=True)
        try:
            assert s.feed.loader.prefetch_factor == expected
        finally:
            s.close()

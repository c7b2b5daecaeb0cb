"""data.val_max: a held-out evaluation scores the first val_max held-out samples in shard order, reads only the
shards that hold them, and scores them as they would be scored alone; the held-out split itself is unchanged."""

import hashlib
import json

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

import vltrain.data.stream as stream_module
from tests.conftest import colour_pairs, tiny_checkpoint
from vltrain.api import load
from vltrain.cli import app
from vltrain.config import Config, ConfigError, DataConfig, to_dict, validate
from vltrain.evaluate import blocked_recall, embed_split, recall_at_k
from vltrain.resume import BEFORE_KEY, config_diff

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01"]
VAL_FRAC = 0.5


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """60 pairs in 15 shards of 4; about half of them held out at val_frac 0.5."""
    return colour_pairs(tmp_path_factory.mktemp("valmax"), 60, per_shard=4)


def held_out_by_hand(ds):
    """[(shard file name, key)] of every held-out sample in shard order: the key hash re-derived here."""
    out = []
    for shard in json.loads((ds / "sizes.json").read_text()):
        keys = pq.read_table(ds / shard.replace(".tar", ".parquet"), columns=["key"]).column(0).to_pylist()
        for k in keys:
            h = int.from_bytes(hashlib.blake2b(f"val:{k}".encode(), digest_size=8).digest(), "big")
            if h < VAL_FRAC * 2**64:
                out.append((shard, k))
    return out


def test_a_capped_evaluation_scores_the_first_held_out_samples_and_reads_only_their_shards(ds, tmp_path,
                                                                                            monkeypatch):
    held = held_out_by_hand(ds)
    cap = 7
    assert len(held) > 2 * cap  # the cap matters: most held-out samples (and shards) are left out
    want_keys = [k for _, k in held[:cap]]
    want_shards = sorted({s for s, _ in held[:cap]})
    model = load(tiny_checkpoint(tmp_path / "ckpt.pt"), "cpu").net
    data = DataConfig(image_size=32, max_len=12, val_frac=VAL_FRAC, workers=0)
    read = []
    real = stream_module.iter_tar

    def recording(path, *a, **k):
        read.append(path.name)
        return real(path, *a, **k)

    monkeypatch.setattr(stream_module, "iter_tar", recording)
    capped = embed_split(model, [ds], "val", data, 4, torch.device("cpu"), False, limit=cap)
    assert capped["n"] == cap and capped["keys"] == want_keys
    assert sorted(read) == want_shards
    read.clear()
    whole = embed_split(model, [ds], "val", data, 4, torch.device("cpu"), False)
    assert whole["keys"] == [k for _, k in held] and len(read) == 15  # uncapped: every shard, every held-out sample
    # Scored alone: the capped samples' rows of the whole split's embeddings give the same ranks. Each embedding is
    # the same float32 computation on the same pixels, only in other batches: at most a few float32 roundings
    # (unit roundoff 6e-8) through the 32-wide tiny towers, far below 1e-5 on unit vectors.
    rows = [whole["keys"].index(k) for k in want_keys]
    torch.testing.assert_close(capped["img"], whole["img"][rows], rtol=0, atol=1e-5)
    torch.testing.assert_close(capped["txt"], whole["txt"][rows], rtol=0, atol=1e-5)
    alone = recall_at_k(whole["img"][rows] @ whole["txt"][rows].t(), torch.arange(cap))
    assert blocked_recall(capped["img"], capped["txt"], capped["txt2img"]) == alone


def test_a_run_says_how_many_it_scored_of_how_many_held_out(ds, tmp_path):
    n_held = len(held_out_by_hand(ds))
    sets = [x for s in TINY + [f"data.val_frac={VAL_FRAC}", "data.val_max=5"] for x in ("--set", s)]
    r = CliRunner().invoke(app, ["run", str(ds), "--out", str(tmp_path / "run"), "--batch-size", "4", "--steps", "2",
                                 "--device", "cpu", "--preset", "clip", *sets])
    assert r.exit_code == 0, r.output
    ev = json.loads((tmp_path / "run" / "result.json").read_text())["eval"]
    assert ev["n_val"] == 5 and ev["held_out"] == n_held
    assert f"eval on 5 val samples of {n_held} held out" in r.output
    assert f"held out {n_held}" in r.output and "the first 5 scored per evaluation" in r.output


def test_val_max_out_of_range_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"data.val_max=-1 is outside its range \[0, inf\)"):
        validate(Config(shards=["x"], data=DataConfig(val_max=-1)))


def test_a_checkpoint_from_before_val_max_scored_every_held_out_sample():
    now = to_dict(Config())
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in now.items()}
    del old["data"]["val_max"]
    defaults = to_dict(Config())
    defaults["data"]["val_max"] = BEFORE_KEY["data.val_max"]
    assert BEFORE_KEY["data.val_max"] == 0
    assert config_diff(old, now, defaults=defaults) == [
        "data.val_max: 0 (absent from this older checkpoint) -> 1000"]
    now["data"]["val_max"] = 0
    assert config_diff(old, now, defaults=defaults) == []


def test_a_capped_evaluation_holds_no_more_as_the_dataset_grows(tmp_path):
    """The memory rule: embed_split with limit 50 peaks at the same size on 400 and on 1,600 samples (shards of 50,
    half of them held out): 6 bytes per extra sample, the shard list's. Uncapped (data.val_max=0, the former
    behaviour) every held-out sample's embeddings, tokens, key and caption stay: 166 bytes per extra sample."""
    from tests.memrule import growth_per_sample
    from tests.vltrain.test_index_read import write_folder

    n = 400
    data = {m: write_folder(tmp_path / str(m), [50] * (m // 50), members=False) for m in (n, 4 * n)}
    model = load(tiny_checkpoint(tmp_path / "ckpt.pt"), "cpu").net
    cfg = DataConfig(image_size=32, max_len=12, val_frac=VAL_FRAC, workers=0)

    def run(m: int):
        return embed_split(model, [data[m]], "val", cfg, 16, torch.device("cpu"), False, limit=50)

    assert growth_per_sample(run, n) < 24

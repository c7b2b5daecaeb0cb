"""A features dataset with one bad `npy` member (wrong shape, NaN, an integer dtype): a counted skip in training and in
evaluation, never a crash that loses the run; and the end-of-run save comes before the final evaluation."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import features_pairs, npy_bytes, replace_member
from vltrain.cli import app
from vltrain.data.shards import in_val
from vltrain.data.stream import ShardStream

TINY = ["model.text_model=tiny", "model.embed_dim=16", "data.max_len=12", "log_every=1", "optim.warmup_steps=2",
        "optim.lr=0.01", "data.workers=0"]
VAL_FRAC = 0.2


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """120 pairs of (4, 1280) float16 tokens, and a clip run of 4 steps on them (for `vltrain eval`)."""
    tmp = tmp_path_factory.mktemp("badnpy")
    feat = features_pairs(tmp)
    r = run(feat, tmp / "run", "--steps", "4", "--set", "data.val_frac=0", "--set", "eval_every=1000")
    assert r.exit_code == 0, r.output
    return {"feat": feat, "ckpt": tmp / "run" / "last.pt"}


def run(ds, out, *args):
    return CliRunner().invoke(app, ["run", str(ds), "--preset", "clip", "--batch-size", "8", "--device", "cpu",
                                    "--out", str(out), *[a for s in TINY for a in ("--set", s)], *args])


def keys(n: int = 120) -> list[str]:
    return [f"shard_{i:09d}" for i in range(n)]


def train_key() -> str:
    return next(k for k in keys() if not in_val(k, VAL_FRAC))


def val_key() -> str:
    return next(k for k in keys() if in_val(k, VAL_FRAC))


def damaged(good, tmp_path, members: dict) -> Path:
    """A copy of the good dataset with the npy member of each key replaced by the given bytes."""
    ds = tmp_path / "bad"
    shutil.copytree(good["feat"], ds)
    for key, data in members.items():
        replace_member(ds, f"{key}.npy", data)
    return ds


def metrics(out) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


WRONG = {"3x1280": np.zeros((3, 1280), np.float16), "4x640": np.zeros((4, 640), np.float16),
         "1-D": np.zeros(5120, np.float16), "nan": np.full((4, 1280), np.nan, np.float16),
         "int32": np.zeros((4, 1280), np.int32)}


@pytest.mark.parametrize("what", list(WRONG))
def test_a_bad_npy_member_is_a_counted_skip_in_training(good, tmp_path, what):
    """Before: `RuntimeError: stack expects each tensor to be equal size` from collate (shapes), a NaN loss stop
    (nan) and a traceback; now the run trains its epoch with bad_samples 1."""
    ds = damaged(good, tmp_path, {train_key(): npy_bytes(WRONG[what])})
    r = run(ds, tmp_path / "run", "--steps", "14", "--set", "data.val_frac=0", "--set", "eval_every=1000")
    assert r.exit_code == 0, r.output
    rows = metrics(tmp_path / "run")
    # one epoch: the 119 good samples make 14 batches of 8, and the bad one was read (and skipped) once
    assert rows[-1]["step"] == 14 and rows[-1]["bad_samples"] == 1


@pytest.mark.parametrize("loader", [["--set", "data.workers=1"], ["--set", "sampler.kind=grit"]])
def test_a_wrong_shaped_npy_is_skipped_by_loader_workers_and_the_grit_sampler(good, tmp_path, loader):
    ds = damaged(good, tmp_path, {train_key(): npy_bytes(WRONG["4x640"])})
    r = run(ds, tmp_path / "run", "--steps", "15", "--set", "data.val_frac=0", "--set", "eval_every=1000", *loader)
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert metrics(tmp_path / "run")[-1]["bad_samples"] == 1


def test_a_bad_held_out_npy_does_not_lose_the_run(good, tmp_path):
    """Before: all 8 steps trained, then the final evaluation crashed before last.pt was written (step 4 kept)."""
    ds = damaged(good, tmp_path, {val_key(): npy_bytes(WRONG["3x1280"])})
    out = tmp_path / "run"
    r = run(ds, out, "--steps", "8", "--set", f"data.val_frac={VAL_FRAC}", "--set", "ckpt_every=4",
            "--set", "eval_every=1000")
    assert r.exit_code == 0, r.output
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 8
    val = [row["val"] for row in metrics(out) if "val" in row]
    assert len(val) == 1 and val[0]["skipped"] == {"count": 1, "reasons": {"npy_shape": 1}}
    assert "1 sample skipped (npy_shape 1)" in r.output
    assert "1 bad sample(s) skipped" in " ".join(r.output.split())  # the held-out table's title says so too


def test_a_failing_final_evaluation_keeps_the_trained_steps_and_resume_does_not_retrain(good, tmp_path, monkeypatch):
    """Before: last.pt was written after the final evaluation, so its failure kept step 4 of 8 and --resume retrained
    steps 5-8 into the same failure."""
    import vltrain.train

    calls = []

    def failing(run, state, *args):
        calls.append(state.step)
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(vltrain.train, "evaluate_heldout", failing)
    out, opts = tmp_path / "run", ["--steps", "8", "--set", f"data.val_frac={VAL_FRAC}", "--set", "ckpt_every=4",
                                   "--set", "eval_every=1000"]
    r = run(good["feat"], out, *opts)
    assert r.exit_code != 0 and calls == [8], r.output
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 8
    trained = metrics(out)
    assert [row["step"] for row in trained] == list(range(1, 9))
    monkeypatch.undo()
    r = run(good["feat"], out, *opts, "--resume")
    assert r.exit_code == 0, r.output
    assert "resumed from step 8 of 8" in r.output
    rows = metrics(out)
    assert rows[:8] == trained and [row["step"] for row in rows[8:]] == [8] and "val" in rows[8]  # evaluated only
    assert json.loads((out / "result.json").read_text())["eval"]["n_val"] > 0


def test_vltrain_eval_skips_a_bad_npy_and_says_so(good, tmp_path):
    """Before: exit 1 with a collate traceback (shape), or recalls from NaN embeddings without a word (nan)."""
    ds = damaged(good, tmp_path, {keys()[3]: npy_bytes(WRONG["1-D"]), keys()[50]: npy_bytes(WRONG["nan"])})
    r = CliRunner().invoke(app, ["eval", str(good["ckpt"]), str(ds), "--out", str(tmp_path / "eval.json")])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["skipped"] == {"count": 2, "reasons": {"npy_shape": 1, "npy_nonfinite": 1}}
    assert result["n_samples"] == 118 and result["retrieval"]["n_images"] == 118
    assert "2 of 120 samples skipped (npy_nonfinite 1, npy_shape 1)" in r.output
    assert "118 images, 118 captions; 2 bad sample(s) skipped" in " ".join(r.output.split())  # the table's title
    # the good dataset: nothing skipped, and the same scores as before
    r = CliRunner().invoke(app, ["eval", str(good["ckpt"]), str(good["feat"]), "--out", str(tmp_path / "g.json")])
    assert r.exit_code == 0 and "skipped" not in r.output, r.output
    assert json.loads((tmp_path / "g.json").read_text())["skipped"] == {"count": 0, "reasons": {}}


def test_more_than_one_percent_bad_npy_names_vlprep_features(good, tmp_path):
    ds = damaged(good, tmp_path, {k: npy_bytes(WRONG["3x1280"]) for k in keys()[:3]})
    r = run(ds, tmp_path / "run", "--steps", "50", "--set", "data.val_frac=0", "--set", "eval_every=1000")
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and err[0].startswith("error: 3 of 120 samples read had unusable npy features"), r.output
    assert "`vlprep features`" in err[0] and "--decode-check" not in err[0]


def test_npy_dtypes_and_layouts_follow_the_documented_policy(good, tmp_path):
    """docs/FORMAT.md: float16 / float32 / float64 are read as float32 (float64 values beyond float32's range become
    inf, a bad sample), Fortran order and big-endian bytes give the same values, integer and bool dtypes are bad."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1280)).astype(np.float32)
    k = keys()
    ds = damaged(good, tmp_path, {k[0]: npy_bytes(x), k[1]: npy_bytes(x.astype(np.float64)),
                                  k[2]: npy_bytes(np.asfortranarray(x)), k[3]: npy_bytes(x.astype(">f4")),
                                  k[4]: npy_bytes(np.full((4, 1280), 1e300)), k[5]: npy_bytes(x.astype(np.int64)),
                                  k[6]: npy_bytes(x > 0), k[7]: b"not an npy file"})
    stream = ShardStream([ds], "train", 0.0, None, shuffle=False, use_features=True)
    got = {key: t for t, _, key in stream}
    for key in k[:4]:
        assert got[key].dtype == torch.float32 and got[key].is_contiguous()
        assert torch.equal(got[key], torch.from_numpy(x))
    assert not set(k[4:8]) & set(got) and len(got) == 120 - 4
    assert stream.counts.totals() == (120, 4)
    assert stream.counts.reasons() == {"npy_nonfinite": 1, "npy_dtype": 2, "npy_unreadable": 1}

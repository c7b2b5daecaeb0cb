import json
import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from vlprep import versions
from vlprep.shards import ShardsConfig, build_shards
from vltrain import step as step_mod
from vltrain.cli import app
from vltrain.config_load import load_config
from vltrain.optim import lr_at
from vltrain.step import distill_alpha_at

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """24 pairs in 6 shards: a near-solid colour per image (it survives random crops), distinct captions."""
    return colour_pairs(tmp_path_factory.mktemp("train"), 24)


def run(shards, out, *args):
    sets = [x for s in TINY for x in ("--set", s)]
    return CliRunner().invoke(app, ["run", str(shards), "--out", str(out), "--batch-size", "8", "--device", "cpu",
                                    *sets, *args])


def losses(out, key="total"):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def test_lr_warmup_then_cosine():
    def lr(step):  # lr 1, warm-up 10, 110 steps, min ratio 0.1
        return lr_at(step, 1.0, 10, 110, 0.1)

    assert [lr(s) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])  # linear warmup
    assert lr(60) == pytest.approx(0.1 + 0.9 * 0.5)  # cosine half way
    assert lr(110) == pytest.approx(0.1)  # ends at lr * min_lr_ratio
    falling = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(falling, falling[1:]))


def test_distill_alpha_ramps_up_over_the_warmup_as_albef():
    # ALBEF Pretrain.py, epoch 0: alpha = config['alpha'] * min(1, i / len(data_loader)), i = 0, 1, ... per step.
    cfg = load_config("albef", sets=["loss.distill_alpha=0.4", "loss.distill_warmup_steps=8"])
    for step in range(1, 20):
        i = step - 1
        want = 0.4 * (i / 8 if i < 8 else 1.0)
        assert distill_alpha_at(step, cfg) == pytest.approx(want, abs=1e-12)
    assert distill_alpha_at(1, cfg) == 0.0 and distill_alpha_at(9, cfg) == pytest.approx(0.4)
    flat = load_config("albef", sets=["loss.distill_warmup_steps=0"])
    assert [distill_alpha_at(s, flat) for s in (1, 2, 50)] == [0.4, 0.4, 0.4]
    assert load_config("albef").loss.distill_warmup_steps == -1  # one epoch, resolved when the run starts


@pytest.mark.parametrize("preset", ["clip", "albef"])
def test_run_overfits_and_eval_writes_json(shards, tmp_path, preset):
    out = tmp_path / preset
    extra = ["--set", "model.queue_size=16", "--set", "model.momentum_m=0.9", "--set", "model.fusion_layers=1"] \
        if preset == "albef" else []  # the tiny BERT has 2 layers: split 1 + 1
    r = run(shards, out, "--preset", preset, "--steps", "40", "--set", "data.val_frac=0.2", "--set",
            "eval_every=20", "--set", "ckpt_every=20", *extra)
    assert r.exit_code == 0, r.output + repr(r.exception)
    total = losses(out)
    assert sorted(total) == list(range(1, 41))
    first, last = sum(total[s] for s in range(1, 6)) / 5, sum(total[s] for s in range(36, 41)) / 5
    assert last < 0.8 * first, (first, last)
    if preset == "albef":
        for k in ("itc_loss", "itm_loss", "mlm_loss"):
            assert all(math.isfinite(v) for v in losses(out, k).values())
    assert (out / "last.pt").exists() and (out / "best.pt").exists() and any((out / "tb").iterdir())
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["step"] == 40 and ckpt["config"]["preset"] == preset
    if preset == "albef":
        assert any(k.startswith("momentum.") for k in ckpt["model"]) and "image_queue" in ckpt["model"]
        # -1 became one epoch of this training split, and alpha followed the ramp step by step.
        per_epoch = ckpt["config"]["loss"]["distill_warmup_steps"]
        n_train = int(re.search(r"train (\d+), held out", r.output).group(1))
        assert per_epoch == n_train // 8
        alphas = losses(out, "distill_alpha")
        assert alphas == {s: pytest.approx(0.4 * min(1.0, (s - 1) / per_epoch)) for s in range(1, 41)}
    result = json.loads((out / "result.json").read_text())
    assert 0 <= result["eval"]["mean_recall"] <= 100

    classes = tmp_path / "classes.txt"
    classes.write_text("cat\ndog\nbird\ntree\n")
    args = ["eval", str(out / "last.pt"), str(shards), "--zeroshot", str(classes), "--device", "cpu"]
    if preset == "albef":
        args += ["--itm-rerank-k", "4"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads((out / "eval.json").read_text())
    assert res["n_samples"] == 24 and {"i2t_r1", "t2i_r10", "mean_recall"} <= set(res["retrieval"])
    assert res["chance"]["i2t_r1"] == pytest.approx(100 / 24, abs=0.01)
    zs = res["zeroshot"]
    assert zs["samples"] + zs["skipped"] == 24 and zs["samples"] > 0 and 0 <= zs["top1"] <= zs["top5"] <= 100
    assert ("itm_rerank" in res) == (preset == "albef")


def test_resume_continues_exactly(shards, tmp_path, monkeypatch):
    """The held-out evaluations run (eval_every=2: one after the part run's last checkpoint, before the resume) but
    draw no learning curve: nothing here reads it (test_trainer_usability does), and matplotlib was most of each."""
    monkeypatch.setattr("vltrain.runlog.plot_learning_curve", lambda rows, path: None)
    # A constant lr makes the K-step run's schedule the same as the N-step run's.
    common = ["--preset", "albef", "--set", "model.fusion_layers=1", "--set", "model.queue_size=16",
              "--set", "optim.warmup_steps=0", "--set",
              "optim.min_lr_ratio=1.0", "--set", "data.val_frac=0.2", "--set", "eval_every=2"]
    r = run(shards, tmp_path / "full", *common, "--steps", "6")
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = run(shards, tmp_path / "part", *common, "--steps", "3")  # ends mid-epoch: ~19 train pairs, 2 batches/epoch
    assert r.exit_code == 0, r.output + repr(r.exception)
    ckpt = torch.load(tmp_path / "part" / "last.pt", weights_only=True)
    assert (ckpt["step"], ckpt["epoch"], ckpt["consumed"]) == (3, 1, 1)
    assert ckpt["versions"] == versions() and str(torch.__version__).startswith(ckpt["versions"]["torch"])
    with (tmp_path / "part" / "metrics.jsonl").open("a") as f:  # a row logged after the checkpoint is redone
        f.write(json.dumps({"step": 4, "total": -1.0}) + "\n")
    r = run(shards, tmp_path / "part", *common, "--steps", "6", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    full, part = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert sorted(part) == list(range(1, 7))
    for key in ("total", "itc_loss", "itm_loss", "mlm_loss"):
        a, b = losses(tmp_path / "full", key), losses(tmp_path / "part", key)
        assert [a[s] for s in (1, 2, 3, 4, 5, 6)] == [b[s] for s in (1, 2, 3, 4, 5, 6)], key  # bit for bit
    assert full == part


def test_resume_refuses_data_whose_captions_changed(shards, tmp_path):
    """A rebuilt dataset (here one caption edited, its shard rewritten by vlprep) is not the run's data: --resume
    says so in one line instead of continuing on other samples; unchanged data resumes."""
    import shutil
    src = tmp_path / "src"
    shutil.copytree(shards.parent / "src", src)
    build_shards(ShardsConfig(src=src, out=tmp_path / "ds", samples_per_shard=4, workers=1))
    clip = ("--preset", "clip")
    r = run(tmp_path / "ds", tmp_path / "run", *clip, "--steps", "2")
    assert r.exit_code == 0, r.output + repr(r.exception)
    first = json.loads((tmp_path / "run" / "result.json").read_text())["data"]
    r = run(tmp_path / "ds", tmp_path / "run", *clip, "--steps", "3", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)  # same data: resumes
    (src / "005.txt").write_text("a caption that was edited")
    build_shards(ShardsConfig(src=src, out=tmp_path / "ds", samples_per_shard=4, workers=1, overwrite=True))
    r = run(tmp_path / "ds", tmp_path / "run", *clip, "--steps", "4", "--resume")
    assert r.exit_code == 2  # a user error: vltrain's one-line exit
    assert "the training data changed since" in r.output and "Traceback" not in r.output
    r = run(tmp_path / "ds", tmp_path / "run", *clip, "--steps", "4", "--overwrite")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["data"] != first


def test_nan_loss_stops_and_keeps_last_checkpoint(shards, tmp_path, monkeypatch):
    real = step_mod.train_step
    calls = []

    def poisoned(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            out["total"] = out["total"] * float("nan")
        return out

    monkeypatch.setattr(step_mod, "train_step", poisoned)
    out = tmp_path / "nan"
    r = run(shards, out, "--preset", "clip", "--steps", "5", "--set", "ckpt_every=2", "--set", "data.val_frac=0")
    assert r.exit_code == 2
    assert "error:" in r.output and "non-finite loss at step 3" in r.output and "last.pt" in r.output
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 2
    assert not (out / "last.pt.tmp").exists()


def test_unknown_set_key_is_a_one_line_error(shards, tmp_path):
    r = run(shards, tmp_path / "bad", "--set", "loss.nope=1")
    assert r.exit_code == 2
    line = r.output.strip()
    assert line.startswith("error:") and "nope" in line and "valid keys" in line and "\n" not in line


@pytest.mark.slow  # loads the packaged MiniLM and EfficientNet-Lite0
@pytest.mark.skipif(not Path("/usr/share/openclipart/png").is_dir(), reason="openclipart-png not installed")
def test_packaged_models_train_on_real_clip_art(tmp_path):
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    pngs = sorted(Path("/usr/share/openclipart/png/animals").rglob("*.png"))[:24]
    for p in pngs:
        shutil.copy(p, src / p.name)
        (src / p.name).with_suffix(".txt").write_text(p.stem.replace("_", " "))
    build_shards(ShardsConfig(src=src, out=tmp_path / "raw", workers=1, resize=128))
    r = CliRunner().invoke(app, ["run", str(tmp_path / "raw"), "--preset", "albef", "--steps", "3", "--batch-size", "4",
                                 "--out", str(tmp_path / "run"), "--set", "data.val_frac=0.2",
                                 "--set", "model.queue_size=16", "--set", "data.workers=0", "--set", "log_every=1"])
    assert r.exit_code == 0, r.output[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "total" in row]
    assert len(steps) == 3 and all(math.isfinite(row["total"]) for row in steps)
    assert (tmp_path / "run" / "last.pt").exists()


# --- GPU speed options, each a config key that leaves a CPU run as it was unless asked ----------------


def test_channels_last_on_a_cpu_gives_the_same_losses_and_bad_switches_are_one_line(shards, tmp_path):
    common = ["--preset", "clip", "--steps", "2", "--set", "data.val_frac=0"]
    for value in ("off", "on"):
        r = run(shards, tmp_path / value, *common, "--set", f"train.channels_last={value}")
        assert r.exit_code == 0, r.output + repr(r.exception)
    off, on = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert sorted(on) == [1, 2] and on == pytest.approx(off, rel=1e-5)
    r = run(shards, tmp_path / "bad", *common, "--set", "train.tf32=maybe")
    assert r.exit_code == 2 and "train.tf32 must be one of auto, on, off, got 'maybe'" in r.output


@pytest.mark.slow
def test_compile_runs_a_step_on_a_cpu_and_keeps_checkpoint_keys(shards, tmp_path):
    """train.compile: the encoders compiled in place (one CPU step takes ~35 s to compile here)."""
    r = run(shards, tmp_path / "c", "--preset", "clip", "--steps", "1", "--set", "data.val_frac=0",
            "--set", "train.compile=true")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert math.isfinite(losses(tmp_path / "c")[1])
    keys = torch.load(tmp_path / "c" / "last.pt", weights_only=True)["model"]
    assert keys and not any("_orig_mod" in k for k in keys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU machine")
def test_gpu_benchmark_says_no_cuda_device_and_exits_0():
    import subprocess
    import sys

    root = Path(__file__).parents[2]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu.py")], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "no CUDA device" in r.stdout, r.stderr

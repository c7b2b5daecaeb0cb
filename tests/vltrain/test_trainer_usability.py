"""What a user of `vltrain` relies on: one-line errors, safe checkpoints, refusing to overwrite, Ctrl-C, summaries,
`vltrain config`, and fresh runs that are a function of their seed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from vlprep.shards import ShardsConfig, build_shards
from vltrain import checkpoint as ckpt_io
from vltrain import resume
from vltrain.cli import app
from vltrain.config import Config, to_dict
from vltrain.config_load import load_config

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01"]
VLTRAIN = [sys.executable, "-m", "vltrain.cli"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """24 pairs in 6 shards of 4."""
    tmp = tmp_path_factory.mktemp("usability")
    src = tmp / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (36, 36, 3)).astype(np.uint8)).save(src / f"{i:03d}.png")
        (src / f"{i:03d}.txt").write_text(f"a picture of thing {i} colour {i % 5}")
    build_shards(ShardsConfig(src=src, out=tmp / "ds", samples_per_shard=4, workers=1))
    return tmp / "ds"


def tiny_args(*extra: str) -> list[str]:
    return [x for s in TINY for x in ("--set", s)] + list(extra)


def run(shards, out, *args) -> "CliRunner.Result":
    return CliRunner().invoke(app, ["run", str(shards), "--out", str(out), "--batch-size", "4", "--device", "cpu",
                                    *tiny_args(*args)])


def error_line(result) -> str:
    """The one line a failed command printed (its output must be exactly one non-empty line)."""
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def metric_rows(out: Path) -> list[dict]:
    """metrics.jsonl without the timing column (wall-clock rates differ between any two runs)."""
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rows]


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    r = run(shards, out, "--preset", "clip", "--steps", "4")
    assert r.exit_code == 0, r.output
    return out


# --- one-line errors, exit 2 --------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(shards, tmp_path):
    assert "CUDA is not available" in error_line(run(shards, tmp_path / "r", "--device", "cuda"))
    ev = CliRunner().invoke(app, ["eval", str(tmp_path / "x.pt"), str(shards), "--device", "cuda"])
    assert "CUDA is not available" in error_line(ev)


def test_unknown_device_and_unknown_key_are_one_line(shards, tmp_path):
    assert "unknown device 'gpu'" in error_line(run(shards, tmp_path / "r", "--device", "gpu"))
    line = error_line(run(shards, tmp_path / "r", "--set", "model.bogus=1"))
    assert line.startswith("error: unknown config key model.bogus; valid keys of model: text_model, image_model")


def test_eval_of_a_file_that_is_not_a_checkpoint(shards, tmp_path):
    readme = Path(__file__).parents[2] / "README.md"
    assert "not a vltrain checkpoint" in error_line(CliRunner().invoke(app, ["eval", str(readme), str(shards)]))


def test_eval_with_swapped_arguments_says_which_is_wrong(shards, trained):
    line = error_line(CliRunner().invoke(app, ["eval", str(shards), str(trained / "last.pt")]))
    assert "is a checkpoint file, not a shard folder: the checkpoint comes first" in line
    line = error_line(CliRunner().invoke(app, ["eval", str(shards), str(shards)]))
    assert f"CHECKPOINT {shards} is a folder" in line and "checkpoint comes first" in line


# --- checkpoints: no code runs, structure validated ---------------------------------------------------------------


class _Exploit:
    """Unpickling this runs `touch MARKER`: what a crafted checkpoint would do under weights_only=False."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_exploit_runs_nothing_anywhere(shards, trained, tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    good = torch.load(trained / "last.pt", weights_only=True)
    torch.save({**good, "rng": _Exploit(marker)}, evil)
    # vltrain eval
    line = error_line(CliRunner().invoke(app, ["eval", str(evil), str(shards)]))
    assert "refused to load" in line and "could run code" in line
    # vltrain run --resume
    run_dir = tmp_path / "resume"
    run_dir.mkdir()
    (run_dir / "last.pt").write_bytes(evil.read_bytes())
    assert "refused to load" in error_line(run(shards, run_dir, "--preset", "clip", "--steps", "4", "--resume"))
    # vlprep pseudolabel (vltrain.checkpoint.load_checkpoint, as vlprep embed)
    r = subprocess.run([sys.executable, "-m", "vlprep.cli", "pseudolabel", str(shards), str(shards),
                        str(tmp_path / "pseudo"), "--checkpoint", str(evil)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "refused to load" in r.stderr
    assert not marker.exists()


def test_truncated_and_structurally_wrong_checkpoints(shards, trained, tmp_path):
    data = (trained / "last.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    assert "not a vltrain checkpoint" in error_line(CliRunner().invoke(app, ["eval", str(cut), str(shards)]))
    no_config = tmp_path / "noconfig.pt"
    torch.save({"model": {}}, no_config)
    assert "no 'config' dict" in error_line(CliRunner().invoke(app, ["eval", str(no_config), str(shards)]))
    # A config that does not match the weights: the saved embed_dim says 8, the weights are 16 wide.
    ck = torch.load(trained / "last.pt", weights_only=True)
    ck["config"]["model"]["embed_dim"] = 8
    bad = tmp_path / "mismatch.pt"
    torch.save(ck, bad)
    line = error_line(CliRunner().invoke(app, ["eval", str(bad), str(shards)]))
    assert "checkpoint has embed_dim 16, config asks 8" in line


def test_checkpoint_holds_only_tensors_and_plain_data(trained):
    ck = torch.load(trained / "last.pt", weights_only=True)  # would raise on any other object

    def walk(x):
        if isinstance(x, dict):
            return all(isinstance(k, (str, int)) and walk(v) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return all(walk(v) for v in x)
        return x is None or isinstance(x, (bool, int, float, str, torch.Tensor))

    assert walk(ck) and ck["format"] == ckpt_io.FORMAT
    assert ck["config"] == to_dict(load_config("clip", sets=TINY, shards=ck["config"]["shards"],
                                               out=ck["config"]["out"], steps=4, batch_size=4, device="cpu",
                                               **{"data.input": "pixels"}))


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(1), np.random.seed(2)
    import random

    random.seed(3)
    ckpt_io.save({"model": {}, "config": {"model": {}}, "rng": resume.rng_states(g)}, tmp_path / "c.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=g)))
    g2 = torch.Generator()
    resume.set_rng_states(ckpt_io.load(tmp_path / "c.pt")["rng"], g2)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=g2))) \
        == expected


def test_resume_with_another_config_names_the_keys(shards, trained, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "last.pt").write_bytes((trained / "last.pt").read_bytes())
    line = error_line(run(shards, out, "--preset", "albef", "--steps", "8", "--resume",
                          "--set", "model.embed_dim=8"))
    assert "was trained with another config" in line
    assert "preset: 'clip' -> 'albef'" in line and "model.embed_dim: 16 -> 8" in line


def test_a_checkpoint_older_than_the_fidelity_keys_still_resumes(shards, trained, tmp_path):
    """Keys added later (fidelity options) are absent from older checkpoints: they count as their former behaviour."""
    out = tmp_path / "old"
    out.mkdir()
    ckpt = torch.load(trained / "last.pt", weights_only=True)
    for section, keys in (("loss", ("itm_negatives", "itc_detach_keys", "distill_warmup_steps", "dedupe")),
                          ("model", ("fusion_from", "temp_learnable", "pooling"))):
        for k in keys:
            ckpt["config"][section].pop(k, None)
    ckpt_io.save(ckpt, out / "last.pt")
    r = run(shards, out, "--preset", "clip", "--steps", "5", "--resume")
    assert r.exit_code == 0, r.output
    assert "resumed from step 4 of 5" in r.output
    line = error_line(run(shards, out, "--preset", "clip", "--steps", "6", "--resume",
                          "--set", "loss.itc_detach_keys=true"))
    assert "loss.itc_detach_keys: False -> True" in line


# --- protecting earlier runs, resuming, Ctrl-C --------------------------------------------------------------------


def test_refuses_to_overwrite_a_run_unless_told(shards, trained, tmp_path):
    out = tmp_path / "r"
    assert run(shards, out, "--preset", "clip", "--steps", "2").exit_code == 0
    (out / "notes.txt").write_text("mine")
    before = (out / "last.pt").read_bytes()
    line = error_line(run(shards, out, "--preset", "clip", "--steps", "2"))
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert (out / "last.pt").read_bytes() == before
    r = run(shards, out, "--preset", "clip", "--steps", "3", "--overwrite")
    assert r.exit_code == 0, r.output
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 3 and (out / "notes.txt").read_text() == "mine"
    r = run(shards, out, "--preset", "clip", "--steps", "5", "--resume")
    assert r.exit_code == 0 and "resumed from step 3 of 5" in r.output


@pytest.mark.slow  # two `vltrain run` processes, one stopped by SIGINT
def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(shards, tmp_path):
    """The uninterrupted reference runs in-process (CliRunner): what is compared is the metrics of a fresh run, which
    depend on the seed only (test_fresh_runs_are_a_function_of_the_seed compares an in-process run with a fresh
    process), so only the run that is stopped by SIGINT and its resume need processes of their own."""
    base = [*VLTRAIN, "run", str(shards), "--preset", "clip", "--batch-size", "4", "--device", "cpu",
            "--steps", "40", *tiny_args("--set", "data.val_frac=0")]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    ref = tmp_path / "ref"
    r = run(shards, ref, "--preset", "clip", "--steps", "40", "--set", "data.val_frac=0")
    assert r.exit_code == 0, r.output
    out = tmp_path / "int"
    proc = subprocess.Popen([*base, "--out", str(out), "--set", "log_every=1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text
    stopped = torch.load(out / "last.pt", weights_only=True)["step"]
    assert 3 <= stopped < 40 and f"stopped at step {stopped} of 40" in text and "--resume" in text
    assert "Traceback" not in text
    r = subprocess.run([*base, "--out", str(out), "--resume"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"resumed from step {stopped}" in r.stderr, r.stderr
    assert metric_rows(out) == metric_rows(ref)


# `vltrain run` whose read of one shard blocks in read(2) for ever, as on a hung network mount: a pipe nobody
# writes to. Before blocking it creates the file HANG_MARK names, so the test knows the run is waiting.
HANGING_RUN = """
import os, sys
import vlprep.dataset as dataset
real = dataset.iter_tar
def iter_tar(path, *args, **kwargs):
    if str(path).endswith(os.environ["HANG_SHARD"]):
        r, w = os.pipe()
        open(os.environ["HANG_MARK"], "w").close()
        os.read(r, 1)
    return real(path, *args, **kwargs)
dataset.iter_tar = iter_tar
from vltrain.cli import main
sys.argv = ["vltrain", *sys.argv[1:]]
main()
"""


@pytest.mark.slow  # two `vltrain run` processes, each stopped by SIGTERM while blocked reading a shard
@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_ends_a_run_blocked_on_a_read_at_once(shards, tmp_path, workers):
    """A read that never returns (a hung mount): the first SIGTERM gives the read up, saves the last completed step
    and exits 143, instead of waiting for data that never comes."""
    out, mark = tmp_path / "run", tmp_path / "blocked"
    env = {**os.environ, "HANG_SHARD": "shard-000003.tar", "HANG_MARK": str(mark)}
    proc = subprocess.Popen([sys.executable, "-c", HANGING_RUN, "run", str(shards), "--out", str(out), "--preset",
                             "clip", "--batch-size", "4", "--device", "cpu", "--steps", "1000",
                             *tiny_args("--set", f"data.workers={workers}", "--set", "data.val_frac=0")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: a failed run's loader worker is killed too
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing left in the group after a clean exit
        except ProcessLookupError:
            pass
        proc.wait()
    # workers=0 ends in about a second; a loader worker costs the DataLoader's 5 s join before it is terminated
    assert took < (10 if workers == 0 else 20), (took, text)
    assert proc.returncode == 143, text
    step = torch.load(out / "last.pt", weights_only=True)["step"]
    assert f"stopped at step {step} of 1000" in text and "--resume" in text and "Traceback" not in text, text
    assert "giving up the read of the next batch" in text


def test_a_shard_that_is_not_a_regular_file_is_one_line(shards, tmp_path):
    """A FIFO (or folder) in a shard's place would block its reader, and no tar reader can seek in it."""
    import shutil

    data = tmp_path / "ds"
    shutil.copytree(shards, data)
    (data / "shard-000003.tar").unlink()
    os.mkfifo(data / "shard-000003.tar")
    line = error_line(run(data, tmp_path / "run", "--preset", "clip", "--steps", "2"))
    assert "shard-000003.tar: not a regular file" in line


def test_checkpoints_also_follow_the_wall_clock(shards, tmp_path, monkeypatch):
    from vltrain import train as train_mod

    saved = []
    real = resume.save
    monkeypatch.setattr(resume, "save", lambda obj, path: (saved.append((obj["step"], path.name)),
                                                                       real(obj, path)))
    cfg = load_config("clip", sets=[*TINY, "ckpt_every=1000", "eval_every=1000"], shards=[str(shards)],
                      out=str(tmp_path / "a"), steps=3, batch_size=4, device="cpu")
    train_mod.train(cfg)
    # ckpt_every and 10 minutes both far away: the final step's save, before its evaluation (which can then never
    # cost trained steps), and once more because that evaluation set best.pt's score, which a resume must know
    assert [s for s, n in saved if n == "last.pt"] == [3, 3]
    assert [s for s, n in saved if n == "best.pt"] == [3]
    saved.clear()
    cfg.out, cfg.ckpt_minutes = str(tmp_path / "b"), 1e-9
    train_mod.train(cfg)
    assert [s for s, n in saved if n == "last.pt"] == [1, 2, 3, 3]


# --- what the run tells the user ----------------------------------------------------------------------------------


def test_start_summary_estimate_and_queue_clamp(shards, tmp_path):
    r = run(shards, tmp_path / "r", "--preset", "albef", "--steps", "12", "--set", "model.queue_size=4096",
            "--set", "model.fusion_layers=1",
            "--set", "data.val_frac=0.2")
    assert r.exit_code == 0, r.output
    text = r.output
    n_train = int(re.search(r"train (\d+), held out (\d+)", text).group(1))
    assert f"model.queue_size 4,096 is longer than the training split ({n_train})" in text
    assert f"clamped to {n_train}" in text and f"queue {n_train}" in text
    for part in ("preset albef, 12 steps", "device   cpu (float32, ", "image    tiny on 32px pixels (trained)",
                 "losses   itc 1, itm 1, mlm 1", "trains ", "out      "):
        assert part in text, part
    assert re.search(r"10 steps in [\d.]+ s \([\d.]+ s/step, [\d.]+ samples/s\): the remaining 2 steps take about",
                     text)
    saved = torch.load(tmp_path / "r" / "last.pt", weights_only=True)
    assert saved["config"]["model"]["queue_size"] == n_train == saved["model"]["image_queue"].shape[1]
    assert (tmp_path / "r" / "learning_curve.png").stat().st_size > 1000


def test_run_help_shows_defaults():
    r = CliRunner().invoke(app, ["run", "--help"], terminal_width=200)
    d = Config()
    flat = " ".join(r.output.split())
    for opt, default in (("--steps", d.steps), ("--batch-size", d.batch_size), ("--out", d.out),
                         ("--device", d.device)):
        assert re.search(re.escape(opt) + r"\b.*?\[default: " + re.escape(str(default)) + r"\]", flat), opt


def test_config_prints_every_key_as_yaml_that_loads_back(tmp_path):
    r = CliRunner().invoke(app, ["config", "--preset", "grit", "--set", "loss.itm=0.5"])
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(r.output)
    assert data == to_dict(load_config("grit", sets=["loss.itm=0.5"]))
    assert data["loss"]["itm"] == 0.5 and data["sampler"]["kind"] == "grit" and "ckpt_minutes" in data
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({k: v for k, v in data.items() if k != "preset"}))
    assert to_dict(load_config("grit", f)) == data  # the printed YAML is a valid --config file


def test_eval_table_labels_both_directions(shards, trained):
    r = CliRunner().invoke(app, ["eval", str(trained / "last.pt"), str(shards)], terminal_width=200)
    assert r.exit_code == 0, r.output
    for header in ("TR@1", "TR@5", "TR@10", "IR@1", "IR@5", "IR@10", "image→text", "text→image"):
        assert header in r.output


def test_loading_the_packaged_text_model_is_quiet(capfd):
    from vltrain.config import ModelConfig
    from vltrain.model import build_model

    build_model(ModelConfig(image_model="tiny", fusion_layers=0))
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "Loading weights" not in out + err and "\x1b[" not in out + err


@pytest.mark.slow  # a `vltrain run` process and two runs in this one, each with 2 loader workers
def test_fresh_runs_are_a_function_of_the_seed(shards, tmp_path):
    """Run a (seed 0) and run c (seed 1) in this process, run b (seed 0) in a fresh one: a == b holds across processes
    (another PYTHONHASHSEED, other global RNG states, other loader worker processes), and a != c says the seed is
    what changes a run. c runs after a in the same process, whose global RNGs a's run has moved on."""
    args = ["--preset", "albef", "--steps", "6", "--set", "model.queue_size=8", "--set", "data.workers=2",
            "--set", "model.fusion_layers=1"]
    for name, seed in (("a", 0), ("c", 1)):
        r = run(shards, tmp_path / name, *args, "--set", f"seed={seed}")
        assert r.exit_code == 0, r.output
    subprocess.run([*VLTRAIN, "run", str(shards), "--out", str(tmp_path / "b"), "--batch-size", "4", "--device", "cpu",
                    *tiny_args(*args, "--set", "seed=0")], check=True, capture_output=True)
    a, b, c = (metric_rows(tmp_path / n) for n in "abc")
    assert a == b and a != c

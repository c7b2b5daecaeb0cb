"""A training run that lives in object storage (`vltrain run ... --out s3://...`), against moto's standalone S3 server
on 127.0.0.1 (tests/integration/servers.py): every run file in the bucket, last.pt uploaded last, a resume from the
bucket continuing exactly, the lock object refusing a second run, and kill -9 then --resume. No other address is
contacted; the endpoint and credentials come from the standard AWS_* variables only."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from tests.integration.test_objstore import s3  # noqa: F401  (the module's moto server with the bucket `bkt`)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
# tests/vltrain/test_train.py's tiny model; a constant lr makes a K-step run's schedule the N-step run's
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
        "optim.lr=0.01", "data.val_frac=0.2", "eval_every=2", "ckpt_every=2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """24 pairs in 6 shards (the trainer tests' data)."""
    return colour_pairs(tmp_path_factory.mktemp("remote-run"), 24)


def args(shards: Path, out: str, *extra: str) -> list[str]:
    return ["run", str(shards), "--out", out, "--batch-size", "8", "--device", "cpu", "--preset", "clip",
            *[x for s in TINY for x in ("--set", s)], *extra]


def train(shards: Path, out: str, *extra: str):
    from vltrain.cli import app

    return CliRunner().invoke(app, args(shards, out, *extra))


def objects(prefix: str) -> dict[str, bytes]:
    """Every object under s3://bkt/PREFIX/, nested ones too (tb/...), by name relative to it."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    base = f"bkt/{prefix}/"
    return {p[len(base):]: fs.cat_file(p) for p in fs.find(base)}


def losses(metrics: bytes) -> dict[int, dict]:
    """metrics.jsonl's training rows by step, without their timing."""
    rows = [json.loads(line) for line in metrics.decode().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if k != "samples_per_s"} for r in rows if "total" in r}


@pytest.fixture(scope="module")
def straight(s3, shards) -> dict[str, bytes]:
    """The objects of a 4-step run into s3://bkt/straight (the numbers the other runs must give)."""
    r = train(shards, "s3://bkt/straight", "--steps", "4")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "wrote s3://bkt/straight/" in r.output
    return objects("straight")


def test_a_run_into_s3_leaves_every_file_in_the_bucket_and_nothing_behind(straight, shards):
    import torch

    from vlprep.output import staging

    names = set(straight)
    assert {"last.pt", "best.pt", "metrics.jsonl", "result.json", "learning_curve.png"} <= names, names
    assert any(n.startswith("tb/events.out.tfevents") for n in names), names
    assert ".vlprep.lock" not in names  # released
    assert not staging("s3://bkt/straight").exists()  # the staging folder is removed
    assert sorted(losses(straight["metrics.jsonl"])) == [1, 2, 3, 4]
    result = json.loads(straight["result.json"])
    assert result["out"] == "s3://bkt/straight" and result["step"] == 4
    import io

    ckpt = torch.load(io.BytesIO(straight["last.pt"]), weights_only=True)
    assert ckpt["step"] == 4 and ckpt["config"]["out"] == "s3://bkt/straight"


def test_a_run_resumed_from_the_bucket_continues_exactly(straight, shards, monkeypatch):
    """2 steps, then --resume to 4: last.pt, best.pt and metrics.jsonl come back from the bucket (the staging
    folder is emptied between the runs) and the losses are the straight run's, bit for bit. Each time last.pt goes
    up, the bucket's metrics.jsonl already holds the rows of its step (what a reader or a resume sees)."""
    import io

    import torch

    from vlprep import objstore

    put = objstore.put_file
    seen = []

    def checked_put(local: Path, url: str) -> None:
        put(local, url)
        if url.endswith("/last.pt"):
            got = objects("split")
            step = torch.load(io.BytesIO(got["last.pt"]), weights_only=True)["step"]
            seen.append((step, max(losses(got["metrics.jsonl"]))))

    monkeypatch.setattr(objstore, "put_file", checked_put)
    r = train(shards, "s3://bkt/split", "--steps", "2")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert seen and all(step == rows for step, rows in seen), seen
    assert json.loads(objects("split")["result.json"])["step"] == 2
    r = train(shards, "s3://bkt/split", "--steps", "4")  # without --resume: refused, the bucket kept
    assert r.exit_code == 2 and "error: s3://bkt/split already holds a run (last.pt, best.pt" in r.output, r.output
    r = train(shards, "s3://bkt/split", "--steps", "4", "--resume", "--set", "model.embed_dim=8")
    assert r.exit_code == 2 and "was trained with another config (model.embed_dim: 16 -> 8)" in r.output, r.output
    assert ".vlprep.lock" not in objects("split")  # a refused or failed run lets go of the lock
    r = train(shards, "s3://bkt/split", "--steps", "4", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "resumed from step 2 of 4 (s3://bkt/split/last.pt)" in r.output
    assert losses(objects("split")["metrics.jsonl"]) == losses(straight["metrics.jsonl"])
    assert [step for step, _ in seen][-1] == 4 and all(step == rows for step, rows in seen), seen


def test_overwrite_deletes_the_earlier_run_objects_only(straight, shards):
    import s3fs

    s3fs.S3FileSystem().pipe_file("bkt/ow/notes.txt", b"mine")
    r = train(shards, "s3://bkt/ow", "--steps", "2")
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = train(shards, "s3://bkt/ow", "--steps", "2", "--overwrite")
    assert r.exit_code == 0, r.output + repr(r.exception)
    got = objects("ow")
    assert got["notes.txt"] == b"mine"
    assert len([n for n in got if n.startswith("tb/")]) == 1  # the first run's event file went with --overwrite


def error_line(result) -> str:
    """The run's one 'error:' line, its last, no traceback."""
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and [ln for ln in lines if ln.startswith("error: ")] == lines[-1:], result.output
    assert "Traceback" not in result.output
    return lines[-1]


def test_a_read_only_scheme_is_one_line_and_another_spelling_of_a_run_url_is_that_run(straight, shards):
    assert error_line(train(shards, "https://h/run", "--steps", "1")) == (
        "error: --out https://h/run: https:// is read-only here; write to s3://, gs:// or a local folder")
    assert error_line(train(shards, "s3a://bkt/straight/tb/..", "--steps", "1")).startswith(
        "error: s3://bkt/straight already holds a run (last.pt, best.pt, metrics.jsonl, result.json")
    assert objects("straight") == straight  # nothing touched


def test_kill_9_then_resume_continues_exactly_and_a_second_run_is_refused_meanwhile(straight, shards):
    """A run in a process of its own, killed with SIGKILL once its first last.pt is in the bucket: while it runs, a
    second run into the same OUT is refused in one line naming it; then --resume (past the dead process's lock, as
    vlprep's stages do) ends with the straight run's losses."""
    import s3fs

    fs = s3fs.S3FileSystem()
    proc = subprocess.Popen([sys.executable, "-m", "vltrain.cli", *args(shards, "s3://bkt/killed", "--steps", "400")],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            fs.invalidate_cache()
            if fs.exists("bkt/killed/last.pt"):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        r = train(shards, "s3://bkt/killed", "--steps", "4", "--resume")
        assert r.exit_code == 2, r.output
        assert f"error: OUT s3://bkt/killed is being written by another vltrain process (pid {proc.pid} on " in r.output
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    import io

    import torch

    step = torch.load(io.BytesIO(objects("killed")["last.pt"]), weights_only=True)["step"]
    assert step >= 2 and step % 2 == 0
    # the resumed run must reach the straight run's length: a constant lr, so --steps only says where it stops
    r = train(shards, "s3://bkt/killed", "--steps", str(step + 2), "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert f"resumed from step {step} of {step + 2}" in r.output
    rows = losses(objects("killed")["metrics.jsonl"])
    assert sorted(rows) == list(range(1, step + 3))
    want = losses(straight["metrics.jsonl"])
    assert [rows[s] for s in (1, 2, 3, 4)] == [want[s] for s in (1, 2, 3, 4)]


def test_sigterm_uploads_last_pt_says_its_url_and_lets_go_of_the_lock(s3, shards):
    """A pre-empted machine's notice (SIGTERM): the run saves last.pt, uploads it, names its URL in its one line,
    exits 143 and leaves no lock object, so a restart on another machine is not refused."""
    import io

    import s3fs
    import torch

    from vlprep.output import staging

    fs = s3fs.S3FileSystem()
    proc = subprocess.Popen([sys.executable, "-m", "vltrain.cli", *args(shards, "s3://bkt/term", "--steps", "400")],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            fs.invalidate_cache()
            if fs.exists("bkt/term/last.pt"):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 143, err
    got = objects("term")
    step = torch.load(io.BytesIO(got["last.pt"]), weights_only=True)["step"]
    assert err.strip().splitlines()[-1] == (f"stopped at step {step} of 400: s3://bkt/term/last.pt holds it; run the "
                                            "same command with --resume to continue")
    assert max(losses(got["metrics.jsonl"])) == step
    assert ".vlprep.lock" not in got and not staging("s3://bkt/term").exists()


def test_an_upload_that_fails_keeps_the_staging_folder_and_says_where(s3, shards, monkeypatch):
    """A put that fails after its retries stops the run in one line naming the staging folder that holds the newer
    last.pt (nothing trained is lost), and the lock is let go."""
    import io
    import shutil

    import torch

    from vlprep import objstore
    from vlprep.output import staging

    put = objstore.put_file
    sent = []

    def failing_put(local: Path, url: str) -> None:
        if url.endswith("/last.pt") and sent:
            raise objstore.RemoteError(f"{url}: cannot write it after 3 tries (ConnectionError: reset)")
        put(local, url)
        if url.endswith("/last.pt"):
            sent.append(url)

    monkeypatch.setattr(objstore, "put_file", failing_put)
    folder = staging("s3://bkt/failing")
    try:
        r = train(shards, "s3://bkt/failing", "--steps", "4", "--set", "eval_every=1000")
        assert error_line(r) == (f"error: s3://bkt/failing/last.pt: cannot write it after 3 tries (ConnectionError: "
                                 f"reset); the run's files are kept in {folder}: copy them to OUT (aws s3 sync / "
                                 "gcloud storage rsync) before running again with --resume, which starts from OUT's "
                                 "last.pt")
        assert torch.load(folder / "last.pt", weights_only=True)["step"] == 4
        got = objects("failing")
        assert torch.load(io.BytesIO(got["last.pt"]), weights_only=True)["step"] == 2
        assert ".vlprep.lock" not in got
    finally:
        shutil.rmtree(folder, ignore_errors=True)

"""`vltrain eval` / `export` with CHECKPOINT at a URL, against moto's S3 server on 127.0.0.1 (also read over plain
http://, path-style): the results equal the local checkpoint's exactly, the downloaded copy is gone afterwards (also
after an error, Ctrl-C or SIGTERM), credentials in the URL appear nowhere, and a missing object, missing credentials, a folder
or a file that is not a checkpoint are each one line."""

import json
import os
import re
import select
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import colour_pairs, tiny_checkpoint
from tests.integration.test_objstore import s3  # noqa: F401  (the module's moto server with the bucket `bkt`)
from vltrain.cli import app

pytestmark = pytest.mark.slow  # a moto server per module (about 2 s to start) and a few evals of a tiny model
EVAL = {"retrieval": {"i2t_r1": 25.0, "t2i_r1": 16.67, "mean_recall": 63.89}}
SECRETS = ("hunter2", "s3cr3t-t0ken")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def ok(r):
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def one_line_error(r, pattern: str) -> str:
    assert r.exit_code == 2, r.output + repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def copies() -> set[str]:
    """The downloaded checkpoints' folders now in the temporary directory (vltrain.fetchckpt's prefix)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("vltrain-ckpt-*")}


def put(local: Path, key: str) -> None:
    import s3fs

    s3fs.S3FileSystem().put_file(str(local), f"bkt/{key}")


def cat(key: str) -> bytes:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs.cat_file(f"bkt/{key}")


@pytest.fixture(scope="module")
def run(s3, tmp_path_factory):  # noqa: F811
    """A tiny random checkpoint and 12 pairs in 3 shards, locally (run/best.pt, with an eval.json beside it) and in
    the bucket: url/best.pt, url/eval.json and url/notes.txt (not a checkpoint); the moto endpoint."""
    tmp = tmp_path_factory.mktemp("eval-url")
    local = tmp / "run"
    local.mkdir()
    tiny_checkpoint(local / "best.pt")
    (local / "eval.json").write_text(json.dumps(EVAL))
    (local / "notes.txt").write_text("not a checkpoint\n")
    for name in ("best.pt", "eval.json", "notes.txt"):
        put(local / name, f"exp/{name}")
    put(local / "best.pt", "ev/best.pt")  # eval's own folder: its eval.json is uploaded there
    return {"ckpt": local / "best.pt", "shards": colour_pairs(tmp, 12), "endpoint": s3["AWS_ENDPOINT_URL"]}


def test_eval_of_a_url_checkpoint_equals_the_local_one_and_uploads_eval_json_beside_it(run, tmp_path):
    before = copies()
    ok(invoke("eval", run["ckpt"], run["shards"], "--out", tmp_path / "local.json", "--device", "cpu"))
    r = ok(invoke("eval", "s3://bkt/ev/best.pt", run["shards"], "--device", "cpu"))
    assert "wrote s3://bkt/ev/eval.json" in r.output
    local = json.loads((tmp_path / "local.json").read_text())
    remote = json.loads(cat("ev/eval.json"))
    assert remote.pop("checkpoint") == "s3://bkt/ev/best.pt" and local.pop("checkpoint") == str(run["ckpt"])
    assert remote == local  # the same weights, the same shards: every number equal
    assert copies() == before


def test_export_of_a_url_checkpoint_equals_the_local_one_with_its_sidecars(run, tmp_path):
    before = copies()
    ok(invoke("export", run["ckpt"], tmp_path / "local"))
    ok(invoke("export", "s3://bkt/exp/best.pt", tmp_path / "remote"))
    for name in ("model.safetensors", "tokenizer/tokenizer.json"):
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    local = json.loads((tmp_path / "local" / "config.json").read_text())
    remote = json.loads((tmp_path / "remote" / "config.json").read_text())
    assert remote["source"].pop("checkpoint") == "s3://bkt/exp/best.pt"
    assert local["source"].pop("checkpoint") == str(run["ckpt"].resolve())
    assert remote["eval"] and remote == local  # eval.json beside the checkpoint came along (eval numbers)
    assert "s3://bkt/exp/best.pt" in (tmp_path / "remote" / "README.md").read_text()
    assert copies() == before


def test_credentials_in_an_http_url_appear_in_no_message_or_file(run, tmp_path):
    """moto serves the bucket path-style over http://; the userinfo and the token are not needed and never shown."""
    host = run["endpoint"].split("://", 1)[1]
    url = f"http://reader:{SECRETS[0]}@{host}/bkt/ev/best.pt?token={SECRETS[1]}"
    before = copies()
    r = ok(invoke("eval", url, run["shards"], "--out", tmp_path / "e.json", "--device", "cpu"))
    saved = (tmp_path / "e.json").read_text()
    assert json.loads(saved)["checkpoint"] == f"http://{host}/bkt/ev/best.pt?token=***"
    r2 = invoke("eval", url, run["shards"], "--device", "cpu")  # http(s):// is read-only: no default OUT
    one_line_error(r2, r"http:// is read-only.*give --out PATH")
    missing = url.replace("best.pt", "gone.pt")
    r3 = invoke("eval", missing, run["shards"], "--out", tmp_path / "x.json", "--device", "cpu")
    one_line_error(r3, rf"^error: CHECKPOINT http://{re.escape(host)}/bkt/ev/gone\.pt\?token=\*\*\*: not found$")
    r4 = invoke("export", url.replace("ev/best.pt", "exp/notes.txt"), tmp_path / "x")
    one_line_error(r4, r"http://127\.0\.0\.1:\d+/bkt/exp/notes\.txt\?token=\*\*\*: not a vltrain checkpoint")
    for text in (r.output, saved, r2.output, r3.output, r4.output):
        assert not any(s in text for s in SECRETS), text
    assert copies() == before


def test_a_missing_object_a_folder_and_a_text_file_are_one_line_naming_the_url(run, tmp_path):
    before = copies()
    one_line_error(invoke("eval", "s3://bkt/ev/nope.pt", run["shards"], "--device", "cpu"),
                   r"^error: CHECKPOINT s3://bkt/ev/nope\.pt: not found$")
    one_line_error(invoke("export", "s3://bkt/exp", tmp_path / "x"),
                   r"^error: CHECKPOINT s3://bkt/exp is a folder, not a checkpoint file")
    line = one_line_error(invoke("export", "s3://bkt/exp/notes.txt", tmp_path / "x"),
                          r"^error: s3://bkt/exp/notes\.txt: not a vltrain checkpoint")
    assert tempfile.gettempdir() not in line  # the URL, never the temporary copy
    assert not (tmp_path / "x").exists() and copies() == before


def test_missing_credentials_are_one_line_that_names_the_variables(run, tmp_path, monkeypatch):
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        one_line_error(invoke("export", "s3://bkt/exp/best.pt", tmp_path / "x"),
                       r"^error: CHECKPOINT s3://bkt/exp/best\.pt: no credentials to read it .*AWS_ACCESS_KEY_ID")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_the_copy_is_private_and_removed_after_ctrl_c(run):
    from vltrain.fetchckpt import local_checkpoint

    with pytest.raises(KeyboardInterrupt):
        with local_checkpoint("s3://bkt/exp/best.pt") as path:
            assert path.read_bytes() == run["ckpt"].read_bytes()
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # no other user reads the weights
            raise KeyboardInterrupt
    assert not path.parent.exists()


def test_sigterm_during_the_evaluation_of_a_url_checkpoint_removes_the_copy(run, tmp_path):
    """`vltrain eval s3://...` in a process of its own (the signal ends it), its TMPDIR a folder of the test's, held
    after the model is loaded (a sleep patched around vltrain.evaluate's `load`): SIGTERM ends it as SIGTERM does
    (returncode -15, no traceback) and the downloaded copy's folder is gone."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = textwrap.dedent(f"""
        import time
        from vltrain import evaluate
        from vltrain.cli import app

        def held(*args, **kwargs):
            loaded = load(*args, **kwargs)
            print("loaded", flush=True)
            time.sleep(60)
            return loaded

        load, evaluate.load = evaluate.load, held
        app(["eval", "s3://bkt/ev/best.pt", {str(run["shards"])!r}, "--device", "cpu", "--out",
             {str(tmp_path / "e.json")!r}])
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "TMPDIR": str(tmp)})  # the moto server's AWS_* variables included
    try:
        ready, _, _ = select.select([p.stdout], [], [], 60)
        assert ready and p.stdout.readline() == b"loaded\n", p.stderr.read().decode() if p.poll() is not None else ""
        [copy] = tmp.glob("vltrain-ckpt-*")
        assert (copy / "best.pt").read_bytes() == run["ckpt"].read_bytes()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == -signal.SIGTERM
        assert "Traceback" not in p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert list(tmp.iterdir()) == [] and not (tmp_path / "e.json").exists()


def test_benchmark_of_a_url_checkpoint_equals_the_local_one_and_uploads_its_result_beside_it(run, tmp_path):
    """CLIP_benchmark's zero-shot classification on a 2-class WebDataset (test_benchmark's layout)."""
    import numpy as np

    from tests.vltrain.test_benchmark import png, write_wds

    rng = np.random.default_rng(0)
    write_wds(tmp_path / "zs", [{"__key__": f"c{c}_{i}", "png": png(rng), "cls": c} for c in (0, 1) for i in (0, 1)])
    (tmp_path / "zs" / "classnames.txt").write_text("cat\nred car\n")
    (tmp_path / "zs" / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
    args = ["--dataset", "wds/tiny", "--dataset-root", tmp_path / "zs", "--task", "zeroshot_classification",
            "--num-workers", 0]
    ok(invoke("benchmark", run["ckpt"], *args, "--output", tmp_path / "local.json"))
    ok(invoke("benchmark", "s3://bkt/ev/best.pt", *args))
    local = json.loads((tmp_path / "local.json").read_text())
    remote = json.loads(cat("ev/benchmark_wds_tiny_zeroshot_classification.json"))
    assert remote.pop("pretrained") == "s3://bkt/ev/best.pt" and local.pop("pretrained") == str(run["ckpt"])
    assert remote == local


def test_a_refused_upload_of_eval_json_keeps_the_result_locally_in_one_line(run, monkeypatch, tmp_path):
    """A bucket this user may only read: the upload's RemoteError (objstore's line, after its retries) comes after
    the evaluation, so the result is saved in the current folder first (never over a file there: eval-2.json beside
    the user's eval.json) and the line names that file and the way out, --out PATH."""
    from vlprep import objstore

    def refuse(local, url):
        raise objstore.RemoteError(f"{url}: cannot write it (ClientError: AccessDenied)")

    ok(invoke("eval", run["ckpt"], run["shards"], "--out", tmp_path / "local.json", "--device", "cpu"))
    monkeypatch.setattr(objstore, "put_file", refuse)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval.json").write_text("the user's own file\n")
    r = invoke("eval", "s3://bkt/ev/best.pt", run["shards"], "--device", "cpu")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    kept = tmp_path / "eval-2.json"
    assert r.output.splitlines()[-1] == ("error: s3://bkt/ev/eval.json: cannot write it (ClientError: AccessDenied); "
                                         f"the result is saved in {kept} instead (give --out PATH to write it to a "
                                         "local file)")  # after the table
    assert (tmp_path / "eval.json").read_text() == "the user's own file\n"
    saved = json.loads(kept.read_text())
    local = json.loads((tmp_path / "local.json").read_text())
    assert saved.pop("checkpoint") == "s3://bkt/ev/best.pt" and local.pop("checkpoint") == str(run["ckpt"])
    assert saved == local  # what the upload would have written: every number


def test_gradcam_reads_a_url_checkpoint_and_its_errors_name_the_url(run, tmp_path):
    """The tiny checkpoint has no fusion encoder: gradcam's own one-line refusal, naming the URL, not the copy."""
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")
    before = copies()
    line = one_line_error(invoke("gradcam", "s3://bkt/ev/best.pt", tmp_path / "red.png", "a red car", "--out",
                                 tmp_path / "g.png", "--device", "cpu"), r"^error: s3://bkt/ev/best\.pt has no fusion")
    assert tempfile.gettempdir() not in line and copies() == before

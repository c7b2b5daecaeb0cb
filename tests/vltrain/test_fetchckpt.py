"""vltrain.fetchckpt without a server: where a result whose upload was refused is kept (keep_copy, upload_result),
and SIGTERM during a URL checkpoint's block (the downloaded copy removed, the process ended as SIGTERM ends it, the
handler found restored)."""

import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from vlprep import objstore
from vltrain.errors import TrainError
from vltrain.fetchckpt import keep_copy, unwound_on_sigterm, upload_result


@pytest.fixture
def result(tmp_path) -> Path:
    (tmp_path / "made").mkdir()
    path = tmp_path / "made" / "eval.json"
    path.write_text('{"retrieval": {}}\n')
    return path


def test_keep_copy_takes_a_free_name_in_the_current_folder_and_never_replaces_a_file(result, tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    (here / "eval.json").write_text("mine")
    (here / "eval-2.json").write_text("mine too")
    assert keep_copy(result) == here / "eval-3.json"
    assert keep_copy(result) == here / "eval-4.json"
    assert (here / "eval-3.json").read_bytes() == result.read_bytes() == (here / "eval-4.json").read_bytes()
    assert (here / "eval.json").read_text() == "mine" and (here / "eval-2.json").read_text() == "mine too"


def test_keep_copy_falls_back_to_the_temporary_folder_and_else_gives_none(result, tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # the current folder removed: it cannot be written (a read-only one, even for root)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert keep_copy(result) == tmp_path / "eval.json"
    assert (tmp_path / "eval.json").read_bytes() == result.read_bytes()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    assert keep_copy(result) is None


def test_a_refused_upload_is_one_line_naming_the_kept_copy(result, tmp_path, monkeypatch):
    def refuse(local, url):
        raise objstore.RemoteError(f"{url}: cannot write it (ClientError: AccessDenied)")

    monkeypatch.setattr(objstore, "put_file", refuse)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainError) as e:
        upload_result(result, "s3://bkt/run/eval.json", "--output")
    assert str(e.value) == ("s3://bkt/run/eval.json: cannot write it (ClientError: AccessDenied); the result is saved "
                            f"in {tmp_path / 'eval.json'} instead (give --output PATH to write it to a local file)")
    assert (tmp_path / "eval.json").read_bytes() == result.read_bytes()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    (tmp_path / "ro").mkdir()
    monkeypatch.chdir(tmp_path / "ro")
    (tmp_path / "ro").rmdir()
    with pytest.raises(TrainError, match=r"AccessDenied\); the result could not be saved locally either \(give "
                                         r"--output PATH"):
        upload_result(result, "s3://bkt/run/eval.json", "--output")


def test_the_sigterm_handler_is_set_over_the_default_only_and_restored_after():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with unwound_on_sigterm():
        assert callable(signal.getsignal(signal.SIGTERM))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(ValueError), unwound_on_sigterm():  # an error: restored as well
        raise ValueError
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def own(signum, frame):  # an application's own handler is its policy: left in place
        pass

    before = signal.signal(signal.SIGTERM, own)
    try:
        with unwound_on_sigterm():
            assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)
    seen = []

    def in_a_thread():  # only the main thread may set handlers: elsewhere the block runs without one
        with unwound_on_sigterm():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert seen == [signal.SIG_DFL]


def test_sigterm_inside_the_block_runs_its_finally_then_ends_the_process_as_sigterm_does(tmp_path):
    """A process of its own (the signal ends it): the block's `finally` writes a file, nothing after the block runs,
    and the exit is SIGTERM's (returncode -15), not an exception's (1) or a traceback."""
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from vltrain.fetchckpt import unwound_on_sigterm

        with unwound_on_sigterm():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                Path({str(tmp_path / "continued")!r}).touch()
            finally:
                Path({str(tmp_path / "cleaned")!r}).touch()
        Path({str(tmp_path / "after")!r}).touch()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGTERM, p.stderr
    assert p.stderr == ""
    assert sorted(f.name for f in tmp_path.iterdir()) == ["cleaned"]

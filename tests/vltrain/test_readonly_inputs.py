"""Inputs are never written to: GRIT / TOnICS runs read shards by index (once through wids, whose lock files landed
beside the dataset); a shard the file system refuses to open gets a line about that, not advice to re-create good
data."""

import builtins
import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from vltrain.cli import app
from vltrain.data.indexed import IndexedShards

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01", "data.val_frac=0",
        "eval_every=1000", "data.workers=0", "sampler.kind=grit"]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("ro"), 24, per_shard=8)


def grit_run(ds, out, *args):
    return CliRunner().invoke(app, ["run", str(ds), "--preset", "clip", "--batch-size", "4", "--steps", "6",
                                    "--device", "cpu", "--out", str(out), *[a for s in TINY for a in ("--set", s)],
                                    *args])


def snapshot(folder: Path) -> dict:
    """Every name under the folder (the folder itself included) -> its mtime in ns: a file created and removed again
    (a lock file) still changes the folder's own mtime."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in [folder, *folder.rglob("*")]}


def refuse_writes_under(monkeypatch, folder: Path, err: int = errno.EROFS, suffix: str = "") -> list:
    """open() for writing under `folder` (and of names ending in `suffix`) fails as a read-only mount does, and
    reading a `.tar` under `folder` too when err is EACCES; returns the refused paths."""
    real_open, refused = builtins.open, []

    def guarded(file, mode="r", *args, **kwargs):
        given = os.path.abspath(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        path = os.path.realpath(given)  # where a link leads
        writing = any(c in mode for c in "wax+")
        if path.endswith(suffix) and (path.startswith(str(folder)) or suffix) and (
                writing or (err == errno.EACCES and path.endswith(".tar"))):
            refused.append(path)
            raise OSError(err, os.strerror(err), given)  # the kernel names the path as given
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    return refused


def test_a_grit_run_leaves_its_input_folder_untouched(ds, tmp_path):
    """Before: wids made shard-*.tar.lock beside each shard (and removed it), changing the input folder."""
    os.chmod(ds, 0o555)  # as a user sees a read-only dataset (root writes anyway: the snapshot is the check)
    try:
        before = snapshot(ds)
        r = grit_run(ds, tmp_path / "run")
        assert r.exit_code == 0, r.output
        assert snapshot(ds) == before
    finally:
        os.chmod(ds, 0o755)


def test_a_grit_run_trains_when_writes_to_the_dataset_fail(ds, tmp_path, monkeypatch):
    """Before: "shard-000000.tar: not a readable tar (OSError: ...); re-create it" on a read-only dataset."""
    refused = refuse_writes_under(monkeypatch, ds.resolve())
    r = grit_run(ds, tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert refused == []  # nothing even tried to write there


def test_permission_faults_are_not_called_damaged_data(ds, tmp_path, monkeypatch):
    refuse_writes_under(monkeypatch, ds.resolve(), errno.EACCES)  # the shard itself cannot be read by this user
    r = grit_run(ds, tmp_path / "run2")
    err = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and len(err) == 1, r.output
    assert "cannot open the shard (PermissionError: Permission denied)" in err[0] and "re-create" not in err[0]


def test_the_index_reader_writes_nothing_anywhere(ds, tmp_path, monkeypatch):
    """Before: wids' lock files (and a folder of links to every shard, for them) under the temp folder."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    shards = IndexedShards([ds])
    assert shards.raw(5)["__key__"] == shards.keys[5]
    assert list(tmp_path.iterdir()) == []

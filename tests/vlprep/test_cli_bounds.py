"""`vlprep` refuses what it cannot do in one line, before it creates anything: URLs where no URL can go, an unbounded --size,
an OUT it cannot write and a --weights file of pickled objects.

Each command runs as the CLI's main() in this process (tests/conftest.py's cli_in_process): the exit status and every
line that reaches fds 1 and 2 are what a subprocess would give, and none of these claims is about the process itself;
a process per command cost a torch import each (about a second apiece, 15 commands)."""

import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import colour_pairs

LOCAL_ONLY = "only dataset folders may be URLs (s3://, gs://, http(s)://); give a local path"
SCHEMES = "use s3://, gs://, http(s):// or file://"


def error_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stdout + r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    return colour_pairs(tmp_path_factory.mktemp("bounds"), 8)


def test_urls_are_refused_where_no_url_can_go_before_anything_is_created(ds, tmp_path, vlprep):
    """Before: `vlprep shards SRC s3://b2/raw` created ./s3:/b2/raw/ with a lock, a run file and .tar.tmp files, then
    died with a pyarrow traceback. Dataset folders may be URLs now (tests/integration/test_objstore.py); a source
    table, weights, a checkpoint or a stats folder may not, an http(s) OUT is read-only, and an unknown scheme is
    named. No URL here is ever contacted: each is refused while the arguments are parsed."""
    src = ds.parent / "src"
    for args, says in ((["shards", "https://h/t.csv", "out"], f"SRC https://h/t.csv: {LOCAL_ONLY}"),
                       (["shards", src, "ftp://b2/raw"], f"OUT ftp://b2/raw: unsupported URL scheme ftp://; {SCHEMES}"),
                       (["features", ds, "http://h/feat"], "OUT http://h/feat: http:// is read-only here; write to "
                                                           "s3://, gs:// or a local folder"),
                       (["bow", "hdfs://b/ds", "out"], f"SRC hdfs://b/ds: unsupported URL scheme hdfs://; {SCHEMES}"),
                       (["detect", ds, "out", "--weights", "s3://b/w.pt"], f"--weights s3://b/w.pt: {LOCAL_ONLY}"),
                       (["stats", ds, "--out", "http://h/stats"], f"--out http://h/stats: {LOCAL_ONLY}"),
                       (["embed", ds, "out", "--checkpoint", "s3://b/last.pt"],
                        f"--checkpoint s3://b/last.pt: {LOCAL_ONLY}")):
        assert error_line(vlprep(*args, cwd=tmp_path)) == f"error: {says}", args
    assert list(tmp_path.iterdir()) == []
    r = vlprep("stats", ds, "--out", "C:/stats", cwd=tmp_path)  # a drive letter is a local (relative) path here
    assert r.returncode == 0 and (tmp_path / "C:" / "stats" / "report.json").is_file(), r.stderr


def test_features_size_is_bounded(ds, tmp_path, vlprep):
    """Before: --size 100000 tried a 120 GB allocation for the probe image."""
    for size in (100000, 16):
        assert error_line(vlprep("features", ds, tmp_path / "f", "--size", size)) == \
            "error: --size must be in [32, 1024] (the encoders downsample by 32; 1024 gives 32 x 32 tokens an " \
            f"image), got {size}"
    assert not (tmp_path / "f").exists()


def test_an_out_that_cannot_be_written_is_one_line(ds, tmp_path, vlprep):
    """OUT lies under a regular file, so creating it fails with NotADirectoryError even for root (tests run as root,
    where a chmod'ed read-only folder would still be writable). Before: an OSError traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert error_line(vlprep("stats", ds, "--out", blocker / "stats")) == \
        f"error: cannot write {blocker / 'stats'}: not a directory"
    assert error_line(vlprep("features", ds, blocker / "feat", "--size", 32, "--workers", 1)) == \
        f"error: cannot write {blocker / 'feat'}: not a directory"
    assert blocker.read_text() == "x" and list(tmp_path.iterdir()) == [blocker]


def test_a_pickled_weights_file_is_refused_with_the_safe_way_to_resave_it(ds, tmp_path, vlprep):
    """Before: the message quoted torch's "This file can still be loaded ... two options", the weights_only=False
    route that runs the file's code."""
    import torchvision

    net = torchvision.models.resnet18()
    torch.save(net, tmp_path / "whole.pt")
    line = error_line(vlprep("features", ds, tmp_path / "f", "--image-model", "torchvision:resnet18", "--weights",
                             tmp_path / "whole.pt", "--size", 32))
    assert line == (f"error: refused to load {(tmp_path / 'whole.pt').resolve()}: it holds pickled Python objects (a "
                    "whole model?), which could run code; re-save it as a plain state dict of tensors, "
                    "torch.save(model.state_dict(), PATH), or as .safetensors")
    assert "weights_only" not in line and "trust" not in line and not (tmp_path / "f").exists()
    from safetensors.torch import save_file

    save_file(net.state_dict(), tmp_path / "w.safetensors")  # the suggested route works
    r = vlprep("features", ds, tmp_path / "f", "--image-model", "torchvision:resnet18", "--weights",
               tmp_path / "w.safetensors", "--size", 32, "--workers", 1)
    assert r.returncode == 0, r.stderr

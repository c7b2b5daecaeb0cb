"""vlprep.userfile: the one reader of files a user names (regular files only, a size cap, one-line errors)."""

import os
import threading

import pytest

from vlprep import VlprepError
from vlprep.userfile import OutsideRoot, read_user_file, under_root


def test_read_user_file_reads_a_regular_file_and_refuses_the_rest_in_one_line(tmp_path):
    (tmp_path / "ok.txt").write_bytes(b"a photo of a {}.\n")
    assert read_user_file(tmp_path / "ok.txt", 100) == b"a photo of a {}.\n"
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "link")
    cases = {tmp_path / "fifo": "a FIFO, not a regular file", tmp_path / "link": "a FIFO, not a regular file",
             "/dev/zero": "a character device, not a regular file", tmp_path: "a folder, not a regular file",
             tmp_path / "nope": "not found"}
    said_back = {}

    def read_all():  # in a thread: at worst (a blocking open of the FIFO) the test fails instead of hanging
        for path in cases:
            try:
                read_user_file(path, 1 << 20, f"--templates {path}")
            except VlprepError as e:
                said_back[path] = str(e)

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "a read blocked"
    assert said_back == {path: f"--templates {path}: {said}" for path, said in cases.items()}
    with pytest.raises(VlprepError, match=r"^ok\.txt: 17 bytes; at most 16 are read$"):
        read_user_file(tmp_path / "ok.txt", 16, "ok.txt")
    os.chmod(tmp_path / "ok.txt", 0)
    if os.geteuid() != 0:  # root reads anything
        with pytest.raises(VlprepError, match=r"^cannot read .*ok\.txt: Permission denied$"):
            read_user_file(tmp_path / "ok.txt", 100)


def test_under_root_keeps_paths_inside(tmp_path):
    (tmp_path / "r" / "a").mkdir(parents=True)
    os.symlink(tmp_path, tmp_path / "r" / "up")
    root = str(tmp_path / "r")
    assert under_root(root, ("a", "x.png")) == os.path.join(os.path.realpath(root), "a", "x.png")
    assert under_root(root, ("a/../x.png",)) == os.path.join(os.path.realpath(root), "x.png")
    for parts in (("/etc/passwd",), ("a", "/etc/passwd"), ("../x.png",), ("a", "../../x.png"), ("up", "x.png")):
        with pytest.raises(OutsideRoot):
            under_root(root, parts)
    assert under_root(root, ("up", "x.png"), follow_symlinks=True) == os.path.join(os.path.abspath(root), "up", "x.png")
    with pytest.raises(OutsideRoot):  # `up/..` is tmp_path's parent for the kernel
        under_root(root, ("up", "..", "r", "x.png"), follow_symlinks=True)

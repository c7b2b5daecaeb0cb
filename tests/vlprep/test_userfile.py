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


def in_thread(fn, timeout: float = 60):
    """fn()'s result or exception, from a daemon thread: a blocking read fails the test instead of hanging it."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:  # handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "a read blocked"
    return box


def test_a_fifo_caption_beside_a_folder_image_is_a_counted_missing_caption(tmp_path):
    from tests.conftest import image_bytes
    from vlprep.shards import ShardsConfig, build_shards

    (tmp_path / "imgs").mkdir()
    for name in ("a", "b"):
        (tmp_path / "imgs" / f"{name}.png").write_bytes(image_bytes())
    (tmp_path / "imgs" / "a.txt").write_text("a caption")
    os.mkfifo(tmp_path / "imgs" / "b.txt")
    box = in_thread(lambda: build_shards(ShardsConfig(src=tmp_path / "imgs", out=tmp_path / "out", workers=1)))
    assert (box["value"]["written"], box["value"]["skipped"]) == (1, {"missing_caption": 1})


def test_ontology_overrides_file_is_read_by_the_same_rule(tmp_path):
    from vlprep.ontology import load_overrides

    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "deep.yaml").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "latin1.yaml").write_bytes(b"caf\xe9: dog\n")
    cases = {tmp_path / "fifo.yaml": f"overrides file {tmp_path / 'fifo.yaml'}: a FIFO, not a regular file",
             "/dev/zero": "overrides file /dev/zero: a character device, not a regular file",
             tmp_path / "deep.yaml": f"{tmp_path / 'deep.yaml'}: not valid YAML (nested too deeply)",
             tmp_path / "latin1.yaml": f"{tmp_path / 'latin1.yaml'}: not UTF-8 text (byte 0xe9 at offset 3)"}
    for path, said in cases.items():
        box = in_thread(lambda: load_overrides(path, {"dog"}))
        assert isinstance(box.get("error"), VlprepError) and str(box["error"]) == said, box


def test_a_detections_file_with_an_unhashable_key_deep_nesting_or_a_huge_integer_is_one_line(tmp_path):
    from vlprep.detfile import detection_index

    cases = {'{"key": ["k"], "objects": []}': r"d\.jsonl:1: unknown key \['k'\] \(not in the dataset\)",
             "[" * 100_000 + "]" * 100_000: r"d\.jsonl:1: malformed JSON \(nested too deeply\)",
             '{"key": "k", "objects": [], "n": %s}' % ("9" * 5000): r"d\.jsonl:1: malformed JSON \(Exceeds the limit "}
    for text, said in cases.items():
        (tmp_path / "d.jsonl").write_text(text + "\n")
        with pytest.raises(VlprepError, match="^" + said):
            with detection_index(tmp_path / "d.jsonl", [["k"]]):
                pass

"""vlprep.sources: each source's items in order, images named (path, TarRef, RowRef) rather than carried, errors."""

import io
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import image_bytes
from vlprep import VlprepError
from vlprep.dataset import TarRef
from vlprep.sources import RowRef, load_images, open_source


def test_folder_walk_matches_sorted_rglob(tmp_path):
    """The scandir walk lists what sorted(rglob) + is_file() listed, in the same order, with the same uids."""
    import os

    from vlprep.sources import IMAGE_SUFFIXES, folder_source

    root = tmp_path / "src"
    png = image_bytes(8, 8)
    names = ["a/x.png", "a-b.png", "a.png", "a/b/c.jpg", "A/z.PNG", "..d.png", ".hidden.png", "z.d/e.webp",
             "é/ü.png", "t.tar.png", "noext", "c.txt", "link/in.png"]
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(png)
    (root / "dir.png").mkdir()                                       # a folder named like an image
    os.symlink(root / "a.png", root / "ln.png")                      # a symlinked file is followed
    os.symlink(root / "missing.png", root / "broken.png")            # a broken one is not a file
    os.symlink(root / "link", root / "lnk")                          # a symlinked folder is not entered
    want = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    got = list(folder_source(root).items)
    assert [it.image for it in got] == [str(p) for p in want]
    assert [it.uid for it in got] == [p.relative_to(root).with_suffix("").as_posix() for p in want]
    assert [it.uid for it in got][:3] == ["..d", ".hidden", "A/z"] and "lnk/in" not in [it.uid for it in got]


def test_parquet_rows_are_read_from_the_groups_that_hold_them_and_nothing_more(tmp_path, monkeypatch):
    """Rows in any order, over row groups of uneven sizes (two files written into one), come back as the table holds
    them; each group holding some is read once, the others never."""
    import random

    imgs = [bytes([i % 251]) * (1 + i % 5) for i in range(40)]
    path = tmp_path / "u.parquet"
    with pq.ParquetWriter(path, pa.schema([("jpg", pa.binary()), ("caption", pa.string())])) as w:
        for a, b in ((0, 7), (7, 8), (8, 30), (30, 40)):  # groups of 7, 1, 22 and 10 rows
            w.write_table(pa.table({"jpg": imgs[a:b], "caption": [f"c{i}" for i in range(a, b)]}))
    items = list(open_source(path).items)
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: read.append(g) or original(self, g,
                                                                                                          **kw))
    picks = random.Random(0).sample(range(40), 12) + [7, 29, 30]
    assert load_images([items[i] for i in picks]) == [imgs[i] for i in picks]
    group = [0] * 7 + [1] + [2] * 22 + [3] * 10
    assert sorted(read) == sorted({group[i] for i in picks})


def test_parquet_image_bytes_stay_in_the_file_until_a_worker_reads_them(tmp_path):
    imgs = [image_bytes(10 + i, 10, seed=i) for i in range(7)]
    table = pa.table({"jpg": imgs, "caption": [f"c{i}" for i in range(7)]})
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=3)  # rows span three row groups
    items = list(open_source(tmp_path / "b.parquet").items)
    assert [it.image for it in items] == [RowRef(str(tmp_path / "b.parquet"), "jpg", i) for i in range(7)]
    assert [it.caption for it in items] == [f"c{i}" for i in range(7)]
    assert load_images(items[2:5]) == imgs[2:5]  # only the row groups holding rows 2-4 are read
    hf = pa.table({"image": [{"bytes": b, "path": None} for b in imgs[:2]] + [{"bytes": None, "path": "x.png"}],
                   "text": ["a", "b", "c"]})
    pq.write_table(hf, tmp_path / "hf.parquet")
    items = list(open_source(tmp_path / "hf.parquet").items)
    assert all(isinstance(it.image, RowRef) for it in items)
    assert load_images(items) == imgs[:2] + [str(tmp_path / "x.png")]  # a struct with a path gives the path


def test_webdataset_images_are_tar_references(tmp_path):
    imgs = [image_bytes(12, 12, seed=i) for i in range(3)]
    with tarfile.open(tmp_path / "a.tar", "w") as tf:
        for i, data in enumerate(imgs):
            for ext, payload in (("png", data), ("txt", f"cap {i}".encode())):
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    items = list(open_source(tmp_path / "a.tar").items)
    assert all(isinstance(it.image, TarRef) and it.image.path == str(tmp_path / "a.tar") for it in items)
    assert [it.caption for it in items] == [b"cap 0", b"cap 1", b"cap 2"] and [it.uid for it in items] == ["k0", "k1", "k2"]
    assert load_images(items) == imgs and items[1].image.read() == imgs[1]


def test_table_paths_are_resolved_next_to_the_table(tmp_path):
    (tmp_path / "t.csv").write_text("file,caption\nimg/a.png,A\n/abs/b.png,B\n,C\n")
    items = list(open_source(tmp_path / "t.csv").items)
    assert [it.image for it in items] == [str(tmp_path / "img/a.png"), "/abs/b.png", None]
    assert load_images(items) == [it.image for it in items]  # paths stay paths: the worker opens them


# --- bad input: one-line errors ----------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda p: p / "nope.parquet", "source not found"),
    (lambda p: (p / "x.xlsx").write_text("x") and p / "x.xlsx", "unknown source type '.xlsx'"),
    (lambda p: (p / "x.parquet").write_bytes(b"PAR1 garbage") and p / "x.parquet", "cannot read"),
    (lambda p: (p / "x.jsonl").write_text('{"image": "a", "caption": "b"}\n{oops\n') and p / "x.jsonl",
     r"x.jsonl:2: malformed JSON"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no .tar shards and no images"),
])
def test_unreadable_sources_raise_one_line_errors(tmp_path, make, match):
    with pytest.raises(VlprepError, match=match) as e:
        list(open_source(make(tmp_path)).items)  # some errors show only when the records are read
    assert "\n" not in str(e.value)


def test_url_only_table_gets_a_hint(tmp_path):
    pq.write_table(pa.table({"url": ["http://a"], "caption": ["c"]}), tmp_path / "u.parquet")
    with pytest.raises(VlprepError, match="columns are: url, caption.*img2dataset"):
        open_source(tmp_path / "u.parquet")


@pytest.mark.parametrize("sep,suffix", [(",", "csv"), ("\t", "tsv")])
def test_a_200_kib_caption_in_a_csv_or_tsv_is_read_whole(tmp_path, sep, suffix):
    """Before: `_csv.Error: field larger than field limit (131072)` stopped the whole table at the long caption."""
    long = "snow " * 40_960  # 200 KiB
    cell = f'"{long}"' if suffix == "csv" else long
    (tmp_path / f"t.{suffix}").write_text(f"file{sep}caption\na.png{sep}short\nb.png{sep}{cell}\nc.png{sep}after\n")
    items = list(open_source(tmp_path / f"t.{suffix}").items)
    assert [len(it.caption) for it in items] == [5, len(long), 5]

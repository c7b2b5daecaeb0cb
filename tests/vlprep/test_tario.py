"""vlprep/tario.py's two codecs against the libraries they stand in for. ShardTarWriter writes what webdataset's
TarWriter writes, byte for byte. TarReader reads what tarfile reads: the same members, offsets, sizes and bytes, the
same samples from iter_tar and the same counts from count_tar_samples, on every kind of tar the test suite writes,
and the same error or the same shortened member list on damaged tars (the callers' short-shard checks catch the
latter)."""

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from vlprep import dataset
from vlprep.dataset import VlprepError, count_tar_samples, iter_tar
from vlprep.output import Out, write_shard
from vlprep.tario import ShardTarWriter, TarReader, encode_sample

SAMPLES = [{"__key__": "k" * n, "txt": "x" * size, "png": bytes(range(256)) * (size // 256 + 1)}
           for n, size in [(1, 0), (5, 1), (90, 511), (95, 512), (96, 513), (3, 10240 - 3 * 512), (7, 20000)]]
SAMPLES += [{"__key__": "d/" * 45 + "k" * 20, "txt": "a"},       # 112-byte names: ustar's prefix field
            {"__key__": "café_ü", "txt": "é", "json": {"a": 1, "é": [1, 2]}, "jpg": b"\xff\xd8\xff\xd9"},
            {"__key__": "é" * 48, "txt": "y"},                   # 100 bytes in UTF-8 (96 + ".txt")
            {"__key__": "k", "Z": b"upper", "a_b": b"1", "txt": b"bytes"},
            {"__key__": "__meta__", "txt": "skipped by iter_tar"},
            {"__key__": "sub/dir/x", "txt": "a key with a folder", "npy": b"\x93NUMPY"}]


# --- the writer -------------------------------------------------------------------------------------------------------


def tarwriter_bytes(samples: list[dict]) -> bytes:
    """What webdataset's TarWriter writes with the settings ShardTarWriter promises to match."""
    buf = io.BytesIO()
    with wds.TarWriter(buf, encoder=False, mtime=0, user="", group="", mode=0o644) as tw:
        tw.tarstream.format = tarfile.USTAR_FORMAT
        for s in samples:
            tw.write(encode_sample(s))
        tw.tarstream.close()
        return buf.getvalue()


def ours_bytes(samples: list[dict]) -> bytes:
    buf = io.BytesIO()
    with ShardTarWriter(buf) as tw:
        for s in samples:
            tw.write(encode_sample(s))
    return buf.getvalue()


def test_shard_tar_writer_matches_webdataset_tarwriter():
    samples = [{"__key__": "k" * n, "txt": "x" * size, "png": bytes(range(256)) * (size // 256 + 1)}
               for n, size in [(1, 0), (5, 1), (90, 511), (95, 512), (96, 513), (3, 10240 - 3 * 512), (7, 20000)]]
    samples += [{"__key__": "d/" * 45 + "k" * 20, "txt": "a"},       # 112-byte names: ustar's prefix field
                {"__key__": "café_ü", "txt": "é", "json": {"a": 1, "é": [1, 2]}, "jpg": b"\xff\xd8\xff\xd9"},
                {"__key__": "é" * 48, "txt": "y"},                   # 100 bytes in UTF-8 (96 + ".txt")
                {"__key__": "k", "Z": b"upper", "a_b": b"1", "txt": b"bytes"}]
    for cut in range(len(samples) + 1):  # every length, so every record padding is met
        assert ours_bytes(samples[:cut]) == tarwriter_bytes(samples[:cut])
    assert len(ours_bytes([])) == 10240
    with pytest.raises(ValueError, match="too long"):  # 101 bytes, no '/' to split at: tarfile refuses
        ours_bytes([{"__key__": "k" * 97, "txt": "x"}])
    with pytest.raises(ValueError, match="doesn't map to a bytes"):
        ours_bytes([{"__key__": "k", "cls": 3}])
    one_pass = io.BytesIO()
    with ShardTarWriter(one_pass) as tw:  # write_sample (write_shard's path) writes what write(encode_sample) does
        for s in samples + [{"__key__": "k", "__url__": "u", "_x": b"dropped", "txt": "t"}]:
            tw.write_sample(s)
    assert one_pass.getvalue() == ours_bytes(samples + [{"__key__": "k", "__url__": "u", "_x": b"dropped", "txt": "t"}])
    with pytest.raises(ValueError, match="doesn't map to a bytes"):
        ShardTarWriter(io.BytesIO()).write_sample({"__key__": "k", "cls": 3})
    tw = ShardTarWriter(io.BytesIO())
    for size in (8**11 - 1, 8**11):  # the largest size ustar's 11 octal digits hold, and one over
        info = tarfile.TarInfo("k.txt")
        info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o644, "", ""
        try:
            want = info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")
        except ValueError as e:
            with pytest.raises(ValueError, match=str(e)):
                tw.header("k.txt", size)
        else:
            assert tw.header("k.txt", size) == want


# --- the reader -------------------------------------------------------------------------------------------------------


class TarfileOnly(TarReader):
    """The reference: the same reader with tarfile reading every header."""

    def __iter__(self):
        return self._with_tarfile(0)


def with_tarfile(path: Path) -> tuple[list, str | None]:
    """(name, offset_data, size, bytes) of every regular file as tarfile reads them, and the error it raised."""
    out = []
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if m.isfile():
                    out.append((m.name, m.offset_data, m.size, tf.extractfile(m).read()))
    except tarfile.ReadError as e:
        return out, f"ReadError: {e}"
    return out, None


def with_reader(path: Path, cls=TarReader) -> tuple[list, str | None, bool]:
    """The same through TarReader, and whether its fast path read the whole tar."""
    out, fast = [], None
    try:
        with cls(path) as r:
            for name, offset, size in r:
                out.append((name, offset, size, r.read(offset, size)))
            fast = r.fast
    except tarfile.ReadError as e:
        return out, f"ReadError: {e}", False
    return out, None, fast


def samples(path: Path, **kw) -> tuple[list, str | None]:
    """iter_tar's samples (without __url__) and its one-line error, if any."""
    out = []
    try:
        for s in iter_tar(path, **kw):
            out.append({k: v for k, v in s.items() if k != "__url__"})
    except VlprepError as e:
        return out, str(e)
    return out, None


def assert_same(path: Path, monkeypatch) -> bool:
    """TarReader == tarfile on `path`, member by member and through iter_tar / count_tar_samples; returns whether the
    fast path read it all."""
    want, got = with_tarfile(path), with_reader(path)
    assert got[:2] == want, path
    fast = got[2]
    ours = [samples(path), samples(path, refs=("png", "jpg")), count_tar_samples(path)]
    errors = []
    ours.append(samples(path, handler=lambda e: errors.append(str(e)) or True))
    ours.append(errors)
    monkeypatch.setattr(dataset, "TarReader", TarfileOnly)
    errors = []
    ref = [samples(path), samples(path, refs=("png", "jpg")), count_tar_samples(path),
           samples(path, handler=lambda e: errors.append(str(e)) or True), errors]
    monkeypatch.undo()
    assert ours == ref, path
    return fast


def shard_tar(path: Path, samples_: list[dict]) -> Path:
    with open(path, "wb") as f, ShardTarWriter(f) as tw:
        for s in samples_:
            tw.write(encode_sample(s))
    return path


def wds_tar(path: Path, samples_: list[dict], ustar: bool, mtime: float | None = None) -> Path:
    """webdataset's TarWriter; with its defaults (mtime a float, pax format) each member has a pax header."""
    with open(path, "wb") as f, wds.TarWriter(f, encoder=False, mtime=mtime) as tw:
        if ustar:
            tw.tarstream.format = tarfile.USTAR_FORMAT
        for s in samples_:
            tw.write(encode_sample(s))
    return path


def tarfile_tar(path: Path, members: list, fmt=tarfile.PAX_FORMAT, pax_headers=None) -> Path:
    """Members (name, bytes), or TarInfo objects for the other types, through Python's tarfile."""
    with tarfile.open(path, "w", format=fmt, pax_headers=pax_headers) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tf.addfile(info, io.BytesIO(m[1]))
    return path


def other_types() -> list:
    d, link, fifo = tarfile.TarInfo("folder"), tarfile.TarInfo("k.lnk"), tarfile.TarInfo("k.fifo")
    d.type, link.type, link.linkname, fifo.type = tarfile.DIRTYPE, tarfile.SYMTYPE, "a.txt", tarfile.FIFOTYPE
    return [("a.txt", b"first"), d, link, fifo, ("folder/b.txt", b"x" * 700), ("a.json", b"{}")]


def test_the_same_members_on_every_tar_the_tests_write(tmp_path, monkeypatch):
    long = "l" * 120 + "/" + "m" * 120 + ".txt"
    (tmp_path / "ws").mkdir()
    write_shard(Out(tmp_path / "ws"), "s.tar", [dict(s) for s in SAMPLES[:6]], [{"i": i} for i in range(6)])
    v7dir = tarfile.TarInfo("old-style-dir/")
    v7dir.type = tarfile.AREGTYPE
    tars = {  # name: (path, read by the fast path from end to end)
        "ShardTarWriter": (shard_tar(tmp_path / "ours.tar", SAMPLES), True),
        "ShardTarWriter, empty": (shard_tar(tmp_path / "ours-empty.tar", []), True),
        "write_shard": (tmp_path / "ws" / "s.tar", True),
        "webdataset ustar": (wds_tar(tmp_path / "wds-ustar.tar", SAMPLES, True), True),
        "webdataset defaults": (wds_tar(tmp_path / "wds.tar", SAMPLES, False), False),
        "webdataset mtime 0": (wds_tar(tmp_path / "wds-0.tar", SAMPLES, False, 0), False),  # pax: non-ASCII names
        "webdataset mtime 0, ASCII names": (wds_tar(tmp_path / "wds-ascii.tar", SAMPLES[:7], False, 0), True),
        "tarfile GNU long names": (tarfile_tar(tmp_path / "gnu.tar", [("a.txt", b"1"), (long, b"2"), ("b.txt", b"3")],
                                               tarfile.GNU_FORMAT), False),
        "tarfile pax header": (tarfile_tar(tmp_path / "pax.tar", [("a.txt", b"1"), (long, b"2"), ("é.txt", b"3")]),
                               False),
        "tarfile global pax header": (tarfile_tar(tmp_path / "paxg.tar", [("a.txt", b"1")],
                                                  pax_headers={"comment": "hello"}), False),
        "tarfile empty": (tarfile_tar(tmp_path / "empty.tar", []), True),
        "tarfile dirs, links, a fifo": (tarfile_tar(tmp_path / "types.tar", other_types(), tarfile.USTAR_FORMAT),
                                        True),
        "tarfile v7 directory": (tarfile_tar(tmp_path / "v7.tar", [v7dir, ("a.txt", b"1")]), True),
        "make_tar (test_dataset.py)": (tarfile_tar(tmp_path / "mt.tar", [("a.txt", b"fine"), ("b.pyd", b"p"),
                                                                          ("c.txt", b"y")]), True),
    }
    for name, (path, fast) in tars.items():
        assert assert_same(path, monkeypatch) == fast, name
    with TarReader(tars["ShardTarWriter"][0]) as r:
        assert [m[0] for m in r][:3] == ["k.png", "k.txt", "kkkkk.png"]


def test_damaged_tars_give_what_tarfile_gives(tmp_path, monkeypatch):
    good = shard_tar(tmp_path / "good.tar", SAMPLES).read_bytes()
    with tarfile.open(tmp_path / "good.tar") as tf:
        headers = [m.offset for m in tf]
    cases = {"empty file": b"", "one byte": b"\0", "garbage": np.random.default_rng(0).bytes(5000),
             "zeros then garbage": bytes(1024) + np.random.default_rng(1).bytes(3000)}
    end = headers[-1] + 512 + 1024
    for cut in sorted({*range(0, end, 512), *(h + d for h in headers for d in (1, 100, 511, 513, 700))}):
        cases[f"cut at {cut}"] = good[:cut]
    for i, h in enumerate(headers):
        for at, x in ((h, 0x01), (h + 130, 0x04), (h + 150, 0x01), (h + 156, 0x20), (h + 345, 0x41)):
            b = bytearray(good)  # name, size, checksum, type, prefix: the checksum no longer matches
            b[at] ^= x
            cases[f"header {i} byte {at - h} flipped"] = bytes(b)
        b = bytearray(good)
        b[h:h + 512] = np.random.default_rng(i).bytes(512)
        cases[f"header {i} garbage"] = bytes(b)
    for name, data in cases.items():
        path = tmp_path / "bad.tar"
        path.write_bytes(data)
        assert_same(path, monkeypatch)


def header_with(hdr: bytearray, at: int, field: bytes, signed: bool = False) -> bytes:
    """`hdr` with `field` written at `at` and its checksum made valid again (as a signed sum with `signed`)."""
    hdr[at:at + len(field)] = field
    hdr[148:156] = b" " * 8
    total = sum(b - 256 if signed and b > 127 else b for b in hdr)
    hdr[148:156] = b"%06o\0 " % total
    return bytes(hdr)


def test_odd_but_valid_headers_go_to_tarfile_or_read_alike(tmp_path, monkeypatch):
    """Header fields tarfile reads but the fast path does not vouch for: both read them alike, or tarfile does."""
    good = shard_tar(tmp_path / "good.tar", SAMPLES[:3]).read_bytes()
    with tarfile.open(tmp_path / "good.tar") as tf:
        second = tf.getmembers()[1].offset
    hdr = bytearray(good[second:second + 512])
    variants = {
        "mtime in base 256": header_with(bytearray(hdr), 136, b"\x80" + bytes(10) + b"\x05"),
        "uid in base 256": header_with(bytearray(hdr), 108, b"\xff" * 8),
        "size with spaces": header_with(bytearray(hdr), 124, b"    " + hdr[124 + 4:136]),
        "size in base 256": header_with(bytearray(hdr), 124, b"\x80" + bytes(11)),
        "mtime not a number": header_with(bytearray(hdr), 136, b"zzzzzzzzzzz\0"),
        "mode with a \\x1c": header_with(bytearray(hdr), 100, b"0000644\x1c"),
        "signed checksum": header_with(bytearray(hdr), 265, b"\xe9user\0", signed=True),
        "unknown type": header_with(bytearray(hdr), 156, b"V"),
        "GNU sparse type": header_with(bytearray(hdr), 156, b"S"),
        "contiguous file": header_with(bytearray(hdr), 156, b"7"),
        "hard link": header_with(bytearray(hdr), 156, b"1"),
        "non-UTF-8 name": header_with(bytearray(hdr), 0, b"\xff\xfe.txt\0"),
        "empty name": header_with(bytearray(hdr), 0, bytes(100)),
        "prefix cut mid-character": header_with(bytearray(hdr), 345, "dé".encode()[:2] + b"\0"),
    }
    for name, h in variants.items():
        path = tmp_path / "odd.tar"
        path.write_bytes(good[:second] + h + good[second + 512:])
        assert_same(path, monkeypatch)


def test_a_file_the_os_will_not_read_is_not_a_tar_error(tmp_path):
    folder = tmp_path / "d.tar"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        list(iter_tar(folder))
    if os.geteuid() != 0:  # root reads anything
        path = shard_tar(tmp_path / "locked.tar", SAMPLES[:1])
        path.chmod(0)
        with pytest.raises(PermissionError):
            list(iter_tar(path))

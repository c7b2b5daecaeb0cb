"""The default PNG check is structural (vlprep/imagecheck.py): every chunk length walked to IEND, every CRC checked
but IDAT's. A file cut short and a damaged non-IDAT chunk are still refused; a flipped byte inside IDAT data passes
the default check and is refused by --decode-check (docs/FORMAT.md, "What the readers refuse")."""

import pytest

from tests.conftest import image_bytes
from vlprep.imagecheck import looks_complete, png_chunks_ok, probe
from vlprep.shards import ShardsConfig, Skip, build_shards, prepare_image


def chunks(data: bytes) -> dict[bytes, tuple[int, int]]:
    """{chunk type: (offset of its length field, its data length)} of the first chunk of each type."""
    out, pos = {}, 8
    while pos + 12 <= len(data):
        length, cid = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
        out.setdefault(cid, (pos, length))
        pos += 12 + length
    return out


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0xFF
    return bytes(b)


def outcome(data: bytes, **kw) -> str:
    """'ok' or the skip reason of `prepare_image`."""
    try:
        prepare_image(data, **kw)
    except Skip as s:
        return s.reason
    return "ok"


@pytest.fixture(scope="module")
def good() -> bytes:
    """A 64 x 64 PNG with a tEXt chunk before IDAT (Pillow writes one IDAT for it)."""
    import io

    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Title", "clip art")
    buf = io.BytesIO()
    Image.open(io.BytesIO(image_bytes(64, 64, "PNG"))).save(buf, format="PNG", pnginfo=info)
    data = buf.getvalue()
    assert list(chunks(data)) == [b"IHDR", b"tEXt", b"IDAT", b"IEND"]
    return data


def test_the_good_file_passes_both_checks(good):
    assert png_chunks_ok(good) and png_chunks_ok(good, idat_crc=True)
    assert outcome(good) == outcome(good, decode_check=True) == "ok"
    assert probe(good) == ("PNG", 64, 64)


def test_a_png_cut_short_is_refused_by_the_default_check(good):
    at, n = chunks(good)[b"IDAT"]
    cuts = {
        "IEND missing": good[:-12],
        "IEND half there": good[:-6],
        "cut inside IDAT": good[:at + 8 + n // 2],
        "cut inside IDAT, IEND put back": good[:at + 8 + n // 2] + good[-12:],  # IDAT's length runs past the end
        "cut inside the header chunks": good[:40],
    }
    long = bytearray(good)
    long[at:at + 4] = (n + 1).to_bytes(4, "big")  # a length one byte past its chunk: the walk loses step
    cuts["an IDAT length one too long"] = bytes(long)
    for name, data in cuts.items():
        assert not png_chunks_ok(data), name
        assert not looks_complete(data, "PNG"), name
        assert probe(data) is None, name
        assert outcome(data) in ("truncated_image", "corrupt_image"), name
        assert outcome(data, decode_check=True) in ("truncated_image", "corrupt_image"), name


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow may warn about the damaged text chunk
def test_a_flipped_byte_in_a_non_idat_chunk_is_refused_by_the_default_check(good):
    for cid in (b"IHDR", b"tEXt", b"IEND"):
        at, n = chunks(good)[cid]
        for where in sorted({at + 8, at + 8 + n // 2, at + 8 + n}):  # first data byte, middle, the CRC itself
            data = flip(good, where)
            assert not png_chunks_ok(data), (cid, where)
            assert probe(data) is None, (cid, where)
            assert outcome(data) != "ok", (cid, where)
            assert outcome(data, decode_check=True) != "ok", (cid, where)
    # IHDR is the header Pillow reads at open: a damaged one is an image Pillow refuses
    at, _ = chunks(good)[b"IHDR"]
    assert outcome(flip(good, at + 10)) == "corrupt_image"


def test_a_flipped_byte_inside_idat_passes_the_default_check_and_not_decode_check(good):
    at, n = chunks(good)[b"IDAT"]
    for where in (at + 8 + 10, at + 8 + n // 2, at + 8 + n - 1, at + 8 + n):  # in the data, and in IDAT's CRC
        data = flip(good, where)
        assert png_chunks_ok(data) and not png_chunks_ok(data, idat_crc=True), where
        assert probe(data) == ("PNG", 64, 64), where
        assert outcome(data) == "ok", where  # passed through byte for byte: only decoding could tell
        assert prepare_image(data)[0] == data
        assert outcome(data, decode_check=True) == "truncated_image", where


def test_vlprep_shards_keeps_an_idat_flip_by_default_and_counts_it_with_decode_check(tmp_path, good):
    src = tmp_path / "imgs"
    src.mkdir()
    at, n = chunks(good)[b"IDAT"]
    files = {"ok": good, "idat": flip(good, at + 8 + n // 2), "ihdr": flip(good, chunks(good)[b"IHDR"][0] + 9),
             "cut": good[:-12]}
    for name, data in files.items():
        (src / f"{name}.png").write_bytes(data)
        (src / f"{name}.txt").write_text(f"a picture called {name}")
    report = build_shards(ShardsConfig(src=src, out=tmp_path / "default", workers=1))
    assert report["written"] == 2  # ok and idat; Pillow refuses the damaged IHDR, the walk the cut file
    assert report["skipped"] == {"corrupt_image": 1, "truncated_image": 1}
    report = build_shards(ShardsConfig(src=src, out=tmp_path / "decoded", workers=1, decode_check=True))
    assert report["written"] == 1 and report["skipped"] == {"corrupt_image": 1, "truncated_image": 2}

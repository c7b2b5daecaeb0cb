import csv
import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import image_bytes
from vlprep import VlprepError
from vlprep.dataset import iter_samples, open_dataset, read_sidecars
from vlprep.shards import ShardsConfig, build_shards, prepare_image


def build(src, out, **kw) -> dict:
    kw.setdefault("workers", 1)
    return build_shards(ShardsConfig(src=Path(src), out=Path(out), **kw))


def samples(out) -> list[dict]:
    return list(iter_samples(out))


def files(out: Path) -> dict[str, bytes]:
    """Every file a dataset holds, except the timing-dependent report."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != "report.json"}


# --- sources -----------------------------------------------------------------------------------


def test_folder_source_passes_bytes_through(image_folder, tmp_path):
    rep = build(image_folder, tmp_path / "out", samples_per_shard=5)
    assert rep["written"] == 12 and rep["shards"] == 3 and rep["skipped"] == {}
    got = samples(tmp_path / "out")
    assert [s["__key__"] for s in got] == [f"shard_{i:09d}" for i in range(12)]
    # the folder is walked in sorted path order; uid is the relative path without the extension
    paths = sorted(p for p in image_folder.rglob("*") if p.suffix in (".png", ".jpg"))
    assert [s["json"]["uid"] for s in got] == [p.relative_to(image_folder).with_suffix("").as_posix() for p in paths]
    by_uid = {s["json"]["uid"]: s for s in got}
    s = by_uid["sub/img03"]
    assert s["jpg"] == (image_folder / "sub" / "img03.jpg").read_bytes()  # untouched
    assert s["txt"] == "a picture of thing 3"  # whitespace collapsed, stripped
    assert s["json"]["width"] == 43 and s["json"]["height"] == 33
    assert json.loads((tmp_path / "out" / "sizes.json").read_text()) == {
        "shard-000000.tar": 5, "shard-000001.tar": 5, "shard-000002.tar": 2}


def _rows(root: Path, n: int = 6) -> list[dict]:
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        (root / "img" / f"{i}.png").write_bytes(image_bytes(20 + i, 20, seed=i))
        rows.append({"id": f"row{i}", "file_name": f"img/{i}.png", "text": f"caption {i}", "other": i})
    return rows


def test_parquet_with_relative_paths_autodetects_columns(tmp_path):
    rows = _rows(tmp_path / "t")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t" / "caps.parquet")
    rep = build(tmp_path / "t" / "caps.parquet", tmp_path / "out")
    assert rep["columns"] == {"image": "file_name", "caption": "text", "uid": "id"}
    got = samples(tmp_path / "out")
    assert [s["txt"] for s in got] == [f"caption {i}" for i in range(6)]
    assert [s["json"]["uid"] for s in got] == [f"row{i}" for i in range(6)]
    assert got[2]["png"] == (tmp_path / "t" / "img" / "2.png").read_bytes()


def test_parquet_with_image_bytes_and_hf_struct(tmp_path):
    imgs = [image_bytes(30, 30, "JPEG", seed=i) for i in range(3)]
    pq.write_table(pa.table({"jpg": imgs, "caption": ["a", "b", "c"]}), tmp_path / "bytes.parquet")
    build(tmp_path / "bytes.parquet", tmp_path / "o1")
    assert [s["jpg"] for s in samples(tmp_path / "o1")] == imgs
    hf = pa.table({"image": [{"bytes": b, "path": None} for b in imgs], "sentence": ["x", "y", "z"]})
    pq.write_table(hf, tmp_path / "hf.parquet")
    build(tmp_path / "hf.parquet", tmp_path / "o2")
    assert [(s["jpg"], s["txt"]) for s in samples(tmp_path / "o2")] == list(zip(imgs, "xyz"))


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl"])
def test_text_tables_with_explicit_columns(tmp_path, kind):
    rows = [{"pic": r["file_name"], "words": r["text"], "x": r["other"]} for r in _rows(tmp_path / "t")]
    path = tmp_path / "t" / f"caps.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if kind == "tsv" else ",")
            w.writeheader()
            w.writerows(rows)
    with pytest.raises(VlprepError, match=r"no image column found .* columns are: pic, words, x"):
        build(path, tmp_path / "bad")
    rep = build(path, tmp_path / "out", image_col="pic", caption_col="words")
    assert rep["written"] == 6
    assert [s["txt"] for s in samples(tmp_path / "out")] == [f"caption {i}" for i in range(6)]
    assert [s["json"]["uid"] for s in samples(tmp_path / "out")] == [str(i) for i in range(6)]  # row number


def test_reshard_our_own_output_and_img2dataset(image_folder, tmp_path):
    build(image_folder, tmp_path / "a", samples_per_shard=5)
    build(tmp_path / "a", tmp_path / "b", samples_per_shard=4, prefix="re")
    a, b = samples(tmp_path / "a"), samples(tmp_path / "b")
    assert len(b) == 12 and open_dataset(tmp_path / "b").shards[0] == "re-000000.tar"
    assert [s["json"]["uid"] for s in b] == [s["__key__"] for s in a]  # the old key becomes the uid
    assert [(s.get("png") or s.get("jpg"), s["txt"]) for s in b] == [(s.get("png") or s.get("jpg"), s["txt"]) for s in a]

    # img2dataset layout: 00000.tar with jpg/txt/json(url), a parquet and a _stats.json beside it
    i2d = tmp_path / "i2d"
    i2d.mkdir()
    with tarfile.open(i2d / "00000.tar", "w") as tf:
        for i in range(3):
            for ext, data in [("jpg", image_bytes(24, 24, "JPEG", seed=i)), ("txt", f"photo {i}".encode()),
                              ("json", json.dumps({"url": f"http://x/{i}.jpg", "key": f"0000{i}"}).encode())]:
                info = tarfile.TarInfo(f"0000{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    (i2d / "00000_stats.json").write_text("{}")
    rep = build(i2d, tmp_path / "c")
    got = samples(tmp_path / "c")
    assert rep["source_kind"] == "webdataset" and [s["txt"] for s in got] == ["photo 0", "photo 1", "photo 2"]
    assert got[1]["json"]["url"] == "http://x/1.jpg" and got[1]["json"]["uid"] == "00001"


# --- bad input: counted skips ------------------------------------------------------------------


def test_bad_samples_are_skipped_and_counted(tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    good = image_bytes(32, 32, "PNG")
    jpg = image_bytes(32, 32, "JPEG")
    cases = {
        "ok.png": (good, b"fine"),
        "corrupt.png": (b"this is not an image at all", b"caption"),
        "trunc.png": (good[: len(good) // 2], b"caption"),
        "trunc2.jpg": (jpg[:-40], b"caption"),
        "empty.png": (good, b"   \n"),
        "latin1.png": (good, "caf\u00e9".encode("latin-1")),
        "nocap.png": (good, None),
    }
    for name, (img, cap) in cases.items():
        (root / name).write_bytes(img)
        if cap is not None:
            (root / name).with_suffix(".txt").write_bytes(cap)
    rep = build(root, tmp_path / "out")
    assert rep["written"] == 1
    assert rep["skipped"] == {"corrupt_image": 1, "truncated_image": 2, "empty_caption": 1,
                              "caption_not_utf8": 1, "missing_caption": 1}
    assert rep["skipped_examples"]["truncated_image"] == ["trunc", "trunc2"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["skipped"] == rep["skipped"]
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["counts"]["written"] == 1


def test_table_bad_rows_are_counted(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes())
    (tmp_path / "adir").mkdir()  # an image path that exists but cannot be read as a file
    with open(tmp_path / "t.csv", "wb") as f:
        f.write(b"image,caption\na.png,good one\nmissing.png,no file\na.png,\n,no image\na.png,caf\xe9\nadir,x\n")
    rep = build(tmp_path / "t.csv", tmp_path / "out")
    assert rep["written"] == 1
    assert rep["skipped"] == {"missing_image": 2, "empty_caption": 1, "caption_not_utf8": 1, "unreadable_image": 1}
    pq.write_table(pa.table({"image": [str(tmp_path / "a.png")] * 2, "caption": [b"ok", b"\xff\xfe"]}),
                   tmp_path / "b.parquet")
    assert build(tmp_path / "b.parquet", tmp_path / "out2")["skipped"] == {"caption_not_utf8": 1}


def test_decode_check_catches_corrupt_data_with_intact_markers(tmp_path):
    from vlprep.shards import Skip

    import zlib

    data = bytearray(image_bytes(64, 64, "PNG"))
    data[200:1200] = b"\x00" * 1000  # pixel data destroyed, IEND intact: IDAT's CRC no longer matches
    assert prepare_image(bytes(data))[1] == "png"  # the cheap check walks the chunks but skips IDAT's CRC
    with pytest.raises(Skip) as e:
        prepare_image(bytes(data), decode_check=True)  # --decode-check checks every CRC, then decodes
    assert e.value.reason == "truncated_image"
    # destroyed inside the zlib stream with the chunk's CRC recomputed: only decoding can tell
    png = image_bytes(64, 64, "PNG")
    at = png.index(b"IDAT") - 4
    n = int.from_bytes(png[at:at + 4], "big")
    body = bytes(png[at + 8:at + 8 + n // 2]) + b"\x00" * (n - n // 2)
    data = png[:at + 8] + body + zlib.crc32(b"IDAT" + body).to_bytes(4, "big") + png[at + 12 + n:]
    assert prepare_image(data)[1] == "png"  # the cheap check lets it through
    with pytest.raises(Skip) as e:
        prepare_image(data, decode_check=True)
    assert e.value.reason in ("corrupt_image", "truncated_image")
    with pytest.raises(Skip) as e:
        prepare_image(data, resize=16)  # re-encoding decodes too
    assert e.value.reason in ("corrupt_image", "truncated_image")


# --- bad input: one-line errors ----------------------------------------------------------------


def test_nonempty_output_is_never_clobbered(image_folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    with pytest.raises(VlprepError, match="is not empty"):
        build(image_folder, out)
    assert (out / "precious.txt").read_text() == "mine"
    build(image_folder, tmp_path / "o2")
    with pytest.raises(VlprepError, match="other options"):
        build(image_folder, tmp_path / "o2", resize=8)
    assert len(samples(tmp_path / "o2")) == 12  # the earlier dataset is intact
    build(image_folder, tmp_path / "o2", resize=8, overwrite=True)
    assert max(min(s["json"]["width"], s["json"]["height"]) for s in samples(tmp_path / "o2")) == 8


@pytest.mark.parametrize("kw,match", [({"samples_per_shard": 0}, "samples-per-shard"), ({"format": "gif"}, "--format"),
                                      ({"prefix": "a.b"}, "--prefix"), ({"resize": -1}, "--resize")])
def test_bad_options(image_folder, tmp_path, kw, match):
    with pytest.raises(VlprepError, match=match):
        build(image_folder, tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


# --- resize / re-encode ------------------------------------------------------------------------


def test_resize_shorter_side_keeps_aspect_and_never_upscales(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    (root / "big.png").write_bytes(image_bytes(300, 120, "PNG"))
    (root / "small.jpg").write_bytes(image_bytes(50, 40, "JPEG"))
    (root / "rgba.png").write_bytes(image_bytes(200, 100, "PNG", mode="RGBA"))
    for n in ("big", "small", "rgba"):
        (root / f"{n}.txt").write_text(n)
    build(root, tmp_path / "out", resize=64)
    got = {s["txt"]: s for s in samples(tmp_path / "out")}
    big = Image.open(io.BytesIO(got["big"]["png"]))
    assert big.size == (160, 64) and (got["big"]["json"]["width"], got["big"]["json"]["height"]) == (160, 64)
    assert got["small"]["jpg"] == (root / "small.jpg").read_bytes()  # below N: untouched
    build(root, tmp_path / "jpg", resize=64, format="jpg", quality=80)
    got = {s["txt"]: s for s in samples(tmp_path / "jpg")}
    assert all("jpg" in s for s in got.values())
    rgba = Image.open(io.BytesIO(got["rgba"]["jpg"]))
    assert rgba.mode == "RGB" and rgba.size == (128, 64)


# --- determinism, parallelism, resume ----------------------------------------------------------


def test_reruns_and_worker_counts_give_identical_bytes(image_folder, tmp_path):
    build(image_folder, tmp_path / "a", samples_per_shard=4)
    build(image_folder, tmp_path / "b", samples_per_shard=4, workers=2)
    fa, fb = files(tmp_path / "a"), files(tmp_path / "b")
    assert fa.keys() == fb.keys() and all(fa[k] == fb[k] for k in fa if k != "meta.json")
    rep = build(image_folder, tmp_path / "a", samples_per_shard=4)  # same options: everything resumes
    assert rep["shards_resumed"] == 3 and files(tmp_path / "a") == fa


def test_interrupted_run_leaves_no_partial_shard_and_resumes_identically(image_folder, tmp_path, monkeypatch):
    build(image_folder, tmp_path / "clean", samples_per_shard=4)
    import vlprep.shards as stage

    real, calls = stage.prepare_image, {"n": 0}

    def dies_mid_shard(*a, **k):
        calls["n"] += 1
        if calls["n"] == 10:  # the 2nd sample of the 3rd shard
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(stage, "prepare_image", dies_mid_shard)
    with pytest.raises(KeyboardInterrupt):
        build(image_folder, tmp_path / "run", samples_per_shard=4)
    visible = sorted(p.name for p in (tmp_path / "run").glob("*.tar"))
    assert visible == ["shard-000000.tar", "shard-000001.tar"]  # finished shards only, no half shard
    assert not (tmp_path / "run" / "sizes.json").exists()
    with pytest.raises(VlprepError, match="no sizes.json"):
        open_dataset(tmp_path / "run")  # readers refuse an unfinished dataset
    monkeypatch.setattr(stage, "prepare_image", real)
    rep = build(image_folder, tmp_path / "run", samples_per_shard=4)
    assert rep["shards_resumed"] == 2
    assert files(tmp_path / "run") == files(tmp_path / "clean")
    assert not list((tmp_path / "run").glob("*.tmp"))


# --- sidecars ----------------------------------------------------------------------------------


def test_sidecars_agree_with_tars(image_folder, tmp_path):
    (image_folder / "sub" / "img05.txt").write_text("")  # one skipped sample
    build(image_folder, tmp_path / "out", samples_per_shard=5)
    ds = open_dataset(tmp_path / "out")
    rows = read_sidecars(ds).to_pylist()
    got = samples(ds)
    assert len(rows) == len(got) == 11
    for row, s in zip(rows, got):
        ext = "png" if "png" in s else "jpg"
        assert (row["key"], row["caption"], row["uid"], row["image_ext"], row["image_bytes"]) == \
            (s["__key__"], s["txt"], s["json"]["uid"], ext, len(s[ext]))
        assert (row["width"], row["height"]) == Image.open(io.BytesIO(s[ext])).size


def test_resume_rebuilds_shards_whose_records_changed(image_folder, tmp_path):
    build(image_folder, tmp_path / "out", samples_per_shard=5)
    (image_folder / "sub" / "img07.txt").write_text("an edited caption")
    rep = build(image_folder, tmp_path / "out", samples_per_shard=5)
    assert rep["shards_resumed"] == 2  # only the shard holding the edited record is rebuilt
    assert "an edited caption" in [s["txt"] for s in samples(tmp_path / "out")]


def test_decompression_bombs_are_counted_as_too_large(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    buf = io.BytesIO()
    Image.new("1", (20000, 10000)).save(buf, format="PNG")  # 200M pixels, a few KB on disk
    (root / "huge.png").write_bytes(buf.getvalue())
    (root / "huge.txt").write_text("a very large picture")
    (root / "ok.png").write_bytes(image_bytes())
    (root / "ok.txt").write_text("fine")
    rep = build(root, tmp_path / "out")
    assert rep["written"] == 1 and rep["skipped"] == {"image_too_large": 1}


# --- the header probe (vlprep/imagecheck.py): the same answers as Pillow's path -------------------------------------


def _pil_variants() -> dict[str, bytes]:
    """Images in the modes and with the chunks / markers real files have, written by Pillow."""
    import numpy as np

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (23, 37, 3), dtype=np.uint8))
    info = __import__("PIL.PngImagePlugin", fromlist=["PngInfo"]).PngInfo()
    info.add_text("Title", "clip art")
    info.add_text("Comment", "compressed", zip=True)  # a zTXt chunk: Pillow's handler may reject, so Pillow decides
    plain_text = __import__("PIL.PngImagePlugin", fromlist=["PngInfo"]).PngInfo()
    plain_text.add_text("Title", "clip art")  # tEXt, as openclipart's PNGs have
    icc = __import__("PIL.ImageCms", fromlist=["createProfile"])
    srgb = icc.ImageCmsProfile(icc.createProfile("sRGB")).tobytes()
    exif = Image.Exif()
    exif[0x0112] = 6
    out = {}

    def save(name, im, fmt, **kw):
        buf = io.BytesIO()
        im.save(buf, format=fmt, **kw)
        out[name] = buf.getvalue()

    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"):
        save(f"png-{mode}", rgb.convert(mode) if mode != "I;16" else rgb.convert("L").convert("I;16"), "PNG")
    save("png-P-trns", rgb.convert("P"), "PNG", transparency=3)
    save("png-RGB-trns", rgb, "PNG", transparency=(1, 2, 3))
    save("png-L-trns", rgb.convert("L"), "PNG", transparency=7)
    save("png-text", rgb, "PNG", pnginfo=info)
    save("png-tEXt", rgb, "PNG", pnginfo=plain_text)
    save("png-icc", rgb, "PNG", icc_profile=srgb)
    save("png-dpi", rgb, "PNG", dpi=(300, 300))
    save("png-apng", rgb, "PNG", save_all=True, append_images=[rgb.convert("L").convert("RGB")])
    for mode in ("L", "RGB", "CMYK"):
        save(f"jpeg-{mode}", rgb.convert(mode), "JPEG", quality=90)
    save("jpeg-progressive", rgb, "JPEG", progressive=True)
    save("jpeg-exif", rgb, "JPEG", exif=exif)
    save("jpeg-icc", rgb, "JPEG", icc_profile=srgb)
    save("jpeg-comment", rgb, "JPEG", comment=b"hello")
    save("jpeg-restart", rgb, "JPEG", restart_marker_blocks=1)
    save("jpeg-dpi", rgb, "JPEG", dpi=(72, 72))
    save("jpeg-mpo", rgb, "MPO", save_all=True, append_images=[rgb])
    save("webp", rgb, "WEBP")
    save("gif", rgb.convert("P"), "GIF")
    save("bmp", rgb, "BMP")
    return out


def _damaged(data: bytes) -> list[bytes]:
    """Cut at many points, one byte flipped at many offsets, a few header fields broken by hand."""
    n = len(data)
    cuts = sorted({1, 2, 3, 8, 12, 16, 20, 25, 29, 33, 40, 60, n // 3, n // 2, n - 20, n - 12, n - 4, n - 2, n - 1})
    out = [data[:c] for c in cuts if 0 < c < n]
    for at in sorted({4, 8, 12, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 28, 30, 33, 37, 41, 50, 70, 100, n // 2,
                      n - 9, n - 5, n - 1}):
        if 0 <= at < n:
            for x in (0xFF, 0x01):
                b = bytearray(data)
                b[at] ^= x
                out.append(bytes(b))
    out.append(data + b"\0\0\0")  # zero padding after the end (JPEG: allowed)
    out.append(data + b"junk")
    return out


def _png_with(chunks: list[tuple[bytes, bytes]]) -> bytes:
    import zlib

    return b"\x89PNG\r\n\x1a\n" + b"".join(len(d).to_bytes(4, "big") + c + d + zlib.crc32(c + d).to_bytes(4, "big")
                                           for c, d in chunks)


def _handmade_pngs() -> dict[str, bytes]:
    """PNGs with valid CRCs whose headers Pillow refuses or reads oddly: the probe must defer to it."""
    import zlib

    idat = zlib.compress(b"\0\0\0\0" * 4)  # 4 rows of 1 RGB pixel... sizes need not match: open does not decode
    ihdr = lambda w, h, depth=8, ctype=2, filt=0: (w.to_bytes(4, "big") + h.to_bytes(4, "big")  # noqa: E731
                                                   + bytes([depth, ctype, 0, filt, 0]))
    end = (b"IEND", b"")
    return {
        "plain": _png_with([(b"IHDR", ihdr(1, 4)), (b"IDAT", idat), end]),
        "zero-width": _png_with([(b"IHDR", ihdr(0, 4)), (b"IDAT", idat), end]),
        "bad-mode": _png_with([(b"IHDR", ihdr(1, 4, depth=3, ctype=2)), (b"IDAT", idat), end]),
        "filter-byte": _png_with([(b"IHDR", ihdr(1, 4, filt=1)), (b"IDAT", idat), end]),
        "short-ihdr": _png_with([(b"IHDR", ihdr(1, 4)[:12]), (b"IDAT", idat), end]),
        "two-ihdr": _png_with([(b"IHDR", ihdr(1, 4)), (b"IHDR", ihdr(2, 4)), (b"IDAT", idat), end]),
        "ihdr-late": _png_with([(b"tEXt", b"a\0b"), (b"IHDR", ihdr(1, 4)), (b"IDAT", idat), end]),
        "no-idat": _png_with([(b"IHDR", ihdr(1, 4)), end]),
        "short-trns": _png_with([(b"IHDR", ihdr(1, 4)), (b"tRNS", b"\0\1"), (b"IDAT", idat), end]),
        "short-phys": _png_with([(b"IHDR", ihdr(1, 4)), (b"pHYs", b"\0" * 8), (b"IDAT", idat), end]),
        "short-gama": _png_with([(b"IHDR", ihdr(1, 4)), (b"gAMA", b"\0" * 3), (b"IDAT", idat), end]),
        "bad-iccp": _png_with([(b"IHDR", ihdr(1, 4)), (b"iCCP", b"x\0\1zz"), (b"IDAT", idat), end]),
        "odd-cid": _png_with([(b"IHDR", ihdr(1, 4)), (b"a-b!", b""), (b"IDAT", idat), end]),
        "unknown-chunk": _png_with([(b"IHDR", ihdr(1, 4)), (b"vpAg", b"123"), (b"IDAT", idat), end]),
        "huge": _png_with([(b"IHDR", ihdr(20000, 20000)), (b"IDAT", idat), end]),
        "bomb": _png_with([(b"IHDR", ihdr(30000, 30000)), (b"IDAT", idat), end]),
    }


def _outcome(data: bytes, **kw):
    from vlprep.shards import Skip

    try:
        return prepare_image(data, **kw)
    except Skip as s:
        return s.reason


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the deliberately damaged files
def test_probe_answers_as_pillow_does_on_valid_damaged_and_odd_images(monkeypatch):
    """prepare_image with the probe and with Pillow's path alone give the same outcome on every case. Where the probe
    does not answer (None: about 2,800 of the 3,187 cases), prepare_image takes Pillow's path either way, so the
    reference is computed only for the cases it answers, where the two paths differ (a pure function of the bytes:
    the same call twice would compare Pillow's path with itself); it was half of this test's time."""
    from vlprep import shards as stage
    from vlprep.imagecheck import probe

    cases = {**_pil_variants(), **_handmade_pngs()}
    for name, data in list(cases.items()):
        for i, bad in enumerate(_damaged(data)):
            cases[f"{name}/damaged{i}"] = bad
    fast = {}
    for name, data in cases.items():
        fast[name] = [_outcome(data), _outcome(data, resize=16), _outcome(data, fmt="png")]
        head = probe(data)
        if head is not None:  # whenever the probe answers, Pillow agrees on the format and size
            with Image.open(io.BytesIO(data)) as im:
                assert (im.format, *im.size) == head, name
    answered = {name for name, data in cases.items() if probe(data) is not None}
    assert 300 < len(answered) < len(cases) - 2000  # both kinds, in numbers (379 of 3,187 when written)
    monkeypatch.setattr(stage, "probe", lambda data: None)  # the reference: Pillow's path for every image
    for name in answered:  # elsewhere the fast outcome above was Pillow's path already
        data = cases[name]
        ref = [_outcome(data), _outcome(data, resize=16), _outcome(data, fmt="png")]
        assert fast[name] == ref, name
    # the fast path is taken for the common files (else it would be correct but useless) and not for the others
    takes = {n for n in cases if "/" not in n and probe(cases[n]) is not None}
    assert {"png-1", "png-L", "png-LA", "png-P", "png-RGB", "png-RGBA", "png-I;16", "png-P-trns", "png-RGB-trns",
            "png-L-trns", "png-dpi", "png-tEXt", "jpeg-L", "jpeg-RGB", "jpeg-progressive", "jpeg-comment",
            "jpeg-restart", "jpeg-dpi", "plain", "unknown-chunk"} <= takes
    assert not takes & {"png-text", "png-icc", "png-apng", "jpeg-exif", "jpeg-icc", "jpeg-mpo", "jpeg-CMYK", "webp", "gif", "bmp",
                        "zero-width", "bad-mode", "filter-byte", "short-ihdr", "two-ihdr", "ihdr-late", "no-idat",
                        "short-trns", "short-phys", "short-gama", "bad-iccp", "odd-cid", "huge", "bomb"}


def test_caption_whitespace_is_collapsed_as_the_regex_did():
    import re
    import sys

    from vlprep.shards import clean_caption

    spaces = "".join(c for c in map(chr, range(sys.maxunicode + 1)) if re.match(r"\s", c))
    for cap in ["  a\tb\n\nc  ", f"x{spaces}y{spaces}", "\u00a0lead and trail\u3000", "one"]:
        assert clean_caption(cap) == re.sub(r"\s+", " ", cap).strip()


def _uid_table(path: Path, uids: list[str]) -> Path:
    """A Parquet source of 8 px images (bytes) with these uids."""
    pq.write_table(pa.table({"image": [image_bytes(8, 8, seed=i % 7) for i in range(len(uids))],
                             "caption": [f"thing {i}" for i in range(len(uids))], "uid": uids}), path)
    return path


def reference_duplicates(uids: list[str], limit: int = 5) -> dict:
    """The rule, plainly: a row repeats when an earlier row has its uid; examples are the first repeated uids."""
    seen = set()
    rows = 0
    examples = []
    for u in uids:
        if u in seen:
            rows += 1
            if len(examples) < limit and u not in examples:
                examples.append(u)
        seen.add(u)
    return {"rows": rows, "examples": examples}


def test_duplicate_uid_scan_is_exact_even_when_every_hash_collides(tmp_path, monkeypatch):
    """Duplicates across shards and within one, with a resumed shard (its uids read from the sidecar); then again
    with a hash that maps every uid to one of two values, so only the check against the uids themselves keeps
    distinct uids apart."""
    import numpy as np

    import vlprep.shards as shards_mod

    uids = [f"u{i % 9}" if i % 3 == 0 else f"v{i}" for i in range(40)] + ["v1", "z", "z", "v2"]
    src = _uid_table(tmp_path / "t.parquet", uids)
    want = reference_duplicates(uids)
    assert want["rows"] > 5 and len(want["examples"]) == 5
    report = build(src, tmp_path / "a", samples_per_shard=6)
    assert (report["duplicate_uids"], report["duplicate_uid_examples"]) == (want["rows"], want["examples"])
    (tmp_path / "a" / "shard-000002.tar").unlink()  # a resumed run: the other shards' uids come from sidecars
    report = build(src, tmp_path / "a", samples_per_shard=6)
    assert report["shards_resumed"] == 7
    assert (report["duplicate_uids"], report["duplicate_uid_examples"]) == (want["rows"], want["examples"])
    monkeypatch.setattr(shards_mod, "uid_hashes",
                        lambda us: np.array([len(u) % 2 for u in us], dtype=np.uint64))
    report = build(src, tmp_path / "b", samples_per_shard=6)
    assert (report["duplicate_uids"], report["duplicate_uid_examples"]) == (want["rows"], want["examples"])


@pytest.mark.slow
def test_shards_driver_holds_no_uid_per_sample(tmp_path):
    """The memory rule: the duplicate-uid scan keeps an 8-byte hash per row, not the uid strings (each shard's
    list travelled back and stayed to the end, then a set of all of them: 98 bytes per sample of growth from
    2,000 to 8,000 samples); now 13 (the hash, and each shard's counts)."""
    from tests.memrule import growth_per_sample

    sources = {}

    def stage(n: int) -> None:
        if n not in sources:
            sources[n] = _uid_table(tmp_path / f"t{n}.parquet", [f"https://example.com/images/{i:012d}.jpg"
                                                                   for i in range(n)])
        out = tmp_path / f"ds{n}"
        if out.exists():
            import shutil

            shutil.rmtree(out)
        build(sources[n], out, samples_per_shard=200)

    assert growth_per_sample(stage, 2000) < 40

import hashlib
import io
import json
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import COLOURS, THINGS, cli_in_process, image_bytes
from vlprep import VlprepError, filterscan
from vlprep.dataset import iter_tar, open_dataset, read_sidecars
from vlprep.filter import FilterConfig, filter_dataset
from vlprep.shards import ShardsConfig, build_shards
from vlprep.tario import ShardTarWriter

N_BASE = 30


def base_caption(i: int) -> str:
    return f"photo {i} of a {COLOURS[i % 6]} {THINGS[i % 8]}"


def resave_png(data: bytes, **kw) -> bytes:
    """The same pixels saved again as PNG (other compression settings): a lossless re-encode."""
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, format="PNG", **kw)
    return buf.getvalue()


def jpeg_of(data: bytes) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def planted(tmp: Path) -> tuple[Path, dict]:
    """N_BASE distinct samples (distinct random images of 24-28 x 24-26 px, distinct captions), then planted ones.

    Returns (the dataset, {uid: what it is}); `truth` maps each planted uid to the uid of the base sample it repeats
    per dedup kind, and the sizes / word counts the other rules look at."""
    src = tmp / "src"
    src.mkdir()
    images = {}
    captions = {}
    for i in range(N_BASE):
        images[f"{i:04d}"] = image_bytes(24 + i % 5, 24 + i % 3, seed=i)
        captions[f"{i:04d}"] = base_caption(i)
    b = lambda i: images[f"{i:04d}"]  # noqa: E731
    extra = {  # uid: (image bytes, ext, caption)
        "1000": (b(3), "png", "a fresh caption one here"),                               # byte copy of 0003's image
        "1001": (resave_png(b(5), compress_level=9), "png", "a fresh caption two here"),  # lossless re-encode
        "1002": (resave_png(b(7), optimize=True), "png", "a fresh caption three here"),   # the same PNG re-saved
        "1003": (jpeg_of(b(9)), "jpg", "a fresh caption four here"),                      # lossy: not a duplicate
        "1004": (image_bytes(30, 30, seed=104), "png", base_caption(11)),                 # the same caption
        "1005": (image_bytes(30, 30, seed=105), "png", "  " + base_caption(12).upper().replace(" of", ", of") + "!!"),
        "1006": (image_bytes(30, 30, seed=106), "png", unicodedata.normalize("NFKD", base_caption(13).title())),
        "1007": (b(15), "png", base_caption(15)),                                       # a pair copy
        "1008": (b(17), "png", base_caption(18)),                                       # image of 17, caption of 18
        "1009": (image_bytes(8, 40, seed=109), "png", "small side image here"),         # min side 8, aspect 5
        "1010": (image_bytes(100, 30, seed=110), "png", "wide image is here"),          # aspect 3.33, 3000 px
        "1011": (image_bytes(60, 60, seed=111), "png", "big image is here"),            # 3600 px
        "1012": (image_bytes(90, 30, seed=112), "png", "exactly three to one"),         # aspect 3: kept
        "1013": (image_bytes(30, 30, seed=113), "png", "cat"),                          # 1 word
        "1014": (image_bytes(30, 30, seed=114), "png", " ".join(["word"] * 30)),        # 30 words
    }
    for uid, data in images.items():
        (src / f"{uid}.png").write_bytes(data)
        (src / f"{uid}.txt").write_text(captions[uid])
    for uid, (data, ext, caption) in extra.items():
        (src / f"{uid}.{ext}").write_bytes(data)
        (src / f"{uid}.txt").write_text(caption)
    build_shards(ShardsConfig(src=src, out=tmp / "ds", samples_per_shard=7, workers=1))
    return tmp / "ds", extra


def uid_of(ds: Path) -> dict[str, str]:
    side = read_sidecars(open_dataset(ds), ["key", "uid"])
    return dict(zip(side.column("key").to_pylist(), side.column("uid").to_pylist()))


def run(ds, out, **kw) -> dict:
    kw.setdefault("workers", 1)
    return filter_dataset(FilterConfig(src=Path(ds), out=Path(out), **kw))


def dropped(out: Path, uids: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{uid: (rule, detail with keys shown as uids)} from OUT/dropped.parquet."""
    key_of = {v: k for k, v in uids.items()}
    rows = pq.read_table(out / "dropped.parquet").to_pylist()
    res = {}
    for r in rows:
        detail = r["detail"]
        if detail.startswith("duplicate of "):
            assert r["match_key"] == detail.removeprefix("duplicate of ")  # the kept copy, as a column too
            detail = "duplicate of " + uids[detail.removeprefix("duplicate of ")]
        res[uids[r["key"]]] = (r["rule"], detail)
        assert key_of[uids[r["key"]]] == r["key"]
    return res


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".tar", ".parquet")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("filter")
    ds, extra = planted(tmp)
    return {"tmp": tmp, "ds": ds, "extra": extra, "uids": uid_of(ds)}


# --- the rules find every planted sample and nothing else ------------------------------------------------------


@pytest.mark.parametrize("kinds, expected", [
    (["image"], {"1000": "0003", "1001": "0005", "1002": "0007", "1007": "0015", "1008": "0017"}),
    (["caption"], {"1004": "0011", "1005": "0012", "1006": "0013", "1007": "0015", "1008": "0018"}),
    (["pair"], {"1007": "0015"}),
])
def test_each_dedup_kind_finds_exactly_the_planted_copies(data, kinds, expected):
    out = data["tmp"] / f"dedup-{'-'.join(kinds)}"
    rep = run(data["ds"], out, dedup=kinds)
    got = dropped(out, data["uids"])
    assert got == {u: (f"dedup_{kinds[0]}", f"duplicate of {k}") for u, k in expected.items()}
    false_positives = [u for u in got if u not in expected]
    assert false_positives == [] and rep["kept"] == N_BASE + len(data["extra"]) - len(expected)
    kept = {data["uids"][s["__key__"]] for shard in open_dataset(out).shards for s in iter_tar(out / shard)}
    assert kept == set(data["uids"].values()) - set(expected)


def test_dedup_rules_cascade_in_the_fixed_order(data):
    out = data["tmp"] / "all"
    rep = run(data["ds"], out, dedup=["pair,caption", "image"])
    got = dropped(out, data["uids"])
    rules = {u: r for u, (r, _) in got.items()}
    assert rules == {"1000": "dedup_image", "1001": "dedup_image", "1002": "dedup_image", "1007": "dedup_image",
                     "1008": "dedup_image", "1004": "dedup_caption", "1005": "dedup_caption",
                     "1006": "dedup_caption"}
    assert rep["dropped"] == {"bad_image": 0, "dedup_image": 5, "dedup_caption": 3, "dedup_pair": 0}
    assert rep["rules"]["order"] == ["bad_image", "dedup_image", "dedup_caption", "dedup_pair"]
    assert len(rep["examples"]["dedup_image"]) == 5 and rep["examples"]["dedup_pair"] == []


def test_image_and_caption_rules_on_planted_sizes_and_lengths(data):
    out = data["tmp"] / "sizes"
    rep = run(data["ds"], out, min_side=10, max_aspect=3, max_pixels=3000, caption_words="3:20")
    got = dropped(out, data["uids"])
    assert got == {"1009": ("min_side", "short side 8 < 10"), "1010": ("max_aspect", "aspect 3.333 > 3"),
                   "1011": ("max_pixels", "3600 pixels > 3000"), "1013": ("caption_words", "1 words, outside 3:20"),
                   "1014": ("caption_words", "30 words, outside 3:20")}
    assert rep["kept"] == N_BASE + len(data["extra"]) - 5
    # each sample's own figures against the rules, re-derived from the decoded images and the captions
    for s in (s for shard in open_dataset(data["ds"]).shards for s in iter_tar(data["ds"] / shard)):
        im = Image.open(io.BytesIO(s.get("png") or s.get("jpg")))
        w, h = im.size
        n_words = len(s["txt"].decode().lower().split()) if s["txt"].decode().replace(" ", "").isalnum() else None
        bad = min(w, h) < 10 or max(w, h) / min(w, h) > 3 or w * h > 3000 or (n_words is not None
                                                                              and not 3 <= n_words <= 20)
        assert (data["uids"][s["__key__"]] in got) == bad


def test_keys_and_drop_keys(data, tmp_path):
    uids = data["uids"]
    keys = sorted(uids)
    (tmp_path / "keep.txt").write_text("\n".join(keys[:10] + ["not_a_key"]) + "\n\n")
    (tmp_path / "drop.txt").write_text(f"{keys[2]}\n{keys[30]}\n")
    out = tmp_path / "o"
    rep = run(data["ds"], out, keys=tmp_path / "keep.txt", drop_keys=tmp_path / "drop.txt")
    got = pq.read_table(out / "dropped.parquet").to_pylist()
    by_rule = {}
    for r in got:
        by_rule.setdefault(r["rule"], []).append(r["key"])
    assert by_rule == {"keys": keys[10:], "drop_keys": [keys[2]]}
    assert rep["kept"] == 9 and rep["rules"]["keys"]["keys"] == 11
    assert rep["rules"]["keys"]["blake2b"] == hashlib.blake2b((tmp_path / "keep.txt").read_bytes(),
                                                              digest_size=16).hexdigest()


def test_kept_samples_are_copied_byte_for_byte_with_their_sidecar_rows(data):
    out = data["tmp"] / "copy"
    run(data["ds"], out, dedup=["image"])
    src = {s["__key__"]: s for shard in open_dataset(data["ds"]).shards for s in iter_tar(data["ds"] / shard)}
    got = [s for shard in open_dataset(out).shards for s in iter_tar(out / shard)]
    assert got and all({k: v for k, v in s.items() if k != "__url__"} ==
                       {k: v for k, v in src[s["__key__"]].items() if k != "__url__"} for s in got)
    side_in = {r["key"]: r for r in read_sidecars(open_dataset(data["ds"])).to_pylist()}
    side_out = read_sidecars(open_dataset(out)).to_pylist()
    assert [r["key"] for r in side_out] == [s["__key__"] for s in got]
    assert all(r == side_in[r["key"]] for r in side_out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "filter" and meta["options"]["dedup"] == ["image"] and meta["input_signature"]
    assert meta["counts"] == {"in": 45, "kept": 40, "dropped": 5}


def test_caption_normalisation_is_the_documented_one():
    # NFKC (the ligature and the full-width letters), casefold (ß), punctuation removed, spaces collapsed
    assert filterscan.normalise_caption("  The ﬁsh, ＳＴＲＡẞE!\t(big)…  ") == "the fish strasse big"
    # ASCII punctuation (string.punctuation, symbols such as + and = among them) and Unicode P* become spaces
    assert filterscan.normalise_caption("a-b") == "a b" and filterscan.normalise_caption("a+b = 2") == "a b 2"
    assert filterscan.normalise_caption("«Bonjour» ¿qué?") == "bonjour qué"
    assert filterscan.normalise_caption("x_y 3°") == "x y 3°"  # _ is Unicode Pc; ° is a symbol (So) and stays


def test_pixel_hash_is_blake2b_of_the_size_and_the_rgb_bytes():
    data = image_bytes(5, 3, seed=1)
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    want = hashlib.blake2b(b"5x3:" + rgb.tobytes(), digest_size=32).digest()
    assert filterscan.image_attributes(data, True) == (5, 3, None, want)
    assert filterscan.image_attributes(resave_png(data, compress_level=0), True)[3] == want
    assert filterscan.image_attributes(jpeg_of(data), True)[3] != want
    assert filterscan.short_hash(want) == int.from_bytes(want[:8], "little")


# --- the engine: workers, resume, collisions, bad samples -------------------------------------------------------


def test_same_bytes_for_any_worker_count_and_resume(data):
    kw = {"dedup": ["image", "caption"], "min_side": 10}
    w1 = data["tmp"] / "w1"
    w2 = data["tmp"] / "w2"
    run(data["ds"], w1, workers=1, **kw)
    run(data["ds"], w2, workers=2, **kw)
    assert files(w1) == files(w2) and len(files(w1)) == 2 * 7 + 1
    # an interrupted run: one output shard and one scan table missing, half-written temporaries left behind
    (w2 / "shard-000003.tar").unlink()
    (w2 / "sizes.json").unlink()
    (w2 / "shard-000003.tar.tmp").write_bytes(b"half")
    (w2 / "_scan" / "shard-000005.parquet").unlink()
    rep = run(data["ds"], w2, workers=2, **kw)
    assert rep["shards_resumed"] == 6 and rep["scan_resumed"] == 6
    assert files(w2) == files(w1) and not list(w2.glob("*.tmp"))
    assert (w2 / "report.json").exists() and json.loads((w2 / "sizes.json").read_text()) == json.loads(
        (w1 / "sizes.json").read_text())
    # other thresholds into the same OUT: refused without --overwrite; with it, the scan tables are reused
    with pytest.raises(VlprepError, match="written with other options"):
        run(data["ds"], w2, workers=2, dedup=["image", "caption"], min_side=30)
    rep = run(data["ds"], w2, workers=2, dedup=["image", "caption"], min_side=30, overwrite=True)
    assert rep["scan_resumed"] == 7 and rep["shards_resumed"] == 0


def test_a_forced_64_bit_collision_still_gives_the_exact_result(data, monkeypatch):
    run(data["ds"], data["tmp"] / "exact", dedup=["image", "caption", "pair"])
    monkeypatch.setattr(filterscan, "short_hash", lambda full: 7)  # every sample's 64-bit hash the same
    out = data["tmp"] / "collide"
    rep = run(data["ds"], out, dedup=["image", "caption", "pair"])
    scan = pq.read_table(out / "_scan" / "shard-000000.parquet")
    assert set(scan.column("image_h64").to_pylist()) == {7}
    assert files(out) == files(data["tmp"] / "exact") and rep["dropped"]["dedup_image"] == 5


def test_an_undecodable_image_is_a_counted_bad_sample(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.png").write_bytes(image_bytes(12, 12, seed=i))
        (src / f"{i}.txt").write_text(f"caption number {i}")
    build_shards(ShardsConfig(src=src, out=tmp_path / "ds", samples_per_shard=3, workers=1))
    tar = tmp_path / "ds" / "shard-000001.tar"
    samples = list(iter_tar(tar))
    samples[1]["png"] = b"\x89PNG\r\n\x1a\n not really"  # a header that does not open
    with open(tar, "wb") as f, ShardTarWriter(f) as w:
        for s in samples:
            w.write_sample({k: v for k, v in s.items() if k != "__url__"})
    rep = run(tmp_path / "ds", tmp_path / "o", dedup=["image"])
    assert rep["bad"] == {"undecodable": 1} and rep["dropped"]["bad_image"] == 1 and rep["kept"] == 5
    row = pq.read_table(tmp_path / "o" / "dropped.parquet").to_pylist()
    assert row == [{"key": samples[1]["__key__"], "shard": "shard-000001.tar", "rule": "bad_image",
                    "detail": "undecodable", "match_dataset": None, "match_key": None, "cosine": None,
                    "distance": None}]


# --- user mistakes: one line, nothing written ----------------------------------------------------------------------


@pytest.fixture
def cli(capfd):
    """cli(*ARGS): `vlprep filter ARGS` as its main() in this process (tests/conftest.py's cli_in_process): the exit
    status, the one error line and the help text are a child's, without a fresh interpreter's imports per run; an
    uncaught exception raises in the test instead of printing a traceback, a failure either way."""
    return lambda *args: cli_in_process(capfd, "filter", *args)


@pytest.mark.parametrize("args, why", [
    (["--caption-words", "5:2"], "need 0 <= MIN <= MAX"),
    (["--caption-words", "five"], "give MIN:MAX word counts"),
    (["--max-aspect", "0.5"], "at least 1"),
    (["--min-side", "0"], "--min-side must be at least 1"),
    (["--dedup", "pixels"], "use image, caption or pair"),
    (["--keys", "{tmp}/missing.txt"], "missing.txt: not found"),
    (["--keys", "{tmp}"], "a folder, not a regular file"),
    ([], "no rule given: give at least one of --keys"),
])
def test_user_mistakes_are_one_line_errors(data, tmp_path, args, why, cli):
    out = tmp_path / "o"
    r = cli(str(data["ds"]), str(out), *[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert why in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_the_cli_prints_the_table_and_its_help_gives_the_order(data, tmp_path, cli):
    r = cli(str(data["ds"]), str(tmp_path / "o"), "--dedup", "image", "--min-side", "10", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert "39 of 45 kept" in r.stderr and "dedup_image" in r.stderr and "min_side" in r.stderr
    assert "wrote " in r.stderr
    h = cli("--help")
    assert h.returncode == 0 and "1 keys, 2 drop-keys" in " ".join(h.stdout.split())
    assert "11 phash, 12 near-dup, 13 exclude, 14 clip score" in " ".join(h.stdout.split())
    assert "--phash" in h.stdout and "--exclude-embeddings" in h.stdout


def test_out_that_is_the_input_is_refused(data, cli):
    with pytest.raises(VlprepError, match="is the input"):
        run(data["ds"], data["ds"], dedup=["caption"])
    r = cli(str(data["ds"]), str(data["ds"]), "--dedup", "caption")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "is the input" in r.stderr


@pytest.mark.slow
def test_the_dedup_driver_holds_a_few_bytes_per_sample(tmp_path):
    """The memory rule: the driver holds a rule code (1 byte) and a 64-bit hash per dedup kind (8 bytes) per sample,
    plus a sorted copy of one kind's hashes while it runs; the rest is per shard. Every sample is distinct here, so
    the growth is that fixed-width part alone."""
    from tests.memrule import growth_per_sample

    made = {}

    def stage(n: int) -> None:
        if n not in made:
            src = tmp_path / f"src{n}"
            src.mkdir()
            for i in range(n):
                (src / f"{i:05d}.png").write_bytes(image_bytes(6, 6, seed=i))
                (src / f"{i:05d}.txt").write_text(f"caption {i}")
            made[n] = tmp_path / f"ds{n}"
            build_shards(ShardsConfig(src=src, out=made[n], samples_per_shard=100, workers=1))
        out = tmp_path / f"o{n}"
        shutil.rmtree(out, ignore_errors=True)
        run(made[n], out, dedup=["image", "caption", "pair"])

    growth = growth_per_sample(stage, 500)
    print(f"growth {growth:.1f} B per sample")
    assert growth < 100

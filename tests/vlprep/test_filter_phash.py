"""vlprep filter --phash (perceptual-hash near duplicates, and --exclude's pHash matches) and --exclude-embeddings."""

import io
import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.fft
from PIL import Image

from tests.conftest import cli_in_process
from tests.memrule import growth_per_sample
from tests.vlprep.test_filter import files
from tests.vlprep.test_filter_embed import T, FakeEncoder, basis, dataset, keys_of, write_embeddings
from tests.vlprep.test_filter_embed import evals  # noqa: F401 (a fixture: the decontamination data)
from vlprep import VlprepError
from vlprep.dataset import as_rgb
from vlprep.embed import EmbedConfig, embed
from vlprep.filter import FilterConfig, filter_dataset
from vlprep.filterphash import phash_greedy
from vlprep.filterscan import perceptual_hash

D = 8
N_BASE = 24


def smooth(seed: int, size: int = 96) -> Image.Image:
    """A smooth random RGB picture (a 6x6 grid of random colours, bicubic-upscaled): pHash's low frequencies
    differ from seed to seed as a photo's do, unlike pixel noise, whose 32x32 reduction is nearly flat."""
    grid = np.random.default_rng(seed).integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((size, size), Image.Resampling.BICUBIC)


def encoded(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def half_jpeg(im: Image.Image) -> bytes:
    """Downscaled by 2 (Lanczos) and re-encoded as JPEG quality 90."""
    return encoded(im.resize((im.width // 2, im.height // 2), Image.Resampling.LANCZOS), "JPEG")


def reference_phash(rgb: Image.Image) -> int:
    """pHash as imagehash defines it, re-derived: greyscale, 32x32 Lanczos, 2-D DCT-II, the top-left 8x8, bit =
    coefficient > the block's median, row by row, the first bit the highest."""
    grey = np.asarray(rgb.convert("L").resize((32, 32), Image.Resampling.LANCZOS), np.float64)
    low = scipy.fft.dct(scipy.fft.dct(grey, type=2, axis=0), type=2, axis=1)[:8, :8]
    med = np.median(low)
    # imagehash uses scipy.fftpack's DCT: another float64 summation order, relative error ~1e-13 of the largest
    # coefficient; a bit could differ only if a coefficient were that close to the median
    assert np.abs(low - med).min() > 1e-9 * np.abs(low).max()
    return int("".join("1" if b else "0" for b in (low > med).reshape(-1)), 2)


def hamming(a: int, b: int) -> int:
    return bin(a ^ b).count("1")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """N_BASE distinct smooth pictures; then a half-size JPEG copy of 3 and of 10, a JPEG q90 re-encode of 5 (near
    duplicates pHash finds at D = 8), and a left-right flip of 7 (pHash is not meant to find a flip: its DCT signs
    change, so the hash is far; kept)."""
    tmp = tmp_path_factory.mktemp("phash")
    images = [encoded(smooth(i)) for i in range(N_BASE)]
    images += [half_jpeg(smooth(3)), half_jpeg(smooth(10)), encoded(smooth(5), "JPEG"),
               encoded(smooth(7).transpose(Image.Transpose.FLIP_LEFT_RIGHT))]
    ds = dataset(tmp / "ds", images, [f"caption {i}" for i in range(len(images))])
    return {"tmp": tmp, "ds": ds, "keys": keys_of(ds), "truth": {24: 3, 25: 10, 26: 5}}


def run(ds, out, encoder=None, **kw) -> dict:
    kw.setdefault("workers", 1)
    return filter_dataset(FilterConfig(src=Path(ds), out=Path(out), **kw), encoder)


def dropped(out: Path) -> list[dict]:
    return pq.read_table(out / "dropped.parquet").to_pylist()


# --- the hash ----------------------------------------------------------------------------------------------------


def test_phash_equals_a_re_derivation_and_the_scan_stores_it(planted, tmp_path):
    rgba = Image.new("RGBA", (40, 30), (0, 0, 0, 0))
    rgba.paste(smooth(99, 20).convert("RGBA"), (5, 5))
    on_white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    assert perceptual_hash(as_rgb(rgba)) == reference_phash(on_white)  # the stages' decode: transparency on white
    for im in [smooth(0), smooth(1, 64), smooth(2).resize((50, 70)), Image.open(io.BytesIO(half_jpeg(smooth(3))))]:
        assert perceptual_hash(as_rgb(im)) == reference_phash(im.convert("RGB"))
    run(planted["ds"], tmp_path / "o", phash=D)
    scan = pq.read_table(tmp_path / "o" / "_scan" / "shard-000000.parquet", columns=["key", "phash_h64"])
    for key, h in zip(*scan.to_pydict().values()):
        i = planted["keys"].index(key)
        assert h == reference_phash(smooth(i)), i  # the first shard: base pictures, PNG (lossless)


def test_planted_near_copies_are_found_flips_kept_and_no_false_positive(planted, tmp_path):
    refs = [reference_phash(smooth(i)) for i in range(N_BASE)]
    assert min(hamming(a, b) for i, a in enumerate(refs) for b in refs[:i]) > D  # the base pictures are distinct
    rep = run(planted["ds"], tmp_path / "o", phash=D)
    keys = planted["keys"]
    rows = {keys.index(r["key"]): r for r in dropped(tmp_path / "o")}
    assert {j: keys.index(r["match_key"]) for j, r in rows.items()} == planted["truth"]
    assert 27 not in rows  # the flip is kept
    for j, r in rows.items():
        assert r["rule"] == "phash" and r["distance"] <= D
        assert r["detail"] == f"phash distance {r['distance']} with {r['match_key']}"
    assert rep["dropped"] == {"bad_image": 0, "phash": 3} and rep["kept"] == N_BASE + 1
    assert rep["phash"]["distance"] == D and len(rep["phash"]["pairs"]) == 3
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["options"]["phash"] == D and meta["options"]["order"] == ["bad_image", "phash"]
    both = run(planted["ds"], tmp_path / "b", phash=D, dedup=["image"], near_dup=T,
               embeddings=write_embeddings(tmp_path / "e", keys, basis()[:len(keys)]))
    assert both["rules"]["order"] == ["bad_image", "dedup_image", "phash", "near_dup"]  # cheap first


def test_workers_give_the_same_bytes_and_a_rerun_resumes(planted, tmp_path):
    w1 = tmp_path / "w1"
    w2 = tmp_path / "w2"
    run(planted["ds"], w1, workers=1, phash=D)
    first = run(planted["ds"], w2, workers=2, phash=D)
    assert files(w1) == files(w2) and (w1 / "dropped.parquet").read_bytes() == (w2 / "dropped.parquet").read_bytes()
    (w2 / "shard-000001.tar").unlink()
    (w2 / "_scan" / "shard-000002.parquet").unlink()
    again = run(planted["ds"], w2, workers=2, phash=D)
    shards = first["shards"]
    assert again["scan_resumed"] == shards - 1 and again["shards_resumed"] == shards - 1
    assert files(w2) == files(w1)
    looser = run(planted["ds"], w2, workers=2, phash=32, overwrite=True)  # another D: the scan is reused
    assert looser["scan_resumed"] == shards and looser["dropped"]["phash"] >= 3


# --- the greedy rule ---------------------------------------------------------------------------------------------


def brute_phash_greedy(hashes: list[int], d: int) -> dict[int, tuple[int, int]]:
    """All pairs: j dropped when an earlier kept i is within d; {j: (the nearest such i, the earliest on ties,
    its distance)}."""
    keep = [True] * len(hashes)
    found = {}
    for j, h in enumerate(hashes):
        near = [(hamming(h, hashes[i]), i) for i in range(j) if keep[i] and hamming(h, hashes[i]) <= d]
        if near:
            keep[j] = False
            dist, i = min(near)
            found[j] = (i, dist)
    return found


def flip(h: int, bits) -> int:
    for b in bits:
        h ^= 1 << b
    return h


@pytest.mark.parametrize("d", [0, 3, 8, 20])
def test_greedy_equals_brute_force_with_planted_ties(d):
    """150 random hashes, then (from 10's hash B; S(a, b) the bits a..b-1 flipped): 150 = S(0, 2d) (2d from B:
    kept), 151 = S(0, d) (d from both B and 150: a tie, the earlier 10 is named), 152 = S(40, 41 + d) (d + 1:
    kept), 153 = 151 with bit 63 flipped (d + 1 from B, 1 from 151 which was dropped: kept), 154 = S(30, 30 + d)
    (exactly d: dropped), 155 = 20's hash (0: dropped)."""
    rng = np.random.default_rng(d)
    hashes = [int(x) for x in rng.integers(0, 2 ** 64, size=150, dtype=np.uint64)]
    base = hashes[10]
    hashes += [flip(base, range(2 * d)), flip(base, range(d)), flip(base, range(40, 41 + d)),
               flip(flip(base, range(d)), [63]), flip(base, range(30, 30 + d)), hashes[20]]
    want = brute_phash_greedy(hashes, d)
    if d in (3, 8):  # the plants as described (at d = 0 150 and 151 equal B; at d = 20 random pairs are near too)
        assert 10 not in want and 20 not in want and 150 not in want and 152 not in want and 153 not in want
        assert want[151] == (10, d) and want[154] == (10, d) and want[155] == (20, 0)
    dropped, partner, dist = phash_greedy(np.array(hashes, np.uint64), d)
    got = {j: (p, h) for j, p, h in zip(dropped.tolist(), partner.tolist(), dist.tolist())}
    assert got == want and dropped.tolist() == sorted(want)


def test_phash_greedy_driver_memory_per_sample():
    """The driver's arrays: the hashes (8 bytes a sample, made by `go` and so counted), 1 byte of state; FAISS'
    copy of the codes is outside Python's heap. The bar leaves room for numpy's scratch, not for a per-sample
    Python object (50+ bytes)."""
    made = {}

    def go(m: int) -> None:
        if m not in made:
            made[m] = np.random.default_rng(m).integers(0, 2 ** 63, size=m, dtype=np.int64).astype(np.uint64)
        phash_greedy(made[m].copy(), 4)

    per = growth_per_sample(go, 5000)
    assert per < 40, per


# --- decontamination ---------------------------------------------------------------------------------------------


def test_exclude_with_phash_drops_near_copies_of_eval_images(planted, tmp_path):
    """Eval: a half-size JPEG of train 12, a flip of train 14 (not found), an exact copy of train 16, a distinct
    picture."""
    flipped = smooth(14).transpose(Image.Transpose.FLIP_TOP_BOTTOM)
    images = [half_jpeg(smooth(12)), encoded(flipped), encoded(smooth(16)), encoded(smooth(500))]
    ev = dataset(tmp_path / "eval", images, ["a", "b", "c", "d"])
    ek = keys_of(ev)
    keys = planted["keys"]
    rep = run(planted["ds"], tmp_path / "o", phash=D, exclude=[ev])
    pairs = {keys.index(p["key"]): (p["eval_key"], p["cosine"], p["distance"]) for p in rep["exclude"]["pairs"]}
    assert set(pairs) == {12, 16} and pairs[16] == (ek[2], None, None) and pairs[12][0] == ek[0]
    assert pairs[12][2] == hamming(reference_phash(smooth(12)), reference_phash(Image.open(io.BytesIO(half_jpeg(
        smooth(12))))))
    rows = {keys.index(r["key"]): r for r in dropped(tmp_path / "o") if r["rule"] == "exclude"}
    assert rows[12]["match_dataset"] == str(ev) and rows[12]["match_key"] == ek[0]
    assert rows[12]["detail"] == f"phash distance {pairs[12][2]} with {ek[0]} of {ev}"
    assert rep["dropped"]["phash"] == 3 and rep["dropped"]["exclude"] == 2


# --- --exclude-embeddings ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evals_emb(evals):  # noqa: F811
    """test_filter_embed's decontamination data, and `vlprep embed` outputs of the train and eval sets."""
    data = evals
    tmp = data["tmp"]
    for name in ("ds", "eval", "eval2"):
        embed(EmbedConfig(src=data[name], out=tmp / f"emb-{name}", modality="image", workers=1), data["enc"])
    return data


def test_exclude_embeddings_drop_what_the_checkpoint_drops(evals_emb):
    e = evals_emb
    tmp = e["tmp"]
    with_ckpt = run(e["ds"], tmp / "ckpt", e["enc"], near_dup=T, exclude=[e["eval"], e["eval2"]])
    given = run(e["ds"], tmp / "given", near_dup=T, embeddings=tmp / "emb-ds", exclude=[e["eval"], e["eval2"]],
                exclude_embeddings=[tmp / "emb-eval", tmp / "emb-eval2"])
    assert dropped(tmp / "given") == dropped(tmp / "ckpt") and given["exclude"] == with_ckpt["exclude"]
    assert given["dropped"]["exclude"] == 6
    meta = json.loads((tmp / "given" / "meta.json").read_text())
    assert meta["options"]["exclude_embeddings"] == [str(tmp / "emb-eval"), str(tmp / "emb-eval2")]


def test_exclude_embeddings_mismatches_are_one_line_errors(evals_emb, tmp_path):
    e = evals_emb
    tmp = e["tmp"]
    other = FakeEncoder({c: v for c, v in zip(e["enc"].by_colour, e["enc"].by_colour.values())}, {})
    other.info = {"checkpoint": "/elsewhere/other.pt"}
    embed(EmbedConfig(src=e["eval"], out=tmp_path / "other", modality="image", workers=1), other)
    later = FakeEncoder(dict(e["enc"].by_colour), {})  # the same checkpoint file, changed after the first embed
    later.fingerprint = e["enc"].fingerprint + ":retrained"
    embed(EmbedConfig(src=e["eval"], out=tmp_path / "later", modality="image", workers=1), later)
    bare = write_embeddings(tmp_path / "bare", e["eval_keys"], basis(1)[:len(e["eval_keys"])])
    common = dict(near_dup=T, embeddings=tmp / "emb-ds", exclude=[e["eval"], e["eval2"]])
    cases = [
        (dict(exclude_embeddings=[tmp / "emb-eval"]), "one per --exclude, in the same order: got 1 for 2"),
        (dict(exclude_embeddings=[tmp_path / "other", tmp / "emb-eval2"]),
         "was made by /elsewhere/other.pt, --embeddings"),
        (dict(exclude_embeddings=[tmp_path / "later", tmp / "emb-eval2"]), "as it was at two times"),
        (dict(exclude_embeddings=[bare, tmp / "emb-eval2"]), "no meta.json naming its encoder"),
        (dict(exclude_embeddings=[tmp / "emb-eval2", tmp / "emb-eval"]), "no embedding for 4 of the 6 images"),
    ]
    for i, (kw, message) in enumerate(cases):
        with pytest.raises(VlprepError, match=re.escape(message)) as err:
            run(e["ds"], tmp_path / f"o{i}", **common, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(VlprepError, match="goes with --near-dup and --embeddings"):
        run(e["ds"], tmp_path / "o9", exclude=[e["eval"]], exclude_embeddings=[tmp / "emb-eval"])


# --- user mistakes -----------------------------------------------------------------------------------------------


def test_a_bad_distance_is_a_one_line_error(planted, tmp_path, capfd):
    for i, bad in enumerate([-1, 33, 2.5, True]):
        with pytest.raises(VlprepError, match=re.escape("--phash is a Hamming distance")) as err:
            run(planted["ds"], tmp_path / f"o{i}", phash=bad)
        assert "\n" not in str(err.value)
    r = cli_in_process(capfd, "filter", planted["ds"], tmp_path / "c", "--phash", "40")
    assert r.returncode == 2 and "--phash is a Hamming distance" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

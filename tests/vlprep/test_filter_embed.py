"""vlprep filter's embedding rules: near duplicates (the greedy rule), --exclude, the CLIP score."""

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import cli_in_process
from tests.memrule import growth_per_sample
from vlprep import VlprepError
from vlprep.dataset import iter_tar, open_dataset, read_sidecars
from vlprep.filter import FilterConfig, filter_dataset
from vlprep.filterembed import Vectors, near_dup_greedy
from vlprep.shards import ShardsConfig, build_shards

DIM = 64
T = 0.9
A = math.acos(0.92)  # the chain's step: cos(A) = 0.92 >= T, cos(2A) = 0.6928 < T


def basis(seed: int = 0) -> np.ndarray:
    """DIM orthonormal vectors (rows), float64."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(DIM, DIM)))
    return q.T


def colour(i: int) -> tuple[int, int, int]:
    """Sample i's solid colour: 24 or more apart in some channel from any other i's."""
    return (12 + 24 * (i % 10), 12 + 24 * (i // 10 % 10), 40 + 24 * (i // 100))


def solid_png(c, w=20, h=18, **kw) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), c).save(buf, format="PNG", **kw)
    return buf.getvalue()


def dataset(root: Path, colours: list, captions: list[str], per_shard: int = 7) -> Path:
    """Solid-colour images with the given captions, sharded; returns the dataset folder."""
    src = root.with_name(root.name + "-src")
    src.mkdir(parents=True)
    for i, (c, cap) in enumerate(zip(colours, captions)):
        (src / f"{i:04d}.png").write_bytes(solid_png(c) if isinstance(c, tuple) else c)
        (src / f"{i:04d}.txt").write_text(cap)
    build_shards(ShardsConfig(src=src, out=root, samples_per_shard=per_shard, workers=1))
    return root


def keys_of(ds: Path) -> list[str]:
    return read_sidecars(open_dataset(ds), ["key"]).column(0).to_pylist()


def write_embeddings(folder: Path, keys: list[str], x: np.ndarray) -> Path:
    """A folder in `vlprep embed`'s output format."""
    folder.mkdir(parents=True)
    np.save(folder / "embeddings.npy", np.asarray(x, np.float32))
    pq.write_table(pa.table({"key": pa.array(keys, pa.string())}), folder / "keys.parquet")
    return folder


def planted_vectors() -> tuple[np.ndarray, dict[int, int]]:
    """30 image vectors; {position: the earlier kept position it is a near duplicate of} (the planted drops)."""
    q = basis()
    x = q[:30].copy()
    x[20] = 0.91 * q[3] + math.sqrt(1 - 0.91 ** 2) * q[41]   # 0.91 with 3: dropped
    x[21] = 0.89 * q[5] + math.sqrt(1 - 0.89 ** 2) * q[42]   # 0.89 with 5: kept
    x[22] = math.cos(A) * q[7] + math.sin(A) * q[40]         # 0.92 with 7: dropped
    x[23] = math.cos(2 * A) * q[7] + math.sin(2 * A) * q[40]  # 0.92 with 22 (dropped), 0.69 with 7: kept
    x[24] = q[9]                                             # 1.0 with 9: dropped
    x[25] = 0.95 * x[20] + math.sqrt(1 - 0.95 ** 2) * q[43]  # 0.95 with 20 (dropped), 0.86 with 3: kept
    return x, {20: 3, 22: 7, 24: 9}


def brute_greedy(x: np.ndarray, t: float, margin: float = 1e-3) -> dict[int, int]:
    """All pairs in float64: j dropped when an earlier kept i has cosine >= t; {j: the most similar such i}."""
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = u @ u.T
    off = c[~np.eye(len(x), dtype=bool)]
    assert np.abs(off - t).min() > margin  # no float32 near-tie decides
    keep = np.ones(len(x), bool)
    found = {}
    for j in range(len(x)):
        earlier = np.flatnonzero(keep[:j] & (c[j, :j] >= t))
        if earlier.size:
            keep[j] = False
            found[j] = int(earlier[np.argmax(c[j, earlier])])
    return found


class FakeEncoder:
    """The encoder-object interface (docs/PSEUDOLABEL.md): a solid colour's image -> its table vector (the nearest
    colour's), a caption -> its table vector."""

    def __init__(self, by_colour: dict, by_caption: dict):
        self.by_colour = {tuple(k): np.asarray(v, np.float32) for k, v in by_colour.items()}
        self.colours = np.array(list(self.by_colour), np.float64)
        self.by_caption = {k: np.asarray(v, np.float32) for k, v in by_caption.items()}
        self.dim = DIM
        self.image_size = 16
        self.min_crop_scale = 0.5
        self.name = "fake"
        self.fingerprint = "fake:1"
        self.device = "cpu"
        self.info = {"fake": True}

    def images(self, pixels: np.ndarray) -> np.ndarray:
        out = []
        for view in pixels:
            mean = view.reshape(-1, 3).mean(0)
            nearest = tuple(self.colours[np.argmin(((self.colours - mean) ** 2).sum(1))].astype(int).tolist())
            out.append(self.by_colour[nearest])
        return np.stack(out)

    def texts(self, captions: list[str]) -> np.ndarray:
        return np.stack([self.by_caption[c] for c in captions])


def run(ds, out, encoder=None, **kw) -> dict:
    kw.setdefault("workers", 1)
    return filter_dataset(FilterConfig(src=Path(ds), out=Path(out), **kw), encoder)


def dropped(out: Path) -> list[dict]:
    return pq.read_table(out / "dropped.parquet").to_pylist()


@pytest.fixture(scope="module")
def near(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("near")
    ds = dataset(tmp / "ds", [colour(i) for i in range(30)], [f"caption number {i}" for i in range(30)])
    x, truth = planted_vectors()
    keys = keys_of(ds)
    return {"tmp": tmp, "ds": ds, "x": x, "truth": truth, "keys": keys,
            "emb": write_embeddings(tmp / "emb", keys, x)}


# --- near duplicates ---------------------------------------------------------------------------------------------


def test_near_dup_finds_exactly_the_planted_ones_and_matches_a_brute_force_greedy(near):
    assert brute_greedy(near["x"], T) == near["truth"]
    out = near["tmp"] / "o"
    rep = run(near["ds"], out, near_dup=T, embeddings=near["emb"])
    keys = near["keys"]
    rows = dropped(out)
    got = {keys.index(r["key"]): keys.index(r["match_key"]) for r in rows}
    assert got == near["truth"] and all(r["rule"] == "near_dup" for r in rows)
    false_positives = set(got) - set(near["truth"])
    assert not false_positives and rep["kept"] == 27 and rep["dropped"]["near_dup"] == 3
    u = near["x"] / np.linalg.norm(near["x"], axis=1, keepdims=True)
    for r in rows:
        cos = u[keys.index(r["key"])] @ u[keys.index(r["match_key"])]
        assert abs(r["cosine"] - cos) <= 4 * DIM * 2 ** -24  # float32 products summed over DIM terms
    kept = {s["__key__"] for shard in open_dataset(out).shards for s in iter_tar(out / shard)}
    assert kept == set(keys) - {keys[j] for j in near["truth"]}
    assert (out / "near_dup.png").stat().st_size > 0 and "near_dup.png" in rep["outputs"]
    assert {(p["key"], p["kept"]) for p in rep["near_dup"]["pairs"]} == {(keys[a], keys[b]) for a, b in got.items()}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["options"]["near_dup"] == T and meta["vectors"]["image"]["rows"] == 30
    assert meta["options"]["order"][-1] == "near_dup"


def test_only_samples_the_earlier_rules_kept_take_part(near, tmp_path):
    keys = near["keys"]
    (tmp_path / "drop.txt").write_text(keys[3] + "\n" + keys[7] + "\n")
    run(near["ds"], tmp_path / "o", near_dup=T, embeddings=near["emb"], drop_keys=tmp_path / "drop.txt")
    alive = [j for j in range(30) if j not in (3, 7)]
    expected = {alive[j]: alive[i] for j, i in brute_greedy(near["x"][alive], T).items()}
    got = {keys.index(r["key"]): r["rule"] for r in dropped(tmp_path / "o")}
    assert got == {3: "drop_keys", 7: "drop_keys", **{j: "near_dup" for j in expected}}
    assert expected == {23: 22, 24: 9, 25: 20}  # 20 and 22 lost their earlier partner, so 25 and 23 now have one


def test_a_64_bit_key_hash_collision_is_settled_in_full(tmp_path, monkeypatch):
    import vlprep.filtervec

    monkeypatch.setattr(vlprep.filtervec, "key_hashes", lambda keys: np.zeros(len(keys), np.uint64))  # all collide
    vec = Vectors(write_embeddings(tmp_path / "e", ["a", "b", "c"], np.eye(3)), "--embeddings")
    assert vec.rows(pa.array(["c", "a", "zz", "b"])).tolist() == [2, 0, -1, 1]


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_greedy_equals_brute_force_on_random_clusters(tmp_path, kind):
    n = 200
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(8, 24))
    x = centres[rng.integers(0, 8, n)] + 0.22 * rng.normal(size=(n, 24))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    c = x.astype(np.float64) @ x.T.astype(np.float64)
    upper = np.sort(c[np.triu_indices(n, 1)])
    near_t = upper[(upper > 0.95) & (upper < 0.97)]
    g = int(np.argmax(np.diff(near_t)))
    t = float((near_t[g] + near_t[g + 1]) / 2)  # the threshold in the widest gap: no pair within `margin` of it
    margin = (near_t[g + 1] - near_t[g]) / 2
    assert margin > 1e-5  # far above the float32 rounding of a 24-term inner product (< 24 * 2**-24)
    expected = brute_greedy(x.astype(np.float64), t, margin=margin * 0.99)
    vec = Vectors(write_embeddings(tmp_path / "e", [f"k{i:04d}" for i in range(n)], x), "--embeddings")
    got_pos, got_partner, got_cos = near_dup_greedy(vec, np.arange(n), t, kind)
    assert dict(zip(got_pos.tolist(), got_partner.tolist())) == expected and 20 < len(expected) < n - 20
    np.testing.assert_allclose(got_cos, c[got_pos, got_partner], atol=24 * 2 ** -24)


def test_workers_give_the_same_bytes_and_the_order_is_fixed(near, tmp_path):
    a = run(near["ds"], tmp_path / "a", near_dup=T, embeddings=near["emb"], dedup=["image"])
    b = run(near["ds"], tmp_path / "b", near_dup=T, embeddings=near["emb"], dedup=["image"], workers=2)
    names = sorted(p.name for p in (tmp_path / "a").iterdir() if p.suffix in (".tar", ".parquet"))
    assert names and all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names)
    assert a["rules"]["order"] == ["bad_image", "dedup_image", "near_dup"] and a["dropped"] == b["dropped"]


# --- decontamination ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """Train: 30 solid colours, each its own basis vector. Eval: an exact copy of 11, a re-encoded copy of 12, a
    vector 0.93 from 13's and one 0.94 from 16's (near copies), one 0.88 from 15's (not), a distractor; eval 2: near
    copies of 17 and 10."""
    tmp = tmp_path_factory.mktemp("evals")
    q = basis(1)
    train_c = [colour(i) for i in range(30)]
    caps = [f"train caption {i}" for i in range(30)]
    ds = dataset(tmp / "ds", train_c, caps)
    by_colour = {c: q[i] for i, c in enumerate(train_c)}
    eval_c = [colour(11), solid_png(colour(12), compress_level=9), colour(200), colour(201), colour(202),
              colour(203)]
    by_colour[colour(200)] = 0.93 * q[13] + math.sqrt(1 - 0.93 ** 2) * q[50]
    by_colour[colour(201)] = 0.88 * q[15] + math.sqrt(1 - 0.88 ** 2) * q[51]
    by_colour[colour(202)] = 0.94 * q[16] + math.sqrt(1 - 0.94 ** 2) * q[52]  # before 17 (eval 2) in its shard
    by_colour[colour(203)] = q[53]
    ev = dataset(tmp / "eval", eval_c, [f"eval caption {i}" for i in range(6)], per_shard=4)
    by_colour[colour(210)] = 0.97 * q[17] + math.sqrt(1 - 0.97 ** 2) * q[54]
    by_colour[colour(211)] = 0.96 * q[10] + math.sqrt(1 - 0.96 ** 2) * q[55]  # in 13's shard (7-13)
    ev2 = dataset(tmp / "eval2", [colour(210), colour(211)], ["eval two", "eval three"])
    enc = FakeEncoder(by_colour, {})
    return {"tmp": tmp, "ds": ds, "eval": ev, "eval2": ev2, "enc": enc, "keys": keys_of(ds),
            "eval_keys": keys_of(ev), "eval2_keys": keys_of(ev2)}


def test_exclude_drops_every_planted_overlap_and_names_the_pairs(evals):
    out = evals["tmp"] / "o"
    rep = run(evals["ds"], out, evals["enc"], near_dup=T, exclude=[evals["eval"], evals["eval2"]])
    keys = evals["keys"]
    ek = evals["eval_keys"]
    got = {(keys.index(p["key"]), p["eval"], p["eval_key"], None if p["cosine"] is None else round(p["cosine"], 3))
           for p in rep["exclude"]["pairs"]}
    assert got == {(11, str(evals["eval"]), ek[0], None), (12, str(evals["eval"]), ek[1], None),
                   (13, str(evals["eval"]), ek[2], 0.93), (17, str(evals["eval2"]), evals["eval2_keys"][0], 0.97),
                   (10, str(evals["eval2"]), evals["eval2_keys"][1], 0.96), (16, str(evals["eval"]), ek[4], 0.94)}
    rows = {keys.index(r["key"]): r for r in dropped(out)}
    assert set(rows) == {10, 11, 12, 13, 16, 17} and rep["dropped"]["exclude"] == 6 and rep["dropped"]["near_dup"] == 0
    assert rows[13]["match_dataset"] == str(evals["eval"]) and rows[13]["match_key"] == ek[2]
    assert (out / "_embed" / "image" / "embeddings.npy").exists()  # the encoder's vectors, kept for a re-run
    exact_only = run(evals["ds"], evals["tmp"] / "x", exclude=[evals["eval"]])
    assert {keys.index(p["key"]) for p in exact_only["exclude"]["pairs"]} == {11, 12}
    again = run(evals["ds"], out, evals["enc"], near_dup=T, exclude=[evals["eval2"], evals["eval"]], overwrite=True)
    assert {(p["key"], p["eval_key"]) for p in again["exclude"]["pairs"]} == {(p["key"], p["eval_key"])
                                                                              for p in rep["exclude"]["pairs"]}
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta["options"]["exclude_signatures"]) == {str(evals["eval"]), str(evals["eval2"])}
    assert meta["options"]["image_vectors"] == {"checkpoint": "fake", "fingerprint": "fake:1"}


# --- the CLIP score ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """20 pairs whose caption vector is at cosine s_i from the image's; 4, 5 and 6 share one pair (a tie)."""
    tmp = tmp_path_factory.mktemp("clip")
    q = basis(2)
    rng = np.random.default_rng(3)
    s = -0.5 + 0.07 * rng.permutation(20) + 0.005  # distinct, and 0.005 or more from any multiple of 0.01
    s[4:7] = 0.505
    img = np.stack([q[min(i, 4) if 4 <= i <= 6 else i] for i in range(20)])
    txt = np.stack([s[i] * img[i] + math.sqrt(1 - s[i] ** 2) * q[30 + (4 if 4 <= i <= 6 else i)]
                    for i in range(20)])
    txt = (txt * 2.0 ** (np.arange(20) % 3)[:, None]).astype(np.float32)  # not normalised; scaled exactly
    caps = [f"clip caption {i}" for i in range(20)]
    ds = dataset(tmp / "ds", [colour(i) for i in range(20)], caps)
    keys = keys_of(ds)
    img = img.astype(np.float32)
    ref = cosine_rows(img, txt)
    return {"tmp": tmp, "ds": ds, "keys": keys, "s": s, "ref": ref.astype(np.float32),
            "img": write_embeddings(tmp / "img", keys, img), "txt": write_embeddings(tmp / "txt", keys, txt),
            "enc": FakeEncoder({colour(i): img[i] for i in range(20)}, dict(zip(caps, txt)))}


@pytest.fixture
def no_figures(monkeypatch):
    """The filter's figures (clip_score.png, clip_score_low.png, near_dup.png) named in the report but not drawn: for
    the tests that read none of them, where matplotlib was most of a run on 20 samples; test_clip_score_min_equals_a_
    re_derivation and the real-checkpoint test draw them."""
    monkeypatch.setattr("vlprep.filterreport.histogram_png", lambda path, *args, **kw: path.name)
    monkeypatch.setattr("vlprep.filterreport.image_grid", lambda path, *args, **kw: path.name)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine in float64 of the float32 vectors, rounded to float32."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return ((a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))).astype(np.float32)


def sidecar_scores(out: Path) -> dict[str, float]:
    side = read_sidecars(open_dataset(out), ["key", "clip_score"])
    assert side.schema.field("clip_score").type == pa.float32()
    return dict(zip(side.column(0).to_pylist(), side.column(1).to_pylist()))


def test_clip_score_min_equals_a_re_derivation(clip):
    out = clip["tmp"] / "min"
    rep = run(clip["ds"], out, clip_score_min=0.2, embeddings=clip["img"], text_embeddings=clip["txt"])
    keys = clip["keys"]
    got = sidecar_scores(out)
    ref = clip["ref"]
    assert set(got) == {keys[i] for i in range(20) if ref[i] >= np.float32(0.2)}
    assert np.abs(np.float32(0.2) - ref).min() > 1e-3
    for k, v in got.items():  # float64 cosine rounded once to float32: within one float32 ulp of the reference
        assert abs(v - ref[keys.index(k)]) <= 2 ** -23 * abs(ref[keys.index(k)])
    assert {keys.index(r["key"]) for r in dropped(out)} == {i for i in range(20) if ref[i] < 0.2}
    assert rep["clip_score"]["threshold"] == 0.2 and sum(rep["clip_score"]["histogram"]["counts"]) == 20
    assert (out / "clip_score.png").exists() and (out / "clip_score_low.png").exists()
    assert rep["clip_score"]["lowest"][0]["key"] == keys[int(np.argmin(ref))]


@pytest.mark.parametrize("top, expected_kept", [(0.5, 10), (0.3, 6), (1.0, 20), (0.04, 0)])
def test_clip_score_top_keeps_the_top_fraction_ties_in_dataset_order(clip, top, expected_kept, no_figures):
    out = clip["tmp"] / f"top{top}"
    rep = run(clip["ds"], out, clip_score_top=top, embeddings=clip["img"], text_embeddings=clip["txt"])
    keys = clip["keys"]
    ref = clip["ref"]
    order = sorted(range(20), key=lambda i: (-float(ref[i]), i))  # by score, ties by dataset order
    assert rep["kept"] == expected_kept
    assert set(sidecar_scores(out)) == {keys[i] for i in order[:expected_kept]}


def test_clip_score_top_cuts_through_a_tie_by_dataset_order(clip, no_figures):
    ref = clip["ref"]
    assert ref[4] == ref[5] == ref[6]
    above = int((ref > ref[4]).sum())
    top = (above + 2) / 20  # keeps 2 of the 3 tied samples
    out = clip["tmp"] / "tie"
    run(clip["ds"], out, clip_score_top=top, embeddings=clip["img"], text_embeddings=clip["txt"])
    kept = {clip["keys"].index(k) for k in sidecar_scores(out)}
    assert {4, 5} <= kept and 6 not in kept


def test_clip_score_from_an_encoder_and_a_rerun_reuses_the_vectors(clip, tmp_path, monkeypatch, no_figures):
    out = tmp_path / "o"
    first = run(clip["ds"], out, clip["enc"], clip_score_min=0.2)
    assert first["clip_score"]["cached"] is False and (out / "_embed" / "clip_score.npy").exists()
    a = sidecar_scores(out)
    assert a == sidecar_scores(clip["tmp"] / "min")
    parts = {p: p.stat().st_mtime_ns for p in (out / "_embed").rglob("_parts/*")}
    rep = run(clip["ds"], out, clip["enc"], clip_score_min=0.3, overwrite=True)
    assert {p: p.stat().st_mtime_ns for p in (out / "_embed").rglob("_parts/*")} == parts and parts
    assert set(sidecar_scores(out)) == {clip["keys"][i] for i in range(20) if clip["ref"][i] >= 0.3}
    assert rep["rules"]["clip_score_min"] == 0.3 and rep["clip_score"]["cached"] is True
    import vlprep.filterembed

    def no_recompute(*_):
        raise AssertionError("the scores were recomputed")

    monkeypatch.setattr(vlprep.filterembed, "cosines", no_recompute)
    third = run(clip["ds"], out, clip["enc"], clip_score_top=0.5, overwrite=True)  # read from the cache
    assert third["kept"] == 10 and third["clip_score"]["cached"] is True
    with pytest.raises(AssertionError, match="recomputed"):  # other vectors: not reused
        run(clip["ds"], tmp_path / "p", clip_score_min=0.3, embeddings=clip["img"], text_embeddings=clip["txt"])


# --- a real checkpoint -------------------------------------------------------------------------------------------


def test_a_real_checkpoint_through_the_cli_equals_vlprep_embed(world, tmp_path, capfd):
    from vlprep.embed import load_embeddings

    # the reference through the CLI too, in this same process: the same set-up (torch's threads) as the filter's
    # embed pass, so the same float reductions and the same bytes
    for folder, modality in (("i", "image"), ("t", "text")):
        r = cli_in_process(capfd, "embed", world["aligned"], tmp_path / folder, "--checkpoint", world["ckpt"],
                           "--device", "cpu", "--modality", modality, "--workers", "1")
        assert r.returncode == 0, r.stderr
    keys, x = load_embeddings(tmp_path / "i")
    _, y = load_embeddings(tmp_path / "t")
    u = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    upper = np.sort((u @ u.T)[np.triu_indices(40, 1)])
    lo = len(upper) // 2
    gap = lo + int(np.argmax(np.diff(upper[lo:])))  # the threshold in the widest gap of the top 10% of cosines
    t = float((upper[gap] + upper[gap + 1]) / 2)
    r = cli_in_process(capfd, "filter", world["aligned"], tmp_path / "o", "--near-dup", t, "--checkpoint",
                       world["ckpt"], "--device", "cpu", "--clip-score-top", "0.5", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert "near_dup" in r.stderr and "clip_score" in r.stderr and "clip score: threshold" in r.stderr
    made = tmp_path / "o" / "_embed" / "image" / "embeddings.npy"
    assert made.read_bytes() == (tmp_path / "i" / "embeddings.npy").read_bytes()
    margin = (upper[gap + 1] - upper[gap]) / 2
    assert margin > 4 * 16 * 2 ** -24  # above the float32 rounding of a 16-term inner product of unit vectors
    rows = dropped(tmp_path / "o")
    near = {keys.index(r["key"]) for r in rows if r["rule"] == "near_dup"}
    assert near == set(brute_greedy(x.astype(np.float64), t, margin=margin * 0.99)) and near
    alive = [i for i in range(40) if i not in near]
    ref = cosine_rows(x, y)[alive]
    kept = set(sidecar_scores(tmp_path / "o"))
    expected = sorted(range(len(alive)), key=lambda j: (-float(ref[j]), j))[:len(alive) // 2]
    assert kept == {keys[alive[j]] for j in expected}


# --- user mistakes -----------------------------------------------------------------------------------------------


def test_one_line_errors(near, clip, tmp_path, capfd):
    """The stage's errors and the CLI's (exit 2, one line on stderr; the CLI in this process: the claim is the message
    and the status main() exits with, not the process boundary)."""
    cases = [
        (dict(near_dup=T), "--near-dup needs image embeddings"),
        (dict(near_dup=0.0, embeddings=near["emb"]), "in (0, 1]"),
        (dict(near_dup=1.5, embeddings=near["emb"]), "in (0, 1]"),
        (dict(clip_score_min=0.1, clip_score_top=0.5, embeddings=clip["img"], text_embeddings=clip["txt"]),
         "give one"),
        (dict(clip_score_top=0.0, embeddings=clip["img"], text_embeddings=clip["txt"]), "fraction in (0, 1]"),
        (dict(clip_score_min=0.1, embeddings=clip["img"]), "--text-embeddings"),
        (dict(exclude=[tmp_path / "nope"]), "not a vlprep dataset"),
        (dict(near_dup=T, embeddings=tmp_path), "not a `vlprep embed` output"),
        (dict(near_dup=T, embeddings=clip["img"]), "no embedding for key"),  # another dataset's keys
    ]
    for i, (kw, message) in enumerate(cases):
        with pytest.raises(VlprepError, match=re.escape(message)) as e:
            run(near["ds"], tmp_path / f"o{i}", **kw)
        assert "\n" not in str(e.value)
    r = cli_in_process(capfd, "filter", near["ds"], tmp_path / "c", "--near-dup", "0.9")
    assert r.returncode == 2 and "--near-dup needs" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli_in_process(capfd, "filter", near["ds"], tmp_path / "c2", "--exclude", tmp_path / "nope")
    assert r.returncode == 2 and "not a vlprep dataset" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- memory ------------------------------------------------------------------------------------------------------


def test_near_dup_driver_memory_per_sample(tmp_path):
    """The vectors (32 floats: 128 bytes a sample) live in the memory map and FAISS' index, outside Python's heap
    and not counted here; the driver's own arrays are the key hashes, their order and the rows (8 bytes each) and one
    byte of state; about 35 bytes a sample are measured in all (at n = QUERY_BATCH and at n = 5000 alike; the rest:
    numpy's sort scratch and FAISS' result buffers, not attributed further), under the bar with room to spare, and
    a copy of the vectors in the driver (128 bytes a sample) measures about 163: caught."""
    dim = 32
    made = {}

    def go(m: int) -> None:
        if m not in made:
            x = np.random.default_rng(m).normal(size=(m, dim)).astype(np.float32)
            made[m] = write_embeddings(tmp_path / f"e{m}", [f"key{i:08d}" for i in range(m)], x)
        vec = Vectors(made[m], "--embeddings")
        near_dup_greedy(vec, np.arange(m), 0.99)

    # n = QUERY_BATCH, the least n at which a batch's buffers are the same size at n and 4n (one full batch, then
    # four): the flat range search is quadratic in n, and 5000 cost half again as much for no other claim
    from vlprep.filtervec import QUERY_BATCH

    per = growth_per_sample(go, QUERY_BATCH)
    assert per < 80, per


def test_each_query_keeps_its_most_similar_hit_the_first_on_ties():
    from vlprep.filterembed import best_per_query

    rng = np.random.default_rng(0)
    owner = np.sort(rng.integers(0, 50, 2000))
    dist = rng.choice(np.float32([0.95, 0.96, 0.97]), 2000)  # three values: ties in almost every query
    expected = []
    for j in np.unique(owner).tolist():  # the plain per-query pass
        hits = np.flatnonzero(owner == j)
        expected.append((j, int(hits[np.argmax(dist[hits])])))
    assert best_per_query(owner, dist) == expected
    shuffled = rng.permutation(2000)  # hits in any order: the first in that order wins a tie
    o, d = owner[shuffled], dist[shuffled]
    firsts = {j: int(np.flatnonzero(o == j)[np.argmax(d[o == j])]) for j in np.unique(o).tolist()}
    assert dict(best_per_query(o, d)) == firsts
    assert best_per_query(np.zeros(0, np.int64), np.zeros(0, np.float32)) == []

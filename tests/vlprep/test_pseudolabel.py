import hashlib
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import COLOURS, THINGS, cli_in_process, image_bytes, make_dataset, tiny_checkpoint
from vlprep import VlprepError, knn
from vlprep.dataset import iter_samples, open_dataset, read_sidecars
from vlprep.output import Out, finish_dataset, write_shard
from vlprep.pseudolabel import (PseudolabelConfig, STRATEGIES, caption_words, neighbour_keys, pseudolabel,
                                rank_words, top_words)
from vltrain.checkpoint_encoder import CheckpointEncoder

STOP = set((Path(__file__).parents[2] / "vlprep/data/stopwords/english").read_text().split())


def words_of(caption: str) -> set[str]:
    """Re-derivation of the candidate words: bow's tokens, lowercased, alphabetic, not NLTK stop words."""
    return {t for t in re.findall(r"\w+|[^\w\s]", caption.lower()) if t.isalpha() and t not in STOP}


def reference_rank(nn: list[str], strategy: str, df: dict, t: int, p: int, seed=None) -> list[str]:
    """A straightforward re-derivation of the four strategies from the paper's wording."""
    count = {}
    for c in nn:
        for w in words_of(c):
            count[w] = count.get(w, 0) + 1
    removed = set([w for w, _ in sorted(df.items(), key=lambda x: (-x[1], x[0]))][:t])
    if strategy == "maxcount":
        scored = [(-count[w], w) for w in count]
    elif strategy == "rmtopmaxcount":
        scored = [(-count[w], w) for w in count if w not in removed]
    elif strategy == "weighted":
        scored = [(-(count[w] / df[w]), w) for w in count]
    else:
        cands = sorted(w for w in count if w not in removed)
        random.Random(seed).shuffle(cands)
        return cands[:p]
    return [w for _, w in sorted(scored)][:p]


# --- ranking on a hand-built NN_i ---------------------------------------------------------------

NN = ["A red dog runs on the grass.", "The red dog sleeps.", "A dog and a cat, a dog!", "red dog", "red dog",
      "A cat on the grass 2 times"]
DF = {"dog": 50, "red": 10, "grass": 4, "cat": 8, "runs": 1, "sleeps": 2, "times": 3, "tree": 100}


def test_candidate_words_use_bows_tokeniser_and_stop_words():
    assert caption_words("A dog and a cat, a dog!") == {"dog", "cat"}
    assert caption_words("The 2 CATS don't sit; café") == {"cats", "sit", "café"}  # don, t: stop words; 2: not alpha
    assert all(caption_words(c) == words_of(c) for c in NN)


def test_top_t_agrees_with_bows_rmtop_after_rmstop(tmp_path):
    # S_a given to both commands (bow with every caption in the base set): pseudolabel's top(t) and bow's
    # `rmstop,rmtop:t` set are the same content words, in the order a plain Counter loop ranks them.
    from vlprep.bow import BowConfig, bow, top_tokens

    def document_frequency(captions):  # count(w, S_a): captions containing each candidate word
        return Counter(w for c in captions for w in caption_words(c))

    rng = random.Random(0)
    vocab = ["the", "a", ".", ",", "of", "dog", "cat", "red", "tree", "2", "grass", "man", "on", "sky", "boat"]
    caps = [" ".join(rng.choices(vocab, [1 / (r + 1) for r in range(len(vocab))], k=rng.randint(2, 8)))
            for _ in range(60)]
    ds = make_dataset(tmp_path / "a", caps, per_shard=25)
    rep = bow(BowConfig(src=ds, out=tmp_path / "b", ops="rmstop,rmtop:5", base_frac=1.0, workers=1))
    df = {}
    for c in caps:
        for w in words_of(c):
            df[w] = df.get(w, 0) + 1
    expected = [w for w, _ in sorted(df.items(), key=lambda kv: (-kv[1], kv[0]))[:5]]
    assert rep["rmtop_tokens"] == expected == top_tokens(document_frequency(caps), 5)
    assert top_words(document_frequency(caps), 5) == set(expected)
    assert not {"the", "a", ".", ",", "of", "on", "2"} & set(expected)  # the most frequent tokens are not ranked


def test_maxcount_worked_by_hand():
    # count(w, NN): dog 5 (twice in one caption counts once; the duplicate "red dog" counts twice), red 4,
    # cat 2, grass 2, runs 1, sleeps 1, times 1; ties by the word: cat before grass, runs before sleeps.
    assert rank_words(NN, "maxcount", p=4) == ["dog", "red", "cat", "grass"]
    assert rank_words(NN, "maxcount", p=7) == ["dog", "red", "cat", "grass", "runs", "sleeps", "times"]
    assert rank_words(NN, "maxcount", p=1) == ["dog"]


def test_rmtopmaxcount_worked_by_hand():
    # top(2) of DF = {tree 100, dog 50}: dog goes, then MaxCount: red 4, cat 2, grass 2, runs 1
    assert top_words(DF, 2) == {"tree", "dog"}
    assert rank_words(NN, "rmtopmaxcount", aligned_df=DF, top=2, p=4) == ["red", "cat", "grass", "runs"]
    assert rank_words(NN, "rmtopmaxcount", top={"red", "cat"}, p=3) == ["dog", "grass", "runs"]
    assert rank_words(NN, "rmtopmaxcount", aligned_df=DF, top=0, p=2) == ["dog", "red"]  # t = 0 is MaxCount


def test_weighted_worked_by_hand():
    # count(w, NN) / count(w, S_a): runs 1/1, grass 2/4 = sleeps 1/2 (tie: grass first), red 4/10, times 1/3,
    # cat 2/8, dog 5/50
    assert rank_words(NN, "weighted", aligned_df=DF, p=7) == ["runs", "grass", "sleeps", "red", "times", "cat", "dog"]
    assert rank_words(NN, "weighted", aligned_df=DF) == ["runs", "grass", "sleeps", "red"]  # p defaults to 4


def test_rmtoprand_is_the_rmtop_candidates_shuffled():
    got = rank_words(NN, "rmtoprand", aligned_df=DF, top=2, p=10, rng=random.Random(3))
    cands = ["cat", "grass", "red", "runs", "sleeps", "times"]  # no dog (top 2), sorted before the shuffle
    expected = list(cands)
    random.Random(3).shuffle(expected)
    assert got == expected and sorted(got) == cands
    assert rank_words(NN, "rmtoprand", aligned_df=DF, top=2, p=2, rng=random.Random(3)) == expected[:2]
    assert len({tuple(rank_words(NN, "rmtoprand", aligned_df=DF, top=2, p=6, rng=random.Random(s)))
                for s in range(20)}) > 5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_matches_a_re_derivation_on_random_neighbours(strategy):
    rng = random.Random(0)
    vocab = ["dog", "cat", "red", "sky", "tree", "car", "boat", "the", "a", "of", "on", "2", ",", "Sun", "man"]
    aligned = [" ".join(rng.choices(vocab, k=rng.randint(1, 9))) for _ in range(300)]
    df = Counter(w for c in aligned for w in words_of(c))
    for trial in range(50):
        nn = rng.choices(aligned, k=rng.choice([1, 5, 30]))
        p, t = rng.randint(1, 6), rng.randint(0, 4)
        got = rank_words(nn, strategy, aligned_df=df, top=t, p=p, rng=random.Random(trial))
        assert got == reference_rank(nn, strategy, df, t, p, seed=trial), (strategy, nn, p, t)


def test_rank_words_errors():
    with pytest.raises(ValueError, match="unknown strategy 'best'.*maxcount, rmtopmaxcount, rmtoprand, weighted"):
        rank_words(NN, "best")
    with pytest.raises(ValueError, match="weighted needs aligned_df"):
        rank_words(NN, "weighted")
    with pytest.raises(ValueError, match="no ALIGNED document frequency, e.g. 'runs'"):
        rank_words(NN, "weighted", aligned_df={**DF, "runs": 0})
    with pytest.raises(ValueError, match="rmtoprand needs rng"):
        rank_words(NN, "rmtoprand")
    with pytest.raises(ValueError, match="p must be at least 1"):
        rank_words(NN, "maxcount", p=0)
    assert rank_words(["the a of", "2 , !"], "maxcount") == []  # no candidate words at all


def test_neighbour_keys_most_retrieved_then_best_score_then_key():
    keys = ["k0", "k1", "k2", "k3"]
    ids = np.array([[2, 1, 0], [1, 2, 3], [3, 1, -1]])
    scores = np.array([[0.9, 0.8, 0.1], [0.7, 0.6, 0.5], [0.95, 0.4, -1e9]])
    # hits: k1 3, k2 2, k3 2, k0 1; k2 and k3 tie on hits, k3's best (0.95) beats k2's (0.9)
    assert neighbour_keys(ids, scores, keys, 10) == ["k1", "k3", "k2", "k0"]
    assert neighbour_keys(ids, scores, keys, 2) == ["k1", "k3"]


# --- the index ---------------------------------------------------------------------------------


# --- the stage with a tiny checkpoint ----------------------------------------------------------



def run(w, out, **kw) -> dict:
    kw.setdefault("device", "cpu")
    kw.setdefault("k", 3)
    kw.setdefault("crops", 2)
    kw.setdefault("batch_size", 4)
    enc = CheckpointEncoder(w["ckpt"], kw["device"])
    return pseudolabel(PseudolabelConfig(aligned=w["aligned"], unaligned=w["unaligned"], out=Path(out), **kw), enc)


def reference_pseudo_captions(w, strategy: str, k: int, crops: int, p: int, seed: int, rmtop: int = 1000) -> dict:
    """The whole method re-derived with the model, numpy brute force and reference_rank: key -> (words, nbrs)."""
    from torchvision.transforms import v2

    from vlprep.dataset import decode_rgb
    from vltrain.config import ModelConfig
    from vltrain.model import build_model, build_tokenizer

    ckpt = torch.load(w["ckpt"], weights_only=True)
    model = build_model(ModelConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    tok = build_tokenizer(model.cfg)
    caps, keys = w["captions"], [f"al_{i:09d}" for i in range(40)]
    with torch.no_grad():
        enc = tok(caps, padding="longest", truncation=True, max_length=12, return_tensors="pt")
        txt = model.encode_text(enc["input_ids"], enc["attention_mask"])[1].numpy()
    df = Counter(x for c in caps for x in words_of(c))
    out = {}
    for s in iter_samples(w["unaligned"], decode=False):
        img = decode_rgb(s["png"])
        gen_seed = int.from_bytes(hashlib.blake2b(f"crop:{seed}:{s['__key__']}".encode(), digest_size=8).digest(),
                                  "big") >> 1
        torch.manual_seed(gen_seed)  # the documented rule: the default generator seeded per key
        crop = v2.RandomResizedCrop(32, scale=(0.5, 1.0))  # on the PIL image
        x = torch.stack([v2.functional.pil_to_tensor(crop(img)) for _ in range(crops)]).float() / 255
        with torch.no_grad():
            feat = model.encode_image((x - 0.5) / 0.5)[1].numpy()
        sim = feat @ txt.T
        top = np.argsort(-sim, axis=1, kind="stable")[:, :k]
        nn = [caps[j] for j in top.ravel()]
        words = reference_rank(nn, strategy, df, rmtop, p, seed=f"{seed}:{s['__key__']}")
        hits = Counter(top.ravel().tolist())
        best = {j: max(sim[r, j] for r in range(crops) if j in top[r]) for j in hits}
        nbrs = [keys[j] for j in sorted(hits, key=lambda j: (-hits[j], -best[j], keys[j]))[:k]]
        out[s["__key__"]] = (" ".join(words), nbrs)
    return out


@pytest.mark.parametrize("strategy", ["weighted", "rmtoprand"])
def test_end_to_end_equals_a_re_derivation(world, tmp_path, strategy):
    rep = run(world, tmp_path / "o", strategy=strategy, k=3, crops=2, words=3, rmtop=3, seed=5)
    expected = reference_pseudo_captions(world, strategy, k=3, crops=2, p=3, seed=5, rmtop=3)
    got = {s["__key__"]: s for s in iter_samples(tmp_path / "o")}
    raw_in = {s["__key__"]: s for s in iter_samples(world["unaligned"], decode=False)}
    assert {k: (s["txt"], s["json"]["neighbours"]) for k, s in got.items()} == expected
    for key, s in got.items():
        assert s["png"] == raw_in[key]["png"]  # image bytes untouched
        assert s["json"]["pseudo"] is True and s["json"]["strategy"] == strategy
        assert s["json"]["uid"] == json.loads(raw_in[key]["json"])["uid"]
    side = read_sidecars(open_dataset(tmp_path / "o")).to_pylist()
    assert [(r["key"], r["caption"], r["pseudo"], r["strategy"], r["neighbours"]) for r in side] == \
        [(k, s["txt"], True, strategy, s["json"]["neighbours"]) for k, s in got.items()]
    assert json.loads((tmp_path / "o" / "sizes.json").read_text()) == {"un-000000.tar": 5, "un-000001.tar": 5,
                                                                        "un-000002.tar": 4}
    assert (rep["samples_in"], rep["written"], rep["dropped_no_words"], rep["skipped"]) == (14, 14, 0, {})
    assert rep["index"]["kind"] == "flat" and rep["index"]["vectors"] == 40 and rep["index"]["reused"] is False
    words = Counter(x for s in got.values() for x in s["txt"].split())
    df = Counter(x for c in world["captions"] for x in words_of(c))
    assert rep["top_words"] == [[x, n, df[x]] for x, n in words.most_common(30)]
    assert all(Path(p).stat().st_size > 0 for p in rep["plots"])
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["stage"] == "pseudolabel" and meta["counts"]["written"] == 14


def test_deterministic_resumable_and_index_reused(world, tmp_path, monkeypatch):
    """Same seed, other batches: the same bytes; a resume rebuilds only the missing shards and reuses the index.

    The report's figures are left out of these four runs: nothing here reads them (the compared files are the shards
    and sidecars) and matplotlib was a large part of each run; test_end_to_end_equals_a_re_derivation and
    test_vltrain_checkpoint_pseudolabel_then_train_on_both draw them."""
    monkeypatch.setattr("vlprep.report.pseudolabel_figures", lambda *args: {})
    files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".tar", ".parquet")}  # noqa
    run(world, tmp_path / "a", seed=1)
    run(world, tmp_path / "b", seed=1, batch_size=3)  # other batches: same crops (seeded per key), same bytes
    assert files(tmp_path / "a") == files(tmp_path / "b")
    (tmp_path / "b" / "un-000001.tar").unlink()
    (tmp_path / "b" / "sizes.json").unlink()
    (tmp_path / "b" / "un-000002.tar.tmp").write_bytes(b"half")
    rep = run(world, tmp_path / "b", seed=1, batch_size=3)
    assert rep["shards_resumed"] == 2 and rep["index"]["reused"] is True
    assert files(tmp_path / "a") == files(tmp_path / "b") and not list((tmp_path / "b").glob("*.tmp"))
    other = run(world, tmp_path / "c", seed=2)
    assert files(tmp_path / "c") != files(tmp_path / "a")  # the seed moves the crops
    assert other["written"] == 14


def test_forced_ivf_index_is_used_and_saved(world, tmp_path):
    rep = run(world, tmp_path / "o", index="ivf", nprobe=50)
    assert rep["index"]["kind"] == "ivf" and rep["index"]["nlist"] == 1 and rep["index"]["nprobe"] == 1
    assert knn.kind_of(knn.load_index(tmp_path / "o" / "knn.faiss")) == "ivf"
    assert rep["written"] == 14


def test_bow_aligned_uses_caption_raw_and_rmtop(world, tmp_path, monkeypatch):
    """The report's figures are left out of these five runs: nothing here reads them (the checks are the counts, the
    warnings, the caption table and the shards) and matplotlib was a large part of each run; other tests draw them."""
    from vlprep.bow import BowConfig, bow

    monkeypatch.setattr("vlprep.report.pseudolabel_figures", lambda *args: {})

    bow(BowConfig(src=world["aligned"], out=tmp_path / "bow", ops="rmstop,keep:1", base_frac=0.0, workers=1))
    w = {**world, "aligned": tmp_path / "bow"}
    run(w, tmp_path / "o", strategy="maxcount", words=10)
    stored = pq.read_table(tmp_path / "o" / "knn_captions.parquet")
    assert stored.column("caption").to_pylist() == world["captions"]  # intact captions, not the 1-word bows
    # with words=10 the pseudo captions hold words that only the intact captions have (e.g. "number" or a 2nd thing)
    assert any(len(s["txt"].split()) > 1 for s in iter_samples(tmp_path / "o"))
    # rmtop over ALIGNED: removing the 100 most frequent words leaves nothing -> every image dropped and counted
    rep = run(w, tmp_path / "o2", strategy="rmtopmaxcount", rmtop=100)
    assert (rep["written"], rep["dropped_no_words"]) == (0, 14)
    # ... and the report says so: top(t) took a third or more of the aligned vocabulary
    (line,) = rep["warnings"]
    assert f"of the {rep['aligned_vocab']:,} aligned words" in line and "14 of 14 images" in line
    assert run(w, tmp_path / "o3", strategy="rmtopmaxcount", rmtop=1)["warnings"] == []  # t small for this vocabulary
    assert run(w, tmp_path / "o4", strategy="weighted", rmtop=100)["warnings"] == []  # rmtop unused: no line
    assert json.loads((tmp_path / "o2" / "sizes.json").read_text()) == {"un-000000.tar": 0, "un-000001.tar": 0,
                                                                         "un-000002.tar": 0}


def test_undecodable_and_imageless_samples_are_counted_skips(world, tmp_path):
    good = list(iter_samples(world["unaligned"], decode=False))[:3]
    root = tmp_path / "bad"
    root.mkdir()
    samples = [{"__key__": "x_0", "png": b"not a png"}, {"__key__": "x_1", "txt": "no image"},
               *({k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"} for s in good)]
    write_shard(Out(root), "x-000000.tar", samples, [{"key": s["__key__"], "caption": ""} for s in samples])
    finish_dataset(Out(root), {"x-000000.tar": 5}, {"stage": "test"})
    rep = run({**world, "unaligned": root}, tmp_path / "o")
    assert rep["skipped"] == {"undecodable": 1, "no_image": 1} and rep["written"] == 3
    assert rep["skipped_examples"] == {"undecodable": ["x_0"], "no_image": ["x_1"]}
    assert [s["__key__"] for s in iter_samples(tmp_path / "o")] == [s["__key__"] for s in good]


# --- bad inputs --------------------------------------------------------------------------------


def test_bad_inputs_are_one_line_errors(world, tmp_path):
    w = world
    mismatched = tmp_path / "mismatch.pt"
    ckpt = torch.load(w["ckpt"], weights_only=True)
    ckpt["config"]["model"]["embed_dim"] = 8  # the weights are 16 wide
    torch.save(ckpt, mismatched)
    cases = [
        ({"checkpoint": mismatched}, "checkpoint has embed_dim 16, config asks 8"),
        ({"checkpoint": tmp_path / "none.pt"}, "checkpoint not found"),
        ({"checkpoint": w["aligned"] / "sizes.json"}, "not a vltrain checkpoint"),
        ({"checkpoint": tiny_checkpoint(tmp_path / "f.pt", image_model="features")}, "cannot embed images"),
        ({"strategy": "best"}, "unknown --strategy 'best'"),
        ({"index": "hnsw"}, "unknown --index 'hnsw'"),
        ({"k": 0}, "--k must be at least 1"),
        ({"words": 0}, "--words must be at least 1"),
        ({"nprobe": 0}, "--nprobe must be at least 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(VlprepError, match=msg) as e:
            run({**w, "ckpt": kw.get("checkpoint", w["ckpt"])}, tmp_path / "o",
                **{k: v for k, v in kw.items() if k != "checkpoint"})
        assert "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()  # nothing written before the inputs are checked

    empty = tmp_path / "empty"
    empty.mkdir()
    finish_dataset(Out(empty), {}, {"stage": "test"})
    with pytest.raises(VlprepError, match="ALIGNED .* has no samples"):
        run({**w, "aligned": empty}, tmp_path / "o")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.png").write_bytes(image_bytes())
    with pytest.raises(VlprepError, match="UNALIGNED: not a shard dataset"):
        run({**w, "unaligned": plain}, tmp_path / "o")
    with pytest.raises(VlprepError, match="ALIGNED: dataset not found"):
        run({**w, "aligned": tmp_path / "missing"}, tmp_path / "o")
    with pytest.raises(VlprepError, match="OUT .* is the input"):
        run(w, w["aligned"])
    nosidecar = shutil.copytree(w["unaligned"], tmp_path / "nosidecar")
    (nosidecar / "un-000001.parquet").unlink()
    with pytest.raises(VlprepError, match="UNALIGNED .*: missing sidecar un-000001.parquet"):
        run({**w, "unaligned": nosidecar}, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_nonempty_out_is_never_clobbered(world, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.tar").write_bytes(b"mine")
    with pytest.raises(VlprepError, match="not empty and was not written by vlprep"):
        run(world, out)
    with pytest.raises(VlprepError, match="not empty and was not written by vlprep"):
        run(world, out, overwrite=True)
    assert (out / "notes.tar").read_bytes() == b"mine"


def test_cli_errors_are_one_line_with_exit_2(world, tmp_path, capfd):
    # in-process: the claim is the message and the status main() exits with, not the process boundary
    mismatched = tmp_path / "m.pt"
    tiny_checkpoint(mismatched, embed_dim=8)
    ckpt = torch.load(mismatched, weights_only=True)
    ckpt["model"]["text_proj.weight"] = torch.zeros(4, 32)
    torch.save(ckpt, mismatched)
    for args in ([world["aligned"], world["unaligned"], tmp_path / "o", "--checkpoint", mismatched],
                 [world["aligned"], tmp_path, tmp_path / "o", "--checkpoint", world["ckpt"]]):
        r = cli_in_process(capfd, "pseudolabel", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), \
            r.stderr
    r = cli_in_process(capfd, "pseudolabel", "--help")
    assert r.returncode == 0 and all(o in r.stdout for o in ("--strategy", "--rmtop", "--nprobe", "--crops"))


# --- with a trained checkpoint, through both CLIs ----------------------------------------------


def test_vltrain_checkpoint_pseudolabel_then_train_on_both(world, tmp_path, capfd):
    from typer.testing import CliRunner

    from vltrain.cli import app as vltrain_app

    sets = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
            "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=1"]
    args = ["run", str(world["aligned"]), "--preset", "clip", "--steps", "2", "--batch-size", "8", "--device", "cpu",
            "--out", str(tmp_path / "run"), *[x for s in sets for x in ("--set", s)]]
    res = CliRunner().invoke(vltrain_app, args)
    assert res.exit_code == 0, res.output
    r = cli_in_process(capfd, "pseudolabel", world["aligned"], world["unaligned"], tmp_path / "pseudo", "--checkpoint",
            tmp_path / "run" / "last.pt", "--k", 3, "--crops", 2, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "pseudo-captioned" in r.stdout and (tmp_path / "pseudo" / "pseudo_grid.png").exists()
    args[1:2] = [str(world["aligned"]), str(tmp_path / "pseudo")]
    args[args.index("--out") + 1] = str(tmp_path / "run2")
    res = CliRunner().invoke(vltrain_app, args)
    assert res.exit_code == 0, res.output


@pytest.mark.slow
def test_packaged_encoders_pseudolabel_a_few_images(tmp_path):
    from vltrain.config import Config, to_dict
    from vltrain.config import ModelConfig
    from vltrain.model import build_model

    mc = ModelConfig(fusion_layers=0)
    torch.save({"model": build_model(mc).state_dict(), "config": to_dict(Config(model=mc))}, tmp_path / "c.pt")
    w = {"ckpt": tmp_path / "c.pt",
         "aligned": make_dataset(tmp_path / "al", [f"a {c} {t}" for c in COLOURS for t in THINGS[:2]], 6),
         "unaligned": make_dataset(tmp_path / "un", ["x"] * 3, 3, seed=50)}
    rep = run(w, tmp_path / "o", crops=2)
    assert rep["written"] == 3 and rep["index"]["dim"] == 256
    assert all(set(s["txt"].split()) <= set(COLOURS + THINGS[:2]) for s in iter_samples(tmp_path / "o"))

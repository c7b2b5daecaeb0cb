"""pipelines/mechanisms.py: each metric on data whose answer is known by construction, and whole checks on tiny
models (GRIT, TOnICS and Fistful end to end; SoftMask++'s pointing game through its geometry and hit rule)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import colour_pairs, make_dataset
from tests.vltrain import test_samplers

TINY = test_samplers.TINY
onto = test_samplers.onto  # the module-scoped TOnICS dataset fixture (48 pairs, a hand-made ontology)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "pipelines"))  # mechanisms imports verdicts, beside it
spec = importlib.util.spec_from_file_location("mechanisms", ROOT / "pipelines" / "mechanisms.py")
mech = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mech)


# --- GRIT: hardest in-batch negatives ---------------------------------------------------------------------------


def test_hardest_negative_cosine_of_a_hand_built_batch():
    img = torch.eye(3)  # image k . text j = text j's k-th coordinate
    txt = torch.tensor([[0.6, 0.8, 0.0], [0.0, 0.6, 0.8], [0.28, 0.0, 0.96]])
    # sim = [[.6, 0, .28], [.8, .6, 0], [0, .8, .96]]: image -> other texts 0.28, 0.8, 0.8; text -> other images
    # 0.8, 0.8, 0.28
    assert mech.hardest_negative_cos(img, txt, [[0, 1, 2]]) == pytest.approx(100 * (1.88 / 3 + 1.88 / 3) / 2)
    # batches [0, 1] and [1, 2]: each example's one negative; images -> 0, .8 and 0, .8; texts -> .8, 0 and .8, 0
    assert mech.hardest_negative_cos(img, txt, [[0, 1], [1, 2]]) == pytest.approx(100 * (0.8 + 0 + 0.8 + 0) / 4)


def test_grit_grouping_gathers_a_cluster_into_one_batch_and_random_batches_do_not():
    """16 tight clusters of 4 (image and text alike): GRIT's greedy chains walk a cluster before leaving it, so each
    of its batches of 16 holds 4 whole clusters, while in a random batch of 16 an example has no cluster mate about
    43% of the time (C(60, 15) / C(63, 15)) and its hardest negative is another cluster's."""
    g = torch.Generator().manual_seed(0)
    centres = F.normalize(torch.randn(16, 32, generator=g), dim=1)
    feats = F.normalize(centres.repeat_interleave(4, 0) + 0.02 * torch.randn(64, 32, generator=g), dim=1)
    grouped = mech.grit_batches(feats, feats, 16, 64, 64, seed=0)
    rand = mech.random_batches(64, 16, seed=0)
    assert sorted(np.concatenate(grouped).tolist()) == list(range(64)) and len(rand) == 4
    assert mech.hardest_negative_cos(feats, feats, grouped) > 95
    assert mech.hardest_negative_cos(feats, feats, grouped) > mech.hardest_negative_cos(feats, feats, rand) + 5
    assert [b.tolist() for b in mech.random_batches(64, 16, 0)] == [b.tolist() for b in rand]  # seeded
    assert len(mech.random_batches(70, 16, 1)) == 4  # full batches only


# --- TOnICS: same-object pairs and same-object noun grounding ---------------------------------------------------


def test_same_object_share_counts_pairs_whose_images_share_a_class():
    masks = mech.class_masks([{"cat"}, {"cat", "dog"}, {"dog"}, {"bird"}, {"bird", "dog"}, {"dog"}],
                             ["cat", "dog", "bird"])
    assert masks.tolist() == [1, 3, 2, 4, 6, 2]
    # batch [0, 1, 2, 3]: of 6 pairs, (0, 1) share cat and (1, 2) dog; batch [4, 5]: its one pair shares dog
    assert mech.same_object_share([[0, 1, 2, 3], [4, 5]], masks) == pytest.approx(100 * 3 / 7)
    assert mech.same_object_share([[0, 3]], masks) == 0.0


def test_expected_grounding_is_the_exact_chance_of_beating_k_random_same_class_images():
    scores = torch.tensor([[0.5, 0.9, 0.1, 0.2, 0.0],
                           [0.0, 1.0, 0.0, 0.0, 0.0],
                           [0.3, 0.3, 0.3, 0.3, 0.3],
                           [0.0, 0.0, 0.0, 0.0, 0.0],
                           [0.1, 0.2, 0.3, 0.4, 0.9]])
    own = ["a", "a", "a", "b", "a"]
    image_classes = [{"a"}, {"a"}, {"a"}, {"b"}, {"a", "b"}]
    # query 0: same-class others 1, 2, 4, of which 2 and 4 score below 0.5: C(2, 2) / C(3, 2) = 1/3
    # query 1: 0, 2, 4 all below: 1; query 2: ties count against it: 0; query 3 (class b): only image 4 holds b,
    # fewer than K = 2 candidates, left out; query 4: 0, 1, 2 all below: 1
    acc, n = mech.expected_grounding(scores, own, image_classes, k=2)
    assert n == 4 and acc == pytest.approx(100 * (1 / 3 + 1 + 0 + 1) / 4)
    assert mech.expected_grounding(scores, own, image_classes, k=4) == (pytest.approx(math.nan, nan_ok=True), 0)


# --- SoftMask++: the pointing game -------------------------------------------------------------------------------


def test_cell_centres_follow_the_resize_and_centre_crop_of_the_features():
    square = mech.cell_centres(100, 100, 7, 224)
    assert square.shape == (49, 2) and square[24] == pytest.approx([0.5, 0.5])  # the middle token
    assert square[0] == pytest.approx([16 / 224, 16 / 224]) and square[6] == pytest.approx([208 / 224, 16 / 224])
    # 256 x 512 (portrait): resized to 224 x 448, the crop starts 112 px down; token 0's centre is (16, 128) px
    tall = mech.cell_centres(256, 512, 7, 224)
    assert tall[0] == pytest.approx([16 / 224, 128 / 448]) and tall[48] == pytest.approx([208 / 224, 320 / 448])
    wide = mech.cell_centres(300, 150, 7, 224)  # 448 x 224, the crop starts 112 px in
    assert wide[0] == pytest.approx([128 / 448, 16 / 224])


def test_pointing_hit_scores_the_peak_and_a_flat_map_as_a_random_token():
    centres = mech.cell_centres(100, 100, 7, 224)
    box = [[0.0, 0.0, 0.3, 0.3]]  # holds the centres of the top-left 2 x 2 tokens (16 and 48 px of 224)
    cam = torch.zeros(49)
    cam[8] = 1.0  # row 1, column 1: centre (48, 48) px, inside
    assert mech.pointing_hit(cam, centres, box) == 1.0
    cam = torch.zeros(49)
    cam[24] = 1.0  # the middle: outside
    assert mech.pointing_hit(cam, centres, box) == 0.0
    assert mech.random_hit(centres, box) == pytest.approx(4 / 49)
    assert mech.pointing_hit(torch.full((49,), 0.3), centres, box) == pytest.approx(4 / 49)  # flat: no peak
    assert mech.pointing_hit(cam, centres, box + [[0.4, 0.4, 0.6, 0.6]]) == 1.0  # inside either box of the class


# --- A Fistful of Words: order sensitivity -----------------------------------------------------------------------


def _bag_encoder(position_weight: float):
    """tanh(word embedding + position_weight x position embedding), mean-pooled, normalised (without the tanh a
    mean of added position embeddings would not depend on the order either)."""
    def encode(texts):
        out = []
        for t in texts:
            vecs = []
            for pos, w in enumerate(t.split()):
                g = torch.Generator().manual_seed(sum(map(ord, w)) * 31 + len(w))
                p = torch.Generator().manual_seed(1000 + pos)
                vecs.append(torch.tanh(torch.randn(16, generator=g) + position_weight * torch.randn(16, generator=p)))
            out.append(F.normalize(torch.stack(vecs).mean(0), dim=0))
        return torch.stack(out)

    return encode


def test_shuffle_cosine_is_one_for_a_position_free_bag_of_words_and_less_with_positions():
    captions = ["a red car on the road", "two dogs", "dog", "cat cat", "the big old tree by the river"]
    cos, n = mech.shuffle_cosine(_bag_encoder(0.0), captions, seed=0)
    assert n == 3 and cos == pytest.approx(100.0)  # "dog" and "cat cat" have no other order
    cos_pos, _ = mech.shuffle_cosine(_bag_encoder(1.0), captions, seed=0)
    assert cos_pos < 99
    rng = np.random.default_rng(0)
    for _ in range(20):
        s = mech.shuffled("two dogs", rng)
        assert s == "dogs two"  # the only other order
    assert mech.shuffled("cat cat", rng) is None and mech.shuffled("dog", rng) is None


# --- whole checks on tiny models ---------------------------------------------------------------------------------


def _save_run(run: Path, cfg, model, sampler=None) -> None:
    from vltrain import checkpoint as ckpt_io
    from vltrain.config import to_dict

    run.mkdir(parents=True)
    ckpt_io.save({"model": model.state_dict(), "config": to_dict(cfg), "step": cfg.steps, "sampler": sampler},
                 run / "last.pt")
    (run / "result.json").write_text(json.dumps({"step": cfg.steps}))


def test_grit_tonics_and_fistful_checks_run_on_tiny_runs_and_write_their_table(onto, tmp_path, capsys, monkeypatch):
    from vltrain.config_load import load_config
    from vltrain.model import build_model
    from vltrain.trainset import prepare

    demo = tmp_path / "demo"
    pairs = colour_pairs(tmp_path / "pairs", 40, per_shard=10)
    make_dataset(demo / "eval-feat", [f"a {c} dog and a {t} cat" for c, t in zip("abcdef", "uvwxyz")], 3)
    for seed in (0, 1):
        for recipe, arm, preset, shards, extra in (("grit", "itc", "clip", pairs, {}),
                                                   ("fistful", "bow", "fistful", pairs, {}),
                                                   ("fistful", "intact", "fistful", pairs, {}),
                                                   ("tonics", "tonics", "tonics", onto, {"sampler.kind": "tonics"}),
                                                   ("tonics", "random", "tonics", onto, {"sampler.kind": "random"})):
            sets = TINY + ["sampler.heldout=4", "sampler.refresh_every=2", f"seed={seed}", "model.queue_size=0"]
            cfg = load_config(preset, None, sets, shards=[str(shards)], steps=60, batch_size=4, **extra)
            torch.manual_seed(seed + 10 * (arm == "bow"))
            sampler = None
            if recipe == "tonics":
                sampler = prepare(cfg, torch.device("cpu"))[1].sampler
                for _ in range(10 + seed):
                    sampler.curriculum.refresh()  # as if the held-out check had passed: P(entity) 0.35, 0.31
                sampler = sampler.state_dict()
            _save_run(demo / "ablation" / recipe / arm / f"s{seed}", cfg, build_model(cfg.model), sampler)
    out = tmp_path / "out"
    monkeypatch.setattr(mech, "K_DISTRACTORS", 1)  # the fixture's 8 scored triplets hold 2-3 of each class
    assert mech.main(["--demo", str(demo), "--out", str(out), "--seeds", "0,1,2", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "make ablation RECIPE=softmask" in err and "skipped" in err  # no softmask runs at all
    assert "s{2}; `make ablation RECIPE=grit` makes them" in err  # seed 2 missing: the other seeds still run
    res = json.loads((out / "results.json").read_text())
    assert res["recipe"] == "mechanisms" and res["checks"]["softmask"]["skipped"]
    arms = {(r["arm"], r["seed"]) for r in res["rows"]}
    assert {("grit-grouped", 0), ("grit-random", 1), ("tonics-sampler", 1), ("random", 0), ("bow", 1)} <= arms
    assert [f["metric"] for f in res["findings"]] == ["hardest_negative_cos", "same_object_pairs",
                                                      "same_object_grounding", "shuffle_cos"]
    for f in res["findings"]:
        assert f["n_seeds"] == 2 and f["verdict"] in mech.verdicts.VERDICTS
        assert ("p_zero" in f) != (f["verdict"] == mech.verdicts.NO_VARIANCE)  # no spread: no test (tiny runs tie)
    rows = {(r["arm"], r["seed"]): r for r in res["rows"]}
    # the curriculum moved mass to the object nodes: more same-object pairs than at P(entity) = 1
    assert all(rows["tonics-sampler", s]["same_object_pairs"] > rows["random-sampler", s]["same_object_pairs"]
               for s in (0, 1))
    grit = res["checks"]["grit"]["per_seed"]["1"]
    assert grit["batch_size"] == 4 and grit["M"] == 40 and grit["L"] == 2000  # the run's N and GRIT's defaults
    table = (out / "table.md").read_text()
    assert "| grit | grit-grouped vs grit-random" in table and "softmask" in table

    assert mech.main(["--demo", str(tmp_path / "none"), "--out", str(out), "--checks", "fistful"]) == 2
    assert "error: no check has finished runs" in capsys.readouterr().err
    assert mech.main(["--demo", str(demo), "--checks", "nope"]) == 2

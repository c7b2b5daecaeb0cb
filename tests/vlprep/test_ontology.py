import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from tests.conftest import cli_in_process, detected_dataset
from vlprep import VlprepError
from vlprep.dataset import iter_samples
from vlprep.ontology import OntologyConfig, default_min_instances, make_triplets, map_nouns, ontology, pmi_table


def test_pmi_against_a_hand_worked_example():
    pairs = [({"dog", "grass"}, {"dog"}), ({"dog"}, {"dog", "person"}), ({"man"}, {"person"}),
             ({"dog", "man"}, set())]  # no detection: not counted, N = 3
    t = pmi_table(pairs)
    counts = {(n, o): c for n, o, c, _ in t.itertuples(index=False)}
    pmi = {(n, o): p for n, o, _, p in t.itertuples(index=False)}
    # p(dog)=2/3, p(grass)=1/3, p(man)=1/3; p(o=dog)=2/3, p(person)=2/3
    assert counts == {("dog", "dog"): 2, ("grass", "dog"): 1, ("dog", "person"): 1, ("man", "person"): 1}
    assert pmi == pytest.approx({
        ("dog", "dog"): math.log((2 / 3) / (2 / 3 * 2 / 3)),
        ("grass", "dog"): math.log((1 / 3) / (1 / 3 * 2 / 3)),
        ("dog", "person"): math.log((1 / 3) / (2 / 3 * 2 / 3)),
        ("man", "person"): math.log((1 / 3) / (1 / 3 * 2 / 3)),
    })
    assert t.attrs["pairs"] == 3 and list(t.columns) == ["noun", "label", "count", "pmi"]


def test_mapping_tie_rules_min_cooccur_and_overrides():
    t = pd.DataFrame([
        ("puppy", "dog", 5, 1.0), ("puppy", "cat", 9, 0.5),       # highest PMI wins over count
        ("pet", "dog", 5, 0.7), ("pet", "cat", 8, 0.7),           # PMI tie -> larger count
        ("animal", "dog", 6, 0.3), ("animal", "cat", 6, 0.3),     # PMI and count tie -> smaller label
        ("rare", "bird", 2, 3.0), ("rare", "cat", 5, 0.1),        # the best PMI is below min_cooccur
        ("thing", "bird", 1, 2.0),                                # no candidate at all
    ], columns=["noun", "label", "count", "pmi"])
    assert map_nouns(t, min_cooccur=5) == {"animal": "cat", "pet": "cat", "puppy": "dog", "rare": "cat"}
    assert map_nouns(t, min_cooccur=1)["rare"] == "bird" and map_nouns(t, min_cooccur=1)["thing"] == "bird"
    assert map_nouns(t, 5, {"puppy": "cat", "pet": None, "kitten": "cat"}) == {
        "animal": "cat", "kitten": "cat", "puppy": "cat", "rare": "cat"}


def test_triplets_one_per_distinct_mapped_noun_all_or_with_a_detected_class():
    nouns = [("dog", 2, 6), ("frisbee", 20, 28), ("dog", 40, 44), ("park", 50, 54), ("sky", 60, 63)]
    mapping = {"dog": "dog", "frisbee": "frisbee", "park": "bench"}
    # all (appendix A.1): every distinct set noun, first span, whatever the detector found; sky is in no set
    assert make_triplets(nouns, mapping) == [("dog", 2, 6, "dog"), ("frisbee", 20, 28, "frisbee"),
                                             ("park", 50, 54, "bench")]
    assert make_triplets(nouns, mapping, {"dog", "frisbee"}) == [("dog", 2, 6, "dog"), ("frisbee", 20, 28, "frisbee")]
    assert make_triplets(nouns, mapping, set()) == []
    assert default_min_instances(10) == 5 and default_min_instances(5_800_000) == 5000
    assert default_min_instances(11_600_000) == 10000


# --- the stages, with detections imported from a file ------------------------------------------

CAPTIONS = ["A dog runs on the grass.", "Two dogs and a man in a park.", "A man with a hat.", "The cat sleeps.",
            "A dog and a cat.", "A red car."]
OBJECTS = [["dog"], ["dog", "person"], ["person"], ["cat"], ["dog", "cat"], []]


@pytest.fixture
def detected(tmp_path) -> Path:
    det = detected_dataset(tmp_path, CAPTIONS, OBJECTS)
    assert sum(len(s["json"]["objects"]) for s in iter_samples(det)) == 7  # the 0.1-score tv is below --min-score
    return det


@pytest.mark.slow  # loads the packaged spaCy model
def test_ontology_end_to_end(detected, tmp_path):
    rep = ontology(OntologyConfig(src=detected, out=tmp_path / "onto", min_cooccur=1, min_instances=2))
    onto = json.loads((tmp_path / "onto" / "ontology.json").read_text())
    # nouns: dog(0,1,4) grass(0) man(1,2) park(1) hat(2) cat(3,4) car(5); pairs with objects: 0..4
    assert onto["noun_to_class"]["dog"] == "dog" and onto["noun_to_class"]["cat"] == "cat"
    assert onto["noun_to_class"]["man"] == "person"
    # each mapped noun's PMI with its class, by hand: log(c(n, o) N / (c(n) c(o))) over the N = 5 pairs with objects
    assert onto["noun_pmi"]["dog"] == pytest.approx(math.log(3 * 5 / (3 * 3)), rel=1e-12)  # pairs 0, 1, 4
    assert onto["noun_pmi"]["man"] == pytest.approx(math.log(2 * 5 / (2 * 2)), rel=1e-12)  # pairs 1, 2
    assert onto["noun_pmi"]["cat"] == pytest.approx(math.log(2 * 5 / (2 * 2)), rel=1e-12)  # pairs 3, 4
    assert set(onto["noun_pmi"]) == set(onto["noun_to_class"])
    assert onto["root"] == {"name": "entity", "instances": 6}
    trip = pq.read_table(tmp_path / "onto" / "triplets.parquet").to_pylist()
    dog = [t for t in trip if t["class"] == "dog" and t["noun"] == "dog"]
    assert [(t["index"], t["key"]) for t in dog] == [(0, "shard_000000000"), (1, "shard_000000001"),
                                                     (4, "shard_000000004")]
    for t in trip:  # the span points at the noun in the caption
        assert CAPTIONS[t["index"]][t["start"]:t["end"]].lower().startswith(t["noun"][:3])
    nodes = {n["class"]: n for n in onto["nodes"]}
    assert nodes["dog"]["instances"] == sum(t["class"] == "dog" for t in trip) >= 3
    assert all(n["instances"] >= 2 for n in onto["nodes"])
    samples = list(iter_samples(tmp_path / "onto"))
    assert samples[4]["json"]["nodes"] == ["cat", "dog"] and samples[5]["json"]["nodes"] == []
    assert ["car", 6, 9] in samples[5]["json"]["nouns"]
    assert rep["coverage"] == round(sum(bool(s["json"]["nodes"]) for s in samples) / 6, 4)
    assert Path(rep["plots"][0]).exists()
    # a class under --min-instances is dropped, with its nouns and triplets
    rep = ontology(OntologyConfig(src=detected, out=tmp_path / "onto3", min_cooccur=1, min_instances=3))
    onto3 = json.loads((tmp_path / "onto3" / "ontology.json").read_text())
    assert all(n["instances"] >= 3 for n in onto3["nodes"]) and rep["dropped_classes"]
    assert set(onto3["noun_to_class"].values()) == {n["class"] for n in onto3["nodes"]}


def test_ontology_input_errors(detected, tmp_path):
    with pytest.raises(VlprepError, match="no detections .* run `vlprep detect` first"):
        ontology(OntologyConfig(src=tmp_path / "raw", out=tmp_path / "o"))
    (tmp_path / "ov.yaml").write_text("dog: unicorn\n")
    with pytest.raises(VlprepError, match="'unicorn' is not a detected class; classes are: cat, dog, person"):
        ontology(OntologyConfig(src=detected, out=tmp_path / "o", overrides=tmp_path / "ov.yaml"))
    (tmp_path / "ov.yaml").write_text("- a list\n")
    with pytest.raises(VlprepError, match="expected a mapping"):
        ontology(OntologyConfig(src=detected, out=tmp_path / "o", overrides=tmp_path / "ov.yaml"))


RULE_CAPTIONS = ["A dog.", "A dog.", "A dog and a cat.", "The cat.", "A cat and a dog.", "A man with a dog.", "A tree."]
RULE_OBJECTS = [["dog"], [], ["cat"], ["cat"], ["dog", "cat"], ["person"], []]
# Hand-worked, min_cooccur 1. Pairs with objects: 0, 2, 3, 4, 5 (N = 5). dog: PMI(dog, dog) = log(2*5/(4*2)) ties
# PMI(dog, person) = log(1*5/(4*1)); the larger count (2) gives dog -> dog. cat -> cat (log(15/9)), man -> person
# (log 5); tree is in no pair with objects. Triplets (index, noun, class, class detected in the image):
RULE_TRIPLETS = {(0, "dog", "dog", True), (1, "dog", "dog", False), (2, "dog", "dog", False), (2, "cat", "cat", True),
                 (3, "cat", "cat", True), (4, "cat", "cat", True), (4, "dog", "dog", True),
                 (5, "man", "person", True), (5, "dog", "dog", False)}


@pytest.mark.slow  # loads the packaged spaCy model
def test_triplet_rules_all_and_detected_against_a_hand_count(tmp_path):
    det = detected_dataset(tmp_path, RULE_CAPTIONS, RULE_OBJECTS)
    rows = lambda d: {(t["index"], t["noun"], t["class"], t["detected"])  # noqa: E731
                      for t in pq.read_table(d / "triplets.parquet").to_pylist()}
    # all (default): 9 triplets found, 6 of them with a detected class; person (1 < 2) is dropped
    rep = ontology(OntologyConfig(src=det, out=tmp_path / "all", min_cooccur=1, min_instances=2))
    assert rep["triplet_rule"] == "all" and rep["triplet_counts"] == {
        "rule": "all", "found": {"all": 9, "detected": 6}, "kept": {"all": 8, "detected": 5}}
    assert rows(tmp_path / "all") == {t for t in RULE_TRIPLETS if t[2] != "person"} and rep["triplets"] == 8
    onto = json.loads((tmp_path / "all" / "ontology.json").read_text())
    assert [(n["class"], n["instances"], n["instances_detected"]) for n in onto["nodes"]] == [("dog", 5, 2),
                                                                                             ("cat", 3, 3)]
    assert onto["params"]["triplet_rule"] == "all"
    nodes = {s["__key__"]: s["json"]["nodes"] for s in iter_samples(tmp_path / "all")}
    assert nodes["shard_000000001"] == ["dog"] and nodes["shard_000000006"] == []  # no detection, still a triplet
    assert rep["coverage"] == round(6 / 7, 4)
    # detected: only the 6 with a detected class; the same 'found' counts, dog (2) and cat (3) kept
    rep = ontology(OntologyConfig(src=det, out=tmp_path / "odet", min_cooccur=1, min_instances=2, triplets="detected"))
    assert rep["triplet_counts"] == {"rule": "detected", "found": {"all": 9, "detected": 6},
                                     "kept": {"all": 8, "detected": 5}}
    assert rows(tmp_path / "odet") == {t for t in RULE_TRIPLETS if t[3] and t[2] != "person"}
    assert rep["coverage"] == round(4 / 7, 4)  # pairs 0, 2, 3, 4
    # the rule changes which classes pass --min-instances: at 3, dog has 5 triplets under all, 2 under detected
    a = ontology(OntologyConfig(src=det, out=tmp_path / "a3", min_cooccur=1, min_instances=3))
    d = ontology(OntologyConfig(src=det, out=tmp_path / "d3", min_cooccur=1, min_instances=3, triplets="detected"))
    assert [n["class"] for n in a["nodes"]] == ["dog", "cat"] and [n["class"] for n in d["nodes"]] == ["cat"]
    assert d["triplet_counts"]["kept"] == {"all": 3, "detected": 3} and d["dropped_classes"] == {"dog": 2, "person": 1}
    # the triplet index stays what vltrain's TOnICS sampler reads: both rules load, triplet and sample mode
    from vltrain.samplers import tonics_instances

    keys = [f"shard_{i:09d}" for i in range(7)]
    inst = tonics_instances(tmp_path / "all", keys, np.zeros(7, dtype=bool), triplets=True)["train"]
    assert [(c, len(p)) for c, p in inst["nodes"]] == [("dog", 5), ("cat", 3)] and len(inst["samples"]) == 8
    inst = tonics_instances(tmp_path / "odet", keys, np.zeros(7, dtype=bool), triplets=False)["train"]
    assert [(c, sorted(p.tolist())) for c, p in inst["nodes"]] == [("cat", [2, 3, 4]), ("dog", [0, 4])]


def test_bad_triplet_rule_is_a_one_line_error(detected, tmp_path):
    with pytest.raises(VlprepError, match=r"^unknown --triplets 'some'; use all or detected$"):
        ontology(OntologyConfig(src=detected, out=tmp_path / "o", triplets="some"))
    assert not (tmp_path / "o").exists()


def test_cooccur_threshold_is_the_ceiling_of_the_rate_as_written():
    from vlprep.ontology import cooccur_threshold

    # independent: a rate of k / 10**d in decimal needs ceil(k * pairs / 10**d), in integers
    for digits, pairs in (("0.1", 30), ("0.1", 31), ("0.0005", 10_000), ("0.0005", 1_000_000), ("0.0005", 3_300_001),
                          ("0.000001", 3_300_000), ("0.3", 10), ("0.07", 100), ("0", 5)):
        k = int(digits.replace(".", ""))
        d = len(digits.split(".")[1]) if "." in digits else 0
        assert cooccur_threshold(1, float(digits), pairs) == max(1, -(-k * pairs // 10**d)), (digits, pairs)
    assert math.ceil(0.07 * 100) == 8 and cooccur_threshold(1, 0.07, 100) == 7  # the float product would round up
    assert cooccur_threshold(5, 0.0005, 10_000) == 5 and cooccur_threshold(5, 0.0005, 1_000_000) == 500
    assert cooccur_threshold(5, 0.0, 10**9) == 5 and cooccur_threshold(5, np.float64(0.5), 3) == 5


@pytest.mark.parametrize("rate", [-0.1, 1.0, float("nan"), float("inf")])
def test_bad_cooccur_rate_is_a_one_line_error(detected, tmp_path, rate):
    with pytest.raises(VlprepError, match=r"^--min-cooccur-rate must be at least 0 and below 1$"):
        ontology(OntologyConfig(src=detected, out=tmp_path / "o", min_cooccur_rate=rate))
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # loads the packaged spaCy model
def test_cooccur_rate_raises_the_count_by_the_pairs_with_objects(detected, tmp_path):
    # 5 pairs with objects: a rate of 0.5 asks ceil(2.5) = 3 co-occurrences, the same ontology as --min-cooccur 3
    by_rate = ontology(OntologyConfig(src=detected, out=tmp_path / "r", min_cooccur=1, min_cooccur_rate=0.5,
                                      min_instances=1))
    by_count = ontology(OntologyConfig(src=detected, out=tmp_path / "c", min_cooccur=3, min_instances=1))
    assert by_rate["pairs_with_objects"] == 5
    onto = {d: json.loads((tmp_path / d / "ontology.json").read_text()) for d in ("r", "c")}
    assert onto["r"] == onto["c"] and onto["r"]["params"]["min_cooccur"] == 3
    assert onto["r"]["noun_to_class"] == {"dog": "dog"}  # dog: pairs 0, 1, 4; cat (3, 4) and man (1, 2) are under 3
    assert (tmp_path / "r" / "triplets.parquet").read_bytes() == (tmp_path / "c" / "triplets.parquet").read_bytes()
    assert by_rate["candidate_pairs"] == by_count["candidate_pairs"]
    meta = {d: json.loads((tmp_path / d / "meta.json").read_text())["options"] for d in ("r", "c")}
    assert meta["r"]["min_cooccur_rate"] == 0.5 and "min_cooccur_rate" not in meta["c"]  # the default is not recorded
    # a rate under what --min-cooccur asks changes nothing
    low = ontology(OntologyConfig(src=detected, out=tmp_path / "low", min_cooccur=3, min_cooccur_rate=0.1,
                                  min_instances=1))
    assert json.loads((tmp_path / "low" / "ontology.json").read_text()) == onto["c"]
    assert low["mapped_nouns"] == by_count["mapped_nouns"]


def test_the_cli_refuses_a_bad_cooccur_rate_in_one_line(detected, tmp_path, capfd):
    """`vlprep ontology` as its main() in this process (cli_in_process): the exit status and the one line are a
    child's, without a fresh interpreter's imports."""
    r = cli_in_process(capfd, "ontology", detected, tmp_path / "o", "--min-cooccur-rate", "2")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == ["error: --min-cooccur-rate must be at least 0 and below 1"], lines
    assert not (tmp_path / "o").exists()

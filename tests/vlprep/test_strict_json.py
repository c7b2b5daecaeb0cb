"""JSON in and out of vlprep: detections that are no numbers or no boxes are bad rows, vlprep writes strict JSON only
(never NaN or Infinity), and a sample whose json member is not a strict JSON object (malformed, NaN, nested 100,000
deep) is a counted, reported bad sample in every stage that reads it, never a RecursionError traceback."""

import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import detected_dataset, image_bytes, make_dataset, replace_member, world  # noqa: F401
from vlprep import VlprepError
from vlprep.dataset import BadJson, decode_json, iter_samples
from vlprep.detect import DetectConfig, detect
from vlprep.shards import ShardsConfig, build_shards

DEEP = b"[" * 100_000 + b"]" * 100_000
BAD = {"shard_000000001": b'{"a": ' + DEEP + b"}", "shard_000000002": b"{oops",
       "shard_000000004": b'{"score": NaN}', "shard_000000005": b'{"score": 1e400}'}


def strict(data: bytes):
    """json.loads as a strict parser reads: NaN and the infinities are no JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(data, parse_constant=refuse)


def member_jsons(folder: Path) -> dict[str, object]:
    """Every json member of a dataset, parsed strictly."""
    return {raw["__key__"]: strict(raw["json"]) for raw in iter_samples(folder, decode=False) if "json" in raw}


# --- 9. detections: finite numbers, boxes the right way round -------------------------------------------------------


@pytest.fixture
def raw(tmp_path) -> Path:
    (tmp_path / "img").mkdir()
    for i in range(2):
        (tmp_path / "img" / f"{i}.png").write_bytes(image_bytes(8, 8, seed=i))
        (tmp_path / "img" / f"{i}.txt").write_text("x")
    build_shards(ShardsConfig(src=tmp_path / "img", out=tmp_path / "raw", workers=1))
    return tmp_path / "raw"


def objects_line(score: str = "0.9", box: str = "[0.1, 0.1, 0.5, 0.5]") -> str:
    """A detections line for shard_000000001 with one object, its score and box written as given."""
    return f'{{"key": "shard_000000001", "objects": [{{"label": "dog", "score": {score}, "box": {box}}}]}}'


@pytest.mark.parametrize("obj, says", [
    (dict(score="1e400"), "score a finite number"),          # was stored as Infinity
    (dict(score="NaN"), "score a finite number"),
    (dict(score="-Infinity"), "score a finite number"),
    (dict(score="1" + "0" * 400), "score a finite number"),  # an integer no float holds: was an OverflowError
    (dict(score="true"), "score a finite number"),           # was stored as 1.0
    (dict(box="[0.9, 0.9, 0.1, 0.1]"), "inverted"),           # was accepted
    (dict(box="[0.1, 0.9, 0.5, 0.2]"), "inverted"),
    (dict(box="[0.9, 0.1, 0.2, 0.5]"), "inverted"),
])
def test_non_finite_scores_and_inverted_boxes_are_bad_rows_naming_the_line(raw, tmp_path, obj, says):
    (tmp_path / "dets.jsonl").write_text('{"key": "shard_000000000", "objects": []}\n' + objects_line(**obj) + "\n")
    with pytest.raises(VlprepError) as e:
        detect(DetectConfig(src=raw, out=tmp_path / "o", from_file=tmp_path / "dets.jsonl"))
    assert str(e.value).startswith("dets.jsonl:2: object 0:") and says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_a_zero_area_box_and_a_good_row_are_kept_as_strict_json(raw, tmp_path):
    (tmp_path / "dets.jsonl").write_text(objects_line(box="[0.5, 0.2, 0.5, 0.2]") + "\n")
    detect(DetectConfig(src=raw, out=tmp_path / "o", from_file=tmp_path / "dets.jsonl"))
    found = member_jsons(tmp_path / "o")
    assert found["shard_000000001"]["objects"] == [{"label": "dog", "score": 0.9, "box": [0.5, 0.2, 0.5, 0.2]}]


def test_vlprep_writes_no_nan_or_infinity():
    """The sample writer and the summary files refuse a non-finite number rather than write `NaN`, which strict JSON
    parsers refuse."""
    from vlprep.output import write_json_atomic
    from vlprep.tario import encode_sample

    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="JSON compliant"):
            encode_sample({"__key__": "k", "json": {"score": bad}})
        with pytest.raises(ValueError, match="JSON compliant"):
            write_json_atomic(Path("/nonexistent-dir/never-written.json"), {"x": bad})


def test_filter_max_aspect_infinity_is_refused(raw, tmp_path):
    """Before: accepted, and meta.json recorded `"max_aspect": Infinity`."""
    from vlprep.filter import FilterConfig, filter_dataset

    with pytest.raises(VlprepError, match="--max-aspect"):
        filter_dataset(FilterConfig(src=raw, out=tmp_path / "o", max_aspect=math.inf, workers=1))
    assert not (tmp_path / "o").exists()


# --- 10. a sample json that is no strict JSON object ------------------------------------------------------------------


@pytest.mark.parametrize("data, why", [(DEEP, "nested too deeply"), (b'{"a": ' + b"[" * 70 + b"]" * 70 + b"}",
                                                                     "nested more than"),
                                       (b"{oops", "malformed"), (b'{"x": NaN}', "NaN"), (b'{"x": 1e400}', "1e400"),
                                       (b"[1, 2]", "not a JSON object"), (b"\xff{}", "malformed")])
def test_decode_json_refuses_what_is_no_strict_json_object_in_one_line(data, why):
    with pytest.raises(BadJson) as e:
        decode_json(data)
    assert why in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, VlprepError) and isinstance(e.value, ValueError)
    assert decode_json(b'{"a": [[{"b": 1.5}]]}') == {"a": [[{"b": 1.5}]]}


def bad_dataset(tmp: Path) -> Path:
    """8 samples in 2 shards, 4 of them with a json member that is no strict JSON object (BAD)."""
    ds = make_dataset(tmp / "ds", [f"a red dog number {i}" for i in range(8)], 4)
    for key, data in BAD.items():
        replace_member(ds, f"{key}.json", data)
    return ds


def test_bow_counts_and_leaves_out_samples_with_bad_json(tmp_path):
    """Before: RecursionError (and JSONDecodeError for the malformed one) from the bow worker, a traceback."""
    from vlprep.bow import BowConfig, bow

    ds = bad_dataset(tmp_path)
    rep = bow(BowConfig(src=ds, out=tmp_path / "b", ops="shuffle", workers=1))
    assert rep["bad_json"] == 4 and rep["written"] == 4
    assert any("json member is not strict JSON" in w and "4" in w for w in rep["warnings"])
    assert set(member_jsons(tmp_path / "b")) == {f"shard_00000000{i}" for i in (0, 3, 6, 7)}
    assert sum(pq.read_metadata(p).num_rows for p in (tmp_path / "b").glob("*.parquet")) == 4


def test_detect_counts_and_leaves_out_samples_with_bad_json(tmp_path):
    ds = bad_dataset(tmp_path)
    keys = [f"shard_{i:09d}" for i in range(8)]
    (tmp_path / "dets.jsonl").write_text("".join(json.dumps({"key": k, "objects": []}) + "\n" for k in keys))
    rep = detect(DetectConfig(src=ds, out=tmp_path / "o", from_file=tmp_path / "dets.jsonl"))
    assert rep["bad_json"] == 4 and rep["samples"] == 4 and any("not strict JSON" in w for w in rep["warnings"])
    assert set(member_jsons(tmp_path / "o")) == {f"shard_00000000{i}" for i in (0, 3, 6, 7)}


def test_ontology_counts_samples_with_bad_json_and_writes_strict_json(tmp_path):
    from vlprep.ontology import OntologyConfig, ontology

    det = detected_dataset(tmp_path, [f"a dog on a boat number {i}" for i in range(8)], [["dog", "boat"]] * 8)
    for key, data in BAD.items():
        replace_member(det, f"{key}.json", data)
    rep = ontology(OntologyConfig(src=det, out=tmp_path / "onto", min_instances=1, min_cooccur=1))
    assert rep["bad_json"] == 4 and any("not strict JSON" in w for w in rep["warnings"])
    found = member_jsons(tmp_path / "onto")
    assert len(found) == 8 and all("nouns" in found[k] and "uid" not in found[k] for k in BAD)


def test_pseudolabel_counts_samples_with_bad_json(world, tmp_path):  # noqa: F811
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel
    from vltrain.checkpoint_encoder import CheckpointEncoder

    un = tmp_path / "un"
    shutil.copytree(world["unaligned"], un)
    replace_member(un, "un_000000001.json", DEEP)
    replace_member(un, "un_000000006.json", b'{"uid": Infinity}')
    rep = pseudolabel(PseudolabelConfig(aligned=world["aligned"], unaligned=un, out=tmp_path / "p", k=3, crops=2,
                                        batch_size=4, device="cpu"), CheckpointEncoder(world["ckpt"], "cpu"))
    assert rep["skipped"].get("bad_json") == 2 and rep["skipped_examples"]["bad_json"] == ["un_000000001",
                                                                                          "un_000000006"]
    assert "un_000000001" not in member_jsons(tmp_path / "p")


def test_stats_reading_the_tars_treats_bad_json_as_no_metadata(tmp_path):
    """A dataset whose sidecars lack the caption and size columns is read from its tars: a bad json there is no
    traceback."""
    from vlprep.stats import dataset_stats

    ds = bad_dataset(tmp_path)
    for side in ds.glob("*.parquet"):
        pq.write_table(pa.table({"key": pq.read_table(side).column("key")}), side)
    rep = dataset_stats(ds, out=tmp_path / "s")
    assert rep["samples"] == 8 and rep["caption_words"]["count"] == 8

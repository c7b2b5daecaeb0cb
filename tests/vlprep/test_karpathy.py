"""`vlprep shards` on Karpathy split files (COCO / Flickr30k): one sample per image with all its captions, and what
the later stages do with them (docs/FORMAT.md, "Multi-caption samples")."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import cli_in_process, image_bytes
from vlprep import VlprepError
from vlprep.dataset import iter_samples, open_dataset, read_sidecars
from vlprep.shards import SIDECAR_SCHEMA, ShardsConfig, build_shards, fingerprint
from vlprep.sources import Item

# (split, captions) per image of the COCO-style file; image 5's file is missing, image 7's captions are all blank
COCO = [
    ("test", ["A man with a red helmet on a small moped.", "Man riding a motor bike on a dirt road.",
              "A man in a red shirt  rides\ta moped.", "A person on a scooter.", "Helmet, moped, road."]),
    ("train", ["Two dogs play in the snow."]),
    ("restval", ["A kitchen with a stove.", "   ", "An oven in a small kitchen."]),
    ("val", ["A bowl of fruit on a table.", "Apples and bananas in a bowl."]),
    ("test", ["Ein Café in München, 東京の猫 🐱", "A café with a cat."]),
    ("test", ["This image file is missing.", "Still missing."]),
    ("restval", ["A red kite in a blue sky.", "Kite flying over the beach."]),
    ("train", ["", " \n "]),
]
MISSING, BLANK = 5, 7


def cleaned(captions: list[str]) -> list[str]:
    return [" ".join(c.split()) for c in captions if c.strip()]


def write_coco(root: Path, images_at: Path | None = None) -> Path:
    """dataset_coco.json in `root`, images under (images_at or root)/{val2014,train2014}/ (filepath + filename)."""
    images_at = images_at or root
    entries = []
    for i, (split, caps) in enumerate(COCO):
        folder = "train2014" if split == "train" else "val2014"
        name = f"COCO_{folder}_{i:012d}.jpg"
        if i != MISSING:
            (images_at / folder).mkdir(parents=True, exist_ok=True)
            (images_at / folder / name).write_bytes(image_bytes(24 + i, 20 + i, "JPEG", seed=i))
        entries.append({"filepath": folder, "filename": name, "imgid": i, "split": split, "cocoid": 391895 + i,
                        "sentids": list(range(5 * i, 5 * i + len(caps))),
                        "sentences": [{"tokens": c.lower().split(), "raw": c, "imgid": i, "sentid": 5 * i + j}
                                      for j, c in enumerate(caps)]})
    root.mkdir(parents=True, exist_ok=True)
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"images": entries, "dataset": "coco"}))  # one line, \u escapes, as the real file
    return path


def write_flickr(root: Path) -> Path:
    """dataset_flickr30k.json: filename only (no filepath), imgid, no cocoid; the last entry has neither id."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(5):
        name = f"{1000092795 + i}.jpg"
        (root / name).write_bytes(image_bytes(30, 22, "JPEG", seed=100 + i))
        entry = {"filename": name, "imgid": i, "split": ["train", "val", "test", "test", "train"][i],
                 "sentences": [{"raw": f"Flickr image {i}, caption {j}.", "imgid": i} for j in range(1 + i % 3)]}
        if i == 4:
            del entry["imgid"]
        entries.append(entry)
    path = root / "dataset_flickr30k.json"
    path.write_text(json.dumps({"images": entries, "dataset": "flickr30k"}, indent=1))  # pretty-printed works too
    return path


def build(src, out, **kw) -> dict:
    kw.setdefault("workers", 1)
    return build_shards(ShardsConfig(src=Path(src), out=Path(out), **kw))


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != "report.json"}


@pytest.fixture
def coco(tmp_path) -> Path:
    return write_coco(tmp_path / "coco")


@pytest.fixture
def coco_ds(coco, tmp_path) -> Path:
    build(coco, tmp_path / "raw", samples_per_shard=3)
    return tmp_path / "raw"


# --- shards ------------------------------------------------------------------------------------


def test_one_sample_per_image_with_every_caption(coco, tmp_path):
    rep = build(coco, tmp_path / "out", samples_per_shard=3)
    assert rep["source_kind"] == "karpathy" and rep["samples_in"] == 8 and rep["written"] == 6
    assert rep["skipped"] == {"missing_image": 1, "empty_caption": 1}
    assert rep["skipped_examples"] == {"missing_image": [str(391895 + MISSING)], "empty_caption": [str(391895 + BLANK)]}
    got = list(iter_samples(tmp_path / "out"))
    kept = [i for i in range(8) if i not in (MISSING, BLANK)]
    assert [s["__key__"] for s in got] == [f"shard_{i:09d}" for i in kept]  # keys: positions in the file
    for i, s in zip(kept, got):
        split, caps = COCO[i]
        assert s["json"]["captions"] == cleaned(caps) and s["txt"] == cleaned(caps)[0]
        assert {k: s["json"][k] for k in ("uid", "cocoid", "imgid", "split", "source")} == \
            {"uid": str(391895 + i), "cocoid": 391895 + i, "imgid": i, "split": split, "source": "dataset_coco.json"}
        folder = "train2014" if split == "train" else "val2014"
        assert s["jpg"] == (coco.parent / folder / f"COCO_{folder}_{i:012d}.jpg").read_bytes()  # filepath/filename
    # a blank caption is left out of the list (image 2), and the first caption's whitespace collapsed (image 0)
    assert got[2]["json"]["captions"] == ["A kitchen with a stove.", "An oven in a small kitchen."]
    assert got[0]["json"]["captions"][2] == "A man in a red shirt rides a moped."
    side = read_sidecars(open_dataset(tmp_path / "out"))
    assert side.column_names == SIDECAR_SCHEMA.names + ["captions"]
    assert pa.types.is_list(side.schema.field("captions").type)
    assert side.column("captions").to_pylist() == [s["json"]["captions"] for s in got]
    assert side.column("caption").to_pylist() == [s["txt"] for s in got]


def test_non_ascii_captions_round_trip_as_utf8(coco_ds):
    raw = {s["__key__"]: s for s in iter_samples(coco_ds, decode=False)}["shard_000000004"]
    text = raw["json"].decode("utf-8")
    assert "東京の猫 🐱" in text and "\\u" not in text  # stored as UTF-8, not as escapes
    assert json.loads(text)["captions"] == ["Ein Café in München, 東京の猫 🐱", "A café with a cat."]
    assert raw["txt"].decode("utf-8") == "Ein Café in München, 東京の猫 🐱"
    row = pq.read_table(coco_ds / "shard-000001.parquet").to_pylist()[1]
    assert row["key"] == "shard_000000004" and row["captions"][0] == "Ein Café in München, 東京の猫 🐱"


@pytest.mark.parametrize("split,want", [
    (["test"], [0, 4]),
    (["test", "restval"], [0, 2, 4, 6]),
    (["restval,test"], [0, 2, 4, 6]),           # comma-separated, any order: file order is kept
    (["restval"], [2, 6]),
    (None, [0, 1, 2, 3, 4, 6]),
    (["train", "restval", "val", "test"], [0, 1, 2, 3, 4, 6]),
])
def test_splits_select_entries_in_file_order(coco, tmp_path, split, want):
    rep = build(coco, tmp_path / "out", split=split)
    got = list(iter_samples(tmp_path / "out"))
    assert [s["json"]["imgid"] for s in got] == want
    chosen = None if split is None else set(",".join(split).split(","))
    selected = [i for i, (s, _) in enumerate(COCO) if chosen is None or s in chosen]
    assert rep["samples_in"] == len(selected)
    # keys are positions in the selected order, skips included
    assert [s["__key__"] for s in got] == [f"shard_{selected.index(i):09d}" for i in want]
    options = json.loads((tmp_path / "out" / "meta.json").read_text())["options"]
    assert options.get("split") == (None if split is None else  # recorded in one order, whatever the order given
                                    [s for s in ("train", "restval", "val", "test") if s in chosen])


def test_flickr_filename_only_and_image_root(tmp_path):
    path = write_flickr(tmp_path / "flickr")
    build(path, tmp_path / "out")  # images next to the JSON file (the default root)
    got = list(iter_samples(tmp_path / "out"))
    assert [s["json"]["uid"] for s in got] == ["0", "1", "2", "3", "1000092799.jpg"]  # imgid, else the file name
    assert all("cocoid" not in s["json"] for s in got) and "imgid" not in got[4]["json"]
    assert got[2]["json"]["captions"] == ["Flickr image 2, caption 0.", "Flickr image 2, caption 1.",
                                          "Flickr image 2, caption 2."]
    assert got[1]["jpg"] == (tmp_path / "flickr" / "1000092796.jpg").read_bytes()
    # the JSON file elsewhere, the images under --image-root
    (tmp_path / "ann").mkdir()
    moved = tmp_path / "ann" / path.name
    path.rename(moved)
    assert build(moved, tmp_path / "o2", split=["test"])["skipped"] == {"missing_image": 2}
    rep = build(moved, tmp_path / "o3", split=["test"], image_root=tmp_path / "flickr")
    assert rep["written"] == 2 and rep["skipped"] == {}
    meta = json.loads((tmp_path / "o3" / "meta.json").read_text())
    assert meta["options"]["image_root"] == str((tmp_path / "flickr").resolve()) and meta["source_kind"] == "karpathy"


def test_coco_image_root_joins_filepath_and_filename(tmp_path):
    path = write_coco(tmp_path / "annotations", images_at=tmp_path / "images")
    rep = build(path, tmp_path / "out", image_root=tmp_path / "images")
    assert (rep["written"], rep["skipped"]) == (6, {"missing_image": 1, "empty_caption": 1})
    with pytest.raises(VlprepError, match=r"^--image-root .*nope: not a folder$"):
        build(path, tmp_path / "o2", image_root=tmp_path / "nope")


def test_another_split_into_the_same_out_is_other_options(coco, tmp_path):
    build(coco, tmp_path / "out", split=["test"])
    with pytest.raises(VlprepError, match="written with other options"):
        build(coco, tmp_path / "out", split=["val"])
    assert build(coco, tmp_path / "out", split=["test"])["shards_resumed"] == 1  # the same split resumes
    assert build(coco, tmp_path / "out", split=["val"], overwrite=True)["written"] == 1


def test_bad_split_and_karpathy_options_on_other_sources(coco, tmp_path, image_folder):
    with pytest.raises(VlprepError, match=r"^unknown --split 'tst'; splits are: train, restval, val, test$"):
        build(coco, tmp_path / "out", split=["test,tst"])
    with pytest.raises(VlprepError, match=r"^--split applies only to a Karpathy split file .*not to imgs$"):
        build(image_folder, tmp_path / "out", split=["test"])
    (tmp_path / "t.jsonl").write_text('{"image": "a.png", "caption": "x"}\n')
    with pytest.raises(VlprepError, match=r"^--image-root and --split apply only to a Karpathy split file"):
        build(tmp_path / "t.jsonl", tmp_path / "out", split=["test"], image_root=tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [
    # COCO's own annotation file (one line): images without sentences
    json.dumps({"info": {}, "images": [{"file_name": "a.jpg", "id": 1}], "annotations": [{"image_id": 1}]}),
    json.dumps({"images": [], "dataset": "coco"}),
    json.dumps({"image": "a.png", "caption": "pretty-printed"}, indent=2),  # one object over several lines
])
def test_a_json_object_that_is_not_a_karpathy_file_is_a_one_line_cli_error(tmp_path, content, capfd):
    (tmp_path / "x.json").write_text(content)
    r = cli_in_process(capfd, "shards", tmp_path / "x.json", tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: x.json: a JSON object without an 'images' list of entries with 'sentences': not a Karpathy split "
        "file; a table must be JSON Lines (one object per line)"]
    assert not (tmp_path / "o").exists()


def test_cli_split_option_repeated_and_bad(coco, tmp_path, capfd):
    r = cli_in_process(capfd, "shards", coco, tmp_path / "o", "--split", "test", "--split", "val", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert [s["json"]["split"] for s in iter_samples(tmp_path / "o")] == ["test", "val", "test"]
    r = cli_in_process(capfd, "shards", coco, tmp_path / "o2", "--split", "dev")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: unknown --split 'dev'; splits are: train, restval, val, test"]


def test_json_lines_in_a_json_file_read_as_before(tmp_path):
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(3):
        (tmp_path / "img" / f"{i}.png").write_bytes(image_bytes(16, 16, seed=i))
        rows.append({"image": f"img/{i}.png", "caption": f"caption {i}", "id": f"r{i}",
                     "images": "an 'images' column of a table is just a column"})
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "many.json").write_text(lines)
    (tmp_path / "many.jsonl").write_text(lines)
    (tmp_path / "one.json").write_text(json.dumps({k: v for k, v in rows[0].items() if k != "images"}) + "\n")
    got = {}
    for name, n in (("many.json", 3), ("many.jsonl", 3), ("one.json", 1)):  # one line, one object: one row
        rep = build(tmp_path / name, tmp_path / f"out-{name}")
        assert rep["source_kind"] == "jsonl" and rep["written"] == n
        got[name] = list(iter_samples(tmp_path / f"out-{name}"))
        assert [(s["txt"], s["json"]["uid"]) for s in got[name]] == [(f"caption {i}", f"r{i}") for i in range(n)]
        assert all("captions" not in s["json"] for s in got[name])
        assert read_sidecars(open_dataset(tmp_path / f"out-{name}")).column_names == SIDECAR_SCHEMA.names
    same = lambda s: (s["__key__"], s["png"], s["txt"], s["json"]["uid"])  # noqa: E731 (source: the file name)
    assert list(map(same, got["many.json"])) == list(map(same, got["many.jsonl"]))


def test_other_sources_keep_their_sidecar_and_fingerprint(image_folder, tmp_path):
    build(image_folder, tmp_path / "out", samples_per_shard=5)
    assert pq.read_schema(tmp_path / "out" / "shard-000000.parquet").remove_metadata() == SIDECAR_SCHEMA
    assert all("captions" not in s["json"] for s in iter_samples(tmp_path / "out"))
    # a single-caption item hashes as it always has (its fingerprint is stored in every sidecar)
    it = Item(uid="u1", image=None, caption="a cat", source="t.csv", url=None)
    assert fingerprint([it]) == hashlib.blake2b(repr(("u1", "a cat", "t.csv", None)).encode(),
                                                digest_size=16).hexdigest()
    multi = Item(uid="u1", image=None, caption="a cat", source="t.csv", captions=["a cat", "a dog"])
    assert fingerprint([multi]) != fingerprint([it])


# --- resume --------------------------------------------------------------------------------------


def test_an_interrupted_run_resumes_with_the_same_captions_in_the_same_order(coco, tmp_path, monkeypatch):
    build(coco, tmp_path / "clean", samples_per_shard=2)
    import vlprep.shards as stage

    real, calls = stage.prepare_image, {"n": 0}

    def dies_in_the_third_shard(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # shards 0 and 1 hold 4 decodable images; the 5th image is in shard 2
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(stage, "prepare_image", dies_in_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        build(coco, tmp_path / "run", samples_per_shard=2)
    assert sorted(p.name for p in (tmp_path / "run").glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    monkeypatch.setattr(stage, "prepare_image", real)
    rep = build(coco, tmp_path / "run", samples_per_shard=2)
    assert rep["shards_resumed"] == 2 and files(tmp_path / "run") == files(tmp_path / "clean")
    got = list(iter_samples(tmp_path / "run"))
    assert [s["json"]["captions"] for s in got] == [cleaned(COCO[s["json"]["imgid"]][1]) for s in got]
    side = read_sidecars(open_dataset(tmp_path / "run"))
    assert side.column("captions").to_pylist() == [s["json"]["captions"] for s in got]


def test_an_edited_extra_caption_or_split_rebuilds_its_shard(coco, tmp_path):
    build(coco, tmp_path / "out", samples_per_shard=2)
    data = json.loads(coco.read_text())
    data["images"][6]["sentences"][1]["raw"] = "An edited second caption."
    coco.write_text(json.dumps(data))
    rep = build(coco, tmp_path / "out", samples_per_shard=2)
    assert rep["shards_resumed"] == 3  # only shard 3 (images 6 and 7) is rebuilt
    got = {s["json"]["imgid"]: s for s in iter_samples(tmp_path / "out")}
    assert got[6]["json"]["captions"] == ["A red kite in a blue sky.", "An edited second caption."]
    data["images"][3]["split"] = "test"  # an extra json field is part of the record too
    coco.write_text(json.dumps(data))
    assert build(coco, tmp_path / "out", samples_per_shard=2)["shards_resumed"] == 3


# --- readers -------------------------------------------------------------------------------------


def test_webdataset_and_wids_see_every_caption(coco_ds, tmp_path):
    import webdataset as wds
    import wids

    ours = list(iter_samples(coco_ds))
    urls = [str(coco_ds / s) for s in open_dataset(coco_ds).shards]
    got = list(wds.WebDataset(urls, shardshuffle=False).decode())
    assert [(s["__key__"], s["txt"], s["json"]["captions"]) for s in got] == \
        [(s["__key__"], s["txt"], s["json"]["captions"]) for s in ours]
    ds = wids.ShardListDataset(str(coco_ds / "index.json"), cache_dir=str(tmp_path / "cache"), transformations=[])
    assert len(ds) == len(ours) == 6
    for i in range(len(ds)):
        assert json.loads(ds[i][".json"].getvalue())["captions"] == ours[i]["json"]["captions"]
        assert ds[i][".txt"].getvalue().decode("utf-8") == ours[i]["json"]["captions"][0]


def test_open_clip_train_loader_reads_the_first_caption(coco_ds, monkeypatch):
    """open_clip's own WebDataset loader knows only `txt`: it trains on the first caption of each sample."""
    from functools import partial
    from types import SimpleNamespace

    data = pytest.importorskip("open_clip_train.data")
    # open_clip_train's group_by_keys_nothrow fails on the end-of-shard marker ({}) that webdataset >= 0.2.96 yields
    # after every tar, whatever the shards hold; its known fix is eof_value=None, applied here to reach the rest
    monkeypatch.setattr(data, "tar_file_expander", partial(data.tar_file_expander, eof_value=None))
    assert len(open_dataset(coco_ds).shards) == 3
    args = SimpleNamespace(train_data=str(coco_ds / "shard-{000000..000002}.tar"), train_num_samples=None,
                           dataset_resampled=False, train_data_upsampling_factors=None, seed=0, batch_size=2,
                           workers=0, world_size=1)
    info = data.get_wds_dataset(args, lambda im: 0, is_train=True, tokenizer=lambda text: [text])
    assert info.dataloader.num_samples == 6  # from sizes.json, the open_clip convention
    texts = [t for _, batch in info.dataloader for t in batch]
    assert sorted(texts) == sorted(s["txt"] for s in iter_samples(coco_ds))


# --- later stages ----------------------------------------------------------------------------------


def test_bow_deforms_every_caption_and_keeps_the_originals(coco_ds, tmp_path):
    from vlprep.bow import BowConfig, BowContext, Deformer, bow, parse_ops

    ops = "shuffle,rmstop,keep:3"
    rep = bow(BowConfig(src=coco_ds, out=tmp_path / "bow", ops=ops, base_frac=0.0, seed=3, workers=1))
    raw = {s["__key__"]: s for s in iter_samples(coco_ds)}
    got = list(iter_samples(tmp_path / "bow"))
    deformer = Deformer(parse_ops(ops), BowContext(), 3)  # no op here needs the base set
    assert len(got) == len(raw) == rep["written"]
    for s in got:
        orig = raw[s["__key__"]]
        caps = orig["json"]["captions"]
        assert s["json"]["captions_raw"] == caps and s["json"]["caption_raw"] == orig["txt"]
        assert s["txt"] == deformer(orig["txt"], s["__key__"])  # the first caption exactly as a single one
        want = [s["txt"]] + [d for j, c in enumerate(caps[1:], 1) if (d := deformer(c, f"{s['__key__']}#{j}"))]
        assert s["json"]["captions"] == want
        assert not set(s["json"]["captions"]) & set(caps)  # training sees no intact caption
        assert all(1 <= len(c.split()) <= 3 for c in s["json"]["captions"])
    side = read_sidecars(open_dataset(tmp_path / "bow"))
    assert side.column("captions").to_pylist() == [s["json"]["captions"] for s in got]
    assert side.column("caption").to_pylist() == [s["txt"] for s in got]
    # the first caption is what bow gives the same txt in a single-caption dataset with the same keys
    single = tmp_path / "single"
    single.mkdir()
    rows = []
    for i in range(len(COCO)):  # a row per position, so the keys match; the skipped positions have no image
        s = raw.get(f"shard_{i:09d}")
        if s is not None:
            (single / f"{i}.jpg").write_bytes(s["jpg"])
        rows.append({"image": f"{i}.jpg", "caption": s["txt"] if s else "none"})
    (single / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build(single / "rows.jsonl", tmp_path / "single-raw", samples_per_shard=3)
    bow(BowConfig(src=tmp_path / "single-raw", out=tmp_path / "single-bow", ops=ops, base_frac=0.0, seed=3,
                  workers=1))
    alone = list(iter_samples(tmp_path / "single-bow"))
    assert [(s["__key__"], s["txt"]) for s in alone] == [(s["__key__"], s["txt"]) for s in got]
    assert all("captions" not in s["json"] and "captions_raw" not in s["json"] for s in alone)


def test_bow_drops_empty_extra_captions_and_keeps_base_samples_intact(tmp_path):
    root = tmp_path / "k"
    root.mkdir()
    caps = [["A dog on the grass.", "the of a", "Dog running."], ["The a of.", "A cat."], ["Red kite.", "A kite."]]
    entries = []
    for i, cs in enumerate(caps):
        (root / f"{i}.jpg").write_bytes(image_bytes(16, 16, "JPEG", seed=i))
        entries.append({"filename": f"{i}.jpg", "imgid": i, "split": "test", "sentences": [{"raw": c} for c in cs]})
    (root / "k.json").write_text(json.dumps({"images": entries}))
    build(root / "k.json", tmp_path / "raw")
    from vlprep.bow import BowConfig, bow, is_base

    seed = next(s for s in range(1000) if [is_base(s, f"shard_{i:09d}", 0.5) for i in range(3)] == [0, 0, 1])
    rep = bow(BowConfig(src=tmp_path / "raw", out=tmp_path / "bow", ops="rmstop", base_frac=0.5, seed=seed,
                        workers=1))
    assert (rep["written"], rep["dropped_empty"], rep["captions_dropped_empty"]) == (2, 1, 1)
    got = list(iter_samples(tmp_path / "bow"))
    assert [s["json"]["captions"] for s in got] == [["dog grass", "dog running"], ["Red kite.", "A kite."]]
    assert [s["json"]["captions_raw"] for s in got] == [caps[0], caps[2]]
    assert [s["json"]["bow"] for s in got] == [True, False]
    meta = json.loads((tmp_path / "bow" / "meta.json").read_text())
    assert meta["counts"]["dropped_empty"] == 1


def test_bow_base_vocabulary_holds_every_caption_of_the_base_samples(tmp_path):
    from vlprep.bow import base_statistics, is_base, parse_ops

    root = tmp_path / "k"
    root.mkdir()
    entries = []
    for i in range(4):
        (root / f"{i}.jpg").write_bytes(image_bytes(16, 16, "JPEG", seed=i))
        entries.append({"filename": f"{i}.jpg", "imgid": i,
                        "sentences": [{"raw": f"first{i}"}, {"raw": f"second{i} extra{i}"}]})
    (root / "k.json").write_text(json.dumps({"images": entries}))
    build(root / "k.json", tmp_path / "raw")
    ctx, before = base_statistics(open_dataset(tmp_path / "raw"), parse_ops("basevocab"), 0.5, 0)
    base = [i for i in range(4) if is_base(0, f"shard_{i:09d}", 0.5)]
    assert ctx.base_vocab == {w for i in base for w in (f"first{i}", f"second{i}", f"extra{i}")}
    assert before["base"] == len(base)


def test_pseudolabel_drops_the_input_captions(world, tmp_path, coco_ds):
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel
    from vltrain.checkpoint_encoder import CheckpointEncoder

    enc = CheckpointEncoder(world["ckpt"], "cpu")
    rep = pseudolabel(PseudolabelConfig(aligned=world["aligned"], unaligned=coco_ds, out=tmp_path / "pl", k=3,
                                        crops=2, batch_size=4, device="cpu"), enc)
    got = list(iter_samples(tmp_path / "pl"))
    assert rep["written"] == len(got) == 6
    for s in got:
        assert "captions" not in s["json"] and "captions_raw" not in s["json"] and s["json"]["pseudo"] is True
        assert {"cocoid", "imgid", "split", "uid"} <= set(s["json"])  # the rest of the input json is kept
    side = read_sidecars(open_dataset(tmp_path / "pl"))
    assert "captions" not in side.column_names and side.column("caption").to_pylist() == [s["txt"] for s in got]


@pytest.mark.filterwarnings("ignore:Glyph .* missing from font")  # the PMI heatmap labels a CJK noun
def test_detect_features_and_ontology_copy_the_captions(coco_ds, tmp_path):
    from vlprep.detect import DetectConfig, detect
    from vlprep.features import FeaturesConfig, features
    from vlprep.ontology import OntologyConfig, ontology

    keys = [s["__key__"] for s in iter_samples(coco_ds)]
    (tmp_path / "dets.jsonl").write_text("".join(
        json.dumps({"key": k, "objects": [{"label": "dog", "score": 0.9, "box": [0, 0, 1, 1]}]}) + "\n" for k in keys))
    detect(DetectConfig(src=coco_ds, out=tmp_path / "det", from_file=tmp_path / "dets.jsonl"))
    features(FeaturesConfig(src=tmp_path / "det", out=tmp_path / "feat", size=64, decode_threads=1, device="cpu"))
    ontology(OntologyConfig(src=tmp_path / "det", out=tmp_path / "onto", min_instances=1, min_cooccur=1))
    raw = list(iter_samples(coco_ds))
    want = read_sidecars(open_dataset(coco_ds)).column("captions").to_pylist()
    for out in (tmp_path / "det", tmp_path / "feat", tmp_path / "onto"):
        got = list(iter_samples(out))
        assert [s["json"]["captions"] for s in got] == [s["json"]["captions"] for s in raw]
        assert [s["txt"] for s in got] == [s["txt"] for s in raw]
        assert all(s["json"]["objects"][0]["label"] == "dog" for s in got)
        assert read_sidecars(open_dataset(out)).column("captions").to_pylist() == want
    assert all("npy" in s for s in iter_samples(tmp_path / "feat"))
    assert all("nouns" in s["json"] for s in iter_samples(tmp_path / "onto"))


# --- reads stay under the image root; malformed files are one line -------------------------------------------------


def karpathy(root: Path, entries: list[dict], name: str = "k.json") -> Path:
    """A Karpathy file of `entries` (each gets a caption and split test unless given) in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    full = [{"split": "test", "imgid": i, "sentences": [{"raw": f"caption {i}"}], **e} for i, e in enumerate(entries)]
    (root / name).write_text(json.dumps({"images": full}))
    return root / name


@pytest.fixture
def cli(capfd):
    """cli(*ARGS): `vlprep ARGS` as its main() in this process (tests/conftest.py's cli_in_process): the exit status and
    the one error line are what a child process gives, without a fresh interpreter's ~1 s of imports per run. An
    uncaught exception raises in the test here instead of printing a traceback: a failure either way."""
    return lambda *args: cli_in_process(capfd, *args)


def cli_child(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`vlprep ARGS` in a child process, where the point is that a stage that blocks on a FIFO or reads /dev/zero
    without end fails the test on the timeout (and is killed) instead of hanging or filling the test process."""
    return subprocess.run([sys.executable, "-m", "vlprep.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "300",
                                                "PYTHONPATH": str(Path(__file__).resolve().parents[2])})


@pytest.fixture
def outside(tmp_path) -> Path:
    """tmp/secret/x.png: a readable image outside the image root tmp/root (which holds ok.png)."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "x.png").write_bytes(image_bytes(20, 20, seed=9))
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "ok.png").write_bytes(image_bytes(20, 20, seed=1))
    return tmp_path / "secret" / "x.png"


def test_image_paths_that_leave_the_root_are_counted_skips(tmp_path, outside):
    root = tmp_path / "root"
    (root / "sub").mkdir()
    os.symlink(outside, root / "link.png")  # a symlink inside the root to a file outside it
    os.symlink(tmp_path / "secret", root / "sub" / "dirlink")  # ... and to a folder outside it
    os.symlink(root / "ok.png", root / "sub" / "inside.png")  # a symlink that stays inside: read
    path = karpathy(root, [{"filename": "ok.png"}, {"filename": "../secret/x.png"},
                           {"filepath": "sub", "filename": "../../secret/x.png"}, {"filename": str(outside)},
                           {"filepath": str(outside.parent), "filename": "x.png"}, {"filename": "link.png"},
                           {"filepath": "sub/dirlink", "filename": "x.png"},
                           {"filepath": "sub", "filename": "inside.png"},
                           {"filepath": "sub/dirlink/..", "filename": "ok.png"},  # `..` after a symlink: kernel's way
                           {"filepath": "sub/../", "filename": "ok.png"}])  # a `..` that stays inside
    rep = build(path, tmp_path / "out")
    assert (rep["written"], rep["skipped"]) == (3, {"image_outside_root": 7})
    secret = outside.read_bytes()
    assert all(secret not in p.read_bytes() for p in (tmp_path / "out").glob("*.tar"))
    assert rep["skipped_examples"]["image_outside_root"] == ["1", "2", "3", "4", "5"]
    # --follow-symlinks reads through symlinks (recorded), never through `..` or an absolute name
    rep = build(path, tmp_path / "o2", follow_symlinks=True)
    assert (rep["written"], rep["skipped"]) == (5, {"image_outside_root": 5})
    assert json.loads((tmp_path / "o2" / "meta.json").read_text())["options"]["follow_symlinks"] is True
    assert "follow_symlinks" not in json.loads((tmp_path / "out" / "meta.json").read_text())["options"]


def test_special_files_are_refused_without_a_blocking_read(tmp_path):
    """/dev/zero never ends and a FIFO blocks its reader: both (and a folder) are counted skips, not read."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "fifo.png")
    (root / "folder.png").mkdir()
    os.symlink("/dev/zero", root / "zero.png")
    path = karpathy(root, [{"filename": "fifo.png"}, {"filename": "folder.png"}, {"filename": "zero.png"},
                           {"filepath": "/dev", "filename": "zero"}])
    r = cli_child("shards", path, tmp_path / "out", "--workers", "1", "--follow-symlinks")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "no sample was written" in r.stderr
    assert "pass --follow-symlinks to read through symlinks you trust" in r.stdout + r.stderr  # the skip's hint
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["skipped"] == {"unreadable_image": 3, "image_outside_root": 1}


def test_an_image_file_over_the_size_cap_is_a_counted_skip(tmp_path, monkeypatch):
    import vlprep.shards

    root = tmp_path / "root"
    root.mkdir()
    (root / "big.png").write_bytes(image_bytes(64, 64, seed=2))
    (root / "small.png").write_bytes(image_bytes(4, 4, seed=3))
    monkeypatch.setattr(vlprep.shards, "MAX_IMAGE_BYTES", (root / "small.png").stat().st_size)
    rep = build(karpathy(root, [{"filename": "big.png"}, {"filename": "small.png"}]), tmp_path / "out")
    assert (rep["written"], rep["skipped"]) == (1, {"image_too_large": 1})


@pytest.mark.parametrize("entry, line", [
    ({"filename": "a\0b.png"}, "images[1].filename: holds a NUL character"),
    ({"filepath": "v\0", "filename": "a.png"}, "images[1].filepath: holds a NUL character"),
    ({"filename": ["a.png"]}, "images[1].filename: expected a string, not an array ['a.png']"),
    ({"filename": "a.png", "filepath": 3}, "images[1].filepath: expected a string, not an integer 3"),
    ({"filename": "a.png", "split": ["test"]}, "images[1].split: expected a string, not an array ['test']"),
    ({"filename": "a.png", "split": {"a": 1}}, "images[1].split: expected a string, not an object {'a': 1}"),
    ({"filename": "a.png", "cocoid": {"nested": [1, 2]}},
     "images[1].cocoid: expected an integer, not an object {'nested': [1, 2]}"),
    ({"filename": "a.png", "imgid": "7"}, "images[1].imgid: expected an integer, not a string '7'"),
    ({"filename": "a.png", "imgid": True}, "images[1].imgid: expected an integer, not true True"),
    ({"filename": "a.png", "cocoid": 7.0}, "images[1].cocoid: expected an integer, not a number 7.0"),
    ({"filename": "b\ud800.png"}, "images[1].filename: holds a lone surrogate, not text"),
])
def test_a_malformed_entry_is_one_line_naming_it(tmp_path, entry, line, cli):
    path = karpathy(tmp_path / "k", [{"filename": "a.png", "cocoid": 1}, entry])
    for split in ([], ["--split", "test"]):
        r = cli("shards", path, tmp_path / "out", *split)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: k.json: {line}"], r.stderr
    assert not (tmp_path / "out").exists()


def test_an_entry_that_is_not_an_object_is_one_line(tmp_path):
    path = karpathy(tmp_path / "k", [{"filename": "a.png"}])
    data = json.loads(path.read_text())
    path.write_text(json.dumps({"images": data["images"] + [["a.png"]]}))
    with pytest.raises(VlprepError, match=r"^k\.json: images\[1\]: expected an object, not an array$"):
        build(path, tmp_path / "out")


@pytest.mark.parametrize("text", ['{"images": ' + "[" * 200_000 + "]" * 200_000 + "}",
                                  "[" * 200_000 + "]" * 200_000,
                                  '{"images": [{"filename": "a.png", "sentences": ' + "[" * 200_000 + "]" * 200_000
                                  + "}]}"])
def test_deeply_nested_json_is_one_line(tmp_path, text, cli):
    (tmp_path / "k.json").write_text(text)
    for split in ([], ["--split", "test"]):
        r = cli("shards", tmp_path / "k.json", tmp_path / "out", *split)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert "nested too deeply" in r.stderr or "--split applies only" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_bom_prefixed_karpathy_file_is_read(coco, tmp_path):
    coco.write_bytes(b"\xef\xbb\xbf" + coco.read_bytes())
    assert build(coco, tmp_path / "out", split=["test"])["written"] == 2


@pytest.mark.parametrize("content, said", [
    (b'{"images": [{"filename": "a.png", "sentences": [{"raw": "x"}]}', "malformed JSON: Expecting ',' delimiter"),
    (b'{"images": [{"filename": "a.png",\n "sentences": [{"raw": "caf\xe9"}]}]}', "malformed JSON: not UTF-8 text "
     "(byte 0xe9 at offset 61)"),
])
def test_a_malformed_karpathy_file_with_split_names_its_json_error(tmp_path, content, said, cli):
    (tmp_path / "k.json").write_bytes(content)
    r = cli("shards", tmp_path / "k.json", tmp_path / "out", "--split", "test")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[0].startswith(f"error: k.json: {said}"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_special_file_as_source_or_detections_file_is_one_line(tmp_path, coco_ds):
    os.mkfifo(tmp_path / "fifo.json")
    os.chmod(tmp_path / "fifo.json", 0o777)  # (executable: no "cannot read folder" on the way)
    r = cli_child("shards", tmp_path / "fifo.json", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: source {tmp_path / 'fifo.json'}: a FIFO, not a file or folder"]
    r = cli_child("detect", coco_ds, tmp_path / "det", "--from-file", tmp_path / "fifo.json")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: detections file {tmp_path / 'fifo.json'}: a FIFO, not a regular file"]
    r = cli_child("detect", coco_ds, tmp_path / "det", "--from-file", "/dev/zero")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: detections file /dev/zero: a character device, not a regular file"]


def test_json_past_pythons_integer_digit_limit_or_with_a_lone_surrogate_path_is_handled(tmp_path, cli):
    """A 5,000-digit integer is a ValueError from json (not a JSONDecodeError); a "\\ud800" path cannot be stat'ed."""
    big = "9" * 5000
    (tmp_path / "a.png").write_bytes(image_bytes())
    (tmp_path / "t.jsonl").write_text('{"image": "a.png", "caption": "x"}\n{"image": "a.png", "uid": %s}\n' % big)
    r = cli("shards", tmp_path / "t.jsonl", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: t.jsonl:2: malformed JSON (Exceeds the limit (4300 digits) for integer string conversion: value has "
        "5000 digits)"]
    (tmp_path / "k.json").write_text('{"images": [{"filename": "a.png", "cocoid": %s, "sentences": []}]}' % big)
    r = cli("shards", tmp_path / "k.json", tmp_path / "out", "--split", "test")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: k.json: malformed JSON: Exceeds the limit (4300 digits) for integer string conversion: value has 5000 "
        "digits"]
    (tmp_path / "s.jsonl").write_text('{"image": "a.png", "caption": "x"}\n{"image": "b\\ud800.png", "caption": "y"}\n'
                                      '{"image": "b\\u0000.png", "caption": "z"}\n')
    rep = build(tmp_path / "s.jsonl", tmp_path / "o2")
    assert (rep["written"], rep["skipped"]) == (1, {"unreadable_image": 2})

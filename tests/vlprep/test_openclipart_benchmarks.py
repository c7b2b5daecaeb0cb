"""The demo's two held-out benchmarks: make_karpathy.py's multi-caption split file and zeroshot.py's image folder,
each read back by the tool that scores it (`vlprep shards` on the Karpathy file, vltrain's image-folder reader)."""

import importlib.util
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import image_bytes
from vlprep.dataset import iter_samples
from vlprep.shards import ShardsConfig, build_shards
from vltrain.zeroshot import image_folder

HERE = Path(__file__).resolve().parents[2] / "examples" / "openclipart"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(module, monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


@pytest.fixture
def png_root(tmp_path):
    root = tmp_path / "png"
    for i, rel in enumerate(["animals/cat.png", "animals/dog.png", "food/pie.png", "food/cake.png", "people/kid.png",
                             "animals/owl.png", "food/tea.png", "people/mum.png"]):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(image_bytes(20, 16, seed=i))
    return root


def test_make_karpathy_writes_name_description_and_keywords_as_captions(png_root, tmp_path, monkeypatch, capsys):
    mk = load("make_karpathy")
    rows = [  # uid, title, description, keywords
        ("animals/cat", "Cat", "A grey cat asleep", ["pet", "animal"]),     # 3 captions
        ("animals/dog", "Dog", "", ["dog"]),                                 # keywords repeat the name: 1 caption
        ("food/pie", "Pie", "Pie", ["dessert"]),                             # description repeats it: 2 captions
        ("food/cake", "Gâteau", "Un gâteau au chocolat", []),                # non-ASCII, 2 captions
    ]
    table = pa.table({"image": [str(png_root / f"{u}.png") for u, *_ in rows], "uid": [u for u, *_ in rows],
                      "caption": ["x"] * 4, "title": [r[1] for r in rows], "description": [r[2] for r in rows],
                      "keywords": [r[3] for r in rows]})
    pq.write_table(table, tmp_path / "eval.parquet")
    out = tmp_path / "k" / "dataset_openclipart.json"
    run(mk, monkeypatch, "--eval", str(tmp_path / "eval.parquet"), "--image-root", str(png_root), "--out", str(out))
    data = json.loads(out.read_text(encoding="utf-8"))
    got = {im["filepath"] + "/" + im["filename"]: [s["raw"] for s in im["sentences"]] for im in data["images"]}
    assert got == {"animals/cat.png": ["Cat", "A grey cat asleep", "pet, animal"], "food/cake.png":
                   ["Gâteau", "Un gâteau au chocolat"], "food/pie.png": ["Pie", "dessert"]}  # uid order, dog left out
    assert [im["imgid"] for im in data["images"]] == [0, 1, 2] and {im["split"] for im in data["images"]} == {"test"}
    assert [s["sentid"] for im in data["images"] for s in im["sentences"]] == list(range(7))
    assert "3 images, 7 captions" in capsys.readouterr().out

    # vlprep shards reads it as COCO's and Flickr30k's files: one sample per image, every caption in order
    build_shards(ShardsConfig(src=out, out=tmp_path / "shards", image_root=png_root, split=["test"], workers=1))
    samples = list(iter_samples(tmp_path / "shards"))
    assert [s["json"]["captions"] for s in samples] == list(got.values())
    assert [s["txt"] for s in samples] == [c[0] for c in got.values()]


def test_zeroshot_folder_holds_balanced_classes_and_no_excluded_image(png_root, tmp_path, monkeypatch):
    zs = load("zeroshot")
    uids = ["animals/cat", "animals/dog", "animals/owl", "food/pie", "food/cake", "food/tea", "people/kid",
            "people/mum"]
    pq.write_table(pa.table({"image": [str(png_root / f"{u}.png") for u in uids], "uid": uids,
                             "category": [u.split("/")[0] for u in uids]}), tmp_path / "all.parquet")
    pq.write_table(pa.table({"image": [str(png_root / "animals/cat.png")]}), tmp_path / "train.parquet")
    karpathy = tmp_path / "k.json"  # a Karpathy file's images are excluded through --image-root
    karpathy.write_text(json.dumps({"images": [{"filepath": "food", "filename": "pie.png", "sentences": []}]}))
    folder = tmp_path / "zs"
    run(zs, monkeypatch, "--all", str(tmp_path / "all.parquet"), "--exclude", str(tmp_path / "train.parquet"),
        str(karpathy), "--image-root", str(png_root), "--per-class", "2", "--folder", str(folder))
    bench = image_folder(folder)
    assert bench["folders"] == ["animals", "food", "people"] and bench["names"] == ["animal", "food", "person"]
    picked = sorted(str(Path(f).resolve().relative_to(png_root.resolve())) for f in bench["files"])
    assert picked == ["animals/dog.png", "animals/owl.png", "food/cake.png", "food/tea.png", "people/kid.png",
                      "people/mum.png"]
    assert bench["templates"] is None  # the built-in ensemble

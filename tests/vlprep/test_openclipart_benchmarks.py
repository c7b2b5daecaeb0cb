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


def test_recipe_heldout_sets_are_held_out_disjoint_and_deterministic(tmp_path, monkeypatch):
    """pipelines/inputs.yaml's heldout-retrieval and heldout-zeroshot-table: heldout.py --exclude --eval all, then
    make_karpathy.py --size, then zeroshot.py --more-classes excluding the retrieval file."""
    heldout, mk, zs = load("heldout"), load("make_karpathy"), load("zeroshot")
    root = tmp_path / "png"
    files = ["animals/cat", "animals/dog", "animals/owl", "animals/fox", "food/pie", "food/tea", "food/bun",
             "office/pen", "office/pin", "electronics/cd", "people/kid", "people/mum", "shapes/star"]
    for i, f in enumerate(files):
        (root / f"{f}.png").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{f}.png").write_bytes(image_bytes(20, 16, seed=i))
    # uid, file, title, keywords; animals/pets/cat is Debian's second folder for the trained cat.png
    rows = [("animals/cat", "animals/cat", "Cat", ["pet"]), ("animals/pets/cat", "animals/cat", "Cat", ["pet"]),
            ("animals/dog", "animals/dog", "Dog", ["pet"]), ("animals/owl", "animals/owl", "Owl", ["bird"]),
            ("animals/fox", "animals/fox", "Fox", ["wild"]), ("food/pie", "food/pie", "Pie", ["dessert"]),
            ("food/tea", "food/tea", "Tea", ["drink"]), ("food/bun", "food/bun", "Bun", ["bread"]),
            ("office/pen", "office/pen", "Pen", ["ink"]), ("office/pin", "office/pin", "Pin", []),  # one text
            ("electronics/cd", "electronics/cd", "Cd", ["disc"]), ("shapes/star", "shapes/star", "Star", ["shape"]),
            ("people/kid", "people/kid", "Smiley", ["people"]), ("people/mum", "people/mum", "Smiley", ["people"])]
    image = {uid: str(root / f"{f}.png") for uid, f, *_ in rows}
    table = pa.table({"image": [image[r[0]] for r in rows],
                      "caption": [f"{t}. {', '.join(k)}" if k else t for _, _, t, k in rows],
                      "uid": [r[0] for r in rows], "title": [r[2] for r in rows], "keywords": [r[3] for r in rows],
                      "category": [r[0].split("/")[0] for r in rows], "description": [""] * len(rows)})
    pq.write_table(table, tmp_path / "all.parquet")
    train = {"animals/cat": image["animals/cat"], "animals/dog": image["animals/dog"]}  # aligned, unaligned
    for name, index in (("captions", 0), ("unaligned", 2)):  # the rows of animals/cat and animals/dog
        pq.write_table(table.take([index]), tmp_path / f"{name}.parquet")

    def build(out: Path) -> tuple[list[str], list[str], list[str]]:
        out.mkdir()
        run(heldout, monkeypatch, "--all", str(tmp_path / "all.parquet"), "--aligned",
            str(tmp_path / "captions.parquet"), "--exclude", str(tmp_path / "unaligned.parquet"), "--eval", "all",
            "--out-eval", str(out / "cand.parquet"))
        run(mk, monkeypatch, "--eval", str(out / "cand.parquet"), "--image-root", str(root), "--size", "4",
            "--out", str(out / "retrieval.json"))
        run(zs, monkeypatch, "--all", str(tmp_path / "all.parquet"), "--exclude", str(tmp_path / "captions.parquet"),
            str(tmp_path / "unaligned.parquet"), str(out / "retrieval.json"), "--image-root", str(root),
            "--more-classes", "--per-class", "5", "--out", str(out / "zs.parquet"), "--classes", str(out / "zs.txt"))
        data = json.loads((out / "retrieval.json").read_text(encoding="utf-8"))
        retrieval = [str(root / im["filepath"] / im["filename"]) for im in data["images"]]
        zeroshot = pq.read_table(out / "zs.parquet").to_pydict()
        return retrieval, list(zeroshot["image"]), list(zeroshot["uid"])

    retrieval, zs_images, zs_uids = build(tmp_path / "a")
    # the 8 candidates (a caption of their own, 2 texts) in uid order: fox, owl, cd, bun, pie, tea, pen, star
    assert retrieval == [image[u] for u in ("animals/fox", "electronics/cd", "food/pie", "office/pen")]
    # every other held-out image of the 12 classes, the shared "Smiley. people" ones and the one-text pin too
    assert zs_uids == ["animals/owl", "food/bun", "food/tea", "people/kid", "people/mum", "office/pin"]
    assert pq.read_table(tmp_path / "a" / "zs.parquet").column("caption").to_pylist() == [
        "animal", "food", "food", "person", "person", "office supply"]
    assert (tmp_path / "a" / "zs.txt").read_text().splitlines()[-2:] == ["office supply", "electronic device"]
    retrieval_uids = {uid for uid, f in image.items() if f in retrieval}
    trained_uids = {uid for uid, f in image.items() if f in train.values()}  # by file: animals/pets/cat too
    assert trained_uids == {"animals/cat", "animals/pets/cat", "animals/dog"}
    assert not (set(retrieval) | set(zs_images)) & set(train.values())
    assert not (retrieval_uids | set(zs_uids)) & trained_uids
    assert not set(retrieval) & set(zs_images) and not retrieval_uids & set(zs_uids)

    build(tmp_path / "b")  # the same inputs give the same bytes
    for name in ("cand.parquet", "retrieval.json", "zs.parquet", "zs.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

"""The image-folder zero-shot benchmark: ROOT/CLASS/*.jpg, classnames.txt, templates.txt, and `vltrain eval`."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import image_bytes, tiny_checkpoint
from vltrain.errors import TrainError
from vltrain.cli import app
from vltrain.evaluate import recall_at_k
from vltrain.zeroshot import DEFAULT_TEMPLATES, image_folder, read_templates, zeroshot_metrics


def benchmark(root, classes=("cat", "dog", "red_car"), per_class=3):
    for c, name in enumerate(classes):
        (root / name / "deeper").mkdir(parents=True)
        for i in range(per_class):
            where = root / name / ("deeper" if i == 2 else "")
            (where / f"{i}.png").write_bytes(image_bytes(24, 20, seed=10 * c + i))
    (root / "empty_class").mkdir()  # no images: not a class
    (root / "notes.txt").write_text("not a class folder")
    return root


def test_folder_classes_are_sorted_subfolders_with_images_named_by_classnames(tmp_path):
    root = benchmark(tmp_path / "zs")
    b = image_folder(root)
    assert b["folders"] == ["cat", "dog", "red_car"] and b["names"] == ["cat", "dog", "red car"]
    assert b["labels"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and b["templates"] is None
    assert b["files"][2].parent.name == "deeper"  # images below a class folder, at any depth
    (root / "classnames.txt").write_text("red_car\tsports car\ncat\tkitten\n")  # FOLDER<TAB>name, any order, partial
    assert image_folder(root)["names"] == ["kitten", "dog", "sports car"]
    (root / "classnames.txt").write_text("kitten\npuppy\nautomobile\n")  # one name per line, sorted folder order
    assert image_folder(root)["names"] == ["kitten", "puppy", "automobile"]
    (root / "templates.txt").write_text("a photo of a {}.\n\n  a drawing of the {}  \n")
    assert image_folder(root)["templates"] == ["a photo of a {}.", "a drawing of the {}"]


@pytest.mark.parametrize("names, templates, message", [
    ("kitten\npuppy\n", None, "2 names for 3 class folders"),
    ("cat\tkitten\nhorse\tpony\n", None, "'horse' is not a class folder"),
    (None, "a photo\n", "has no {} for the class name"),
    (None, "\n\n", "no templates"),
])
def test_bad_benchmark_files_are_one_line_errors(tmp_path, names, templates, message):
    root = benchmark(tmp_path / "zs")
    if names is not None:
        (root / "classnames.txt").write_text(names)
    if templates is not None:
        (root / "templates.txt").write_text(templates)
    with pytest.raises(TrainError, match=message):
        image_folder(root)


def test_a_folder_with_one_class_or_none_is_an_error(tmp_path):
    with pytest.raises(TrainError, match="not found"):
        image_folder(tmp_path / "missing")
    benchmark(tmp_path / "one", classes=("cat",))
    with pytest.raises(TrainError, match="at least 2 class folders"):
        image_folder(tmp_path / "one")


def test_eval_scores_a_zero_shot_folder_without_shards(tmp_path):
    root = benchmark(tmp_path / "zs")
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")  # counted, skipped
    (root / "classnames.txt").write_text("cat\tkitten\n")
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--zeroshot-folder", str(root), "--device", "cpu",
                                 "--out", str(tmp_path / "zs.json")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "top-1" in r.output and "mean per class" in r.output and "retrieval" not in r.output
    res = json.loads((tmp_path / "zs.json").read_text())
    zs = res["zeroshot"]
    assert "retrieval" not in res
    assert (zs["classes"], zs["images"], zs["skipped"]) == (3, 9, 1)
    assert zs["names"] == ["kitten", "dog", "red car"] and zs["templates"] == list(DEFAULT_TEMPLATES)
    assert 0 <= zs["top1"] <= zs["top5"] <= 100 and 0 <= zs["mean_per_class"] <= 100
    assert zs["chance"]["top1"] == pytest.approx(100 / 3, abs=0.01)
    assert sum(c["count"] for c in zs["confusions"]) <= 9

    # --templates overrides the folder's own file and is recorded
    (root / "templates.txt").write_text("a {} in the folder\n")
    custom = tmp_path / "mine.txt"
    custom.write_text("a photo of a {}.\n")
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--zeroshot-folder", str(root), "--device", "cpu",
                                 "--templates", str(custom), "--out", str(tmp_path / "zs2.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "zs2.json").read_text())["zeroshot"]["templates"] == ["a photo of a {}."]


@pytest.mark.parametrize("args, message", [
    ([], "nothing to evaluate"),
    (["--zeroshot", "classes.txt"], "give shard folders too"),
    (["--zeroshot-folder", "missing"], "zero-shot folder not found"),
    (["--zeroshot-folder", "zs", "--templates", "missing.txt"], "cannot read templates"),
])
def test_eval_argument_mistakes_are_one_line_errors(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    benchmark(tmp_path / "zs")
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    r = CliRunner().invoke(app, ["eval", str(ckpt), *args, "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_read_templates_keeps_other_braces(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("{a} {} {b}\n")
    assert read_templates(path) == ["{a} {} {b}"]


@pytest.mark.parametrize("names, message", [
    ("kitten\nkitten\ncar\n", "class name 'kitten' is given to two folders"),
    ("cat\tpet\ndog\tpet\n", "class name 'pet' is given to two folders"),
    ("cat\tred car\n", "class name 'red car' is given to two folders"),  # the red_car folder's own name
    ("cat\tkitten\ncat\tpuppy\n", "folder 'cat' is named twice"),
    ("cat\tkitten\npuppy\ncar\n", "mixes FOLDER<TAB>name lines with plain name lines"),
])
def test_duplicate_and_mixed_class_names_are_refused(tmp_path, names, message):
    root = benchmark(tmp_path / "zs")
    (root / "classnames.txt").write_text(names)
    with pytest.raises(TrainError, match=message) as e:
        image_folder(root)
    assert "\n" not in str(e.value)


def test_an_unreadable_class_folder_is_counted_and_warned(tmp_path, monkeypatch):
    import os

    root = benchmark(tmp_path / "zs")
    real = os.scandir

    def scandir(path="."):  # what a folder without read permission does (chmod is no bar to root, so simulated)
        if str(path) == str(root / "dog"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    b = image_folder(root)
    assert b["folders"] == ["cat", "red_car"] and b["unreadable"] == ["dog (Permission denied)"]
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--zeroshot-folder", str(root), "--device", "cpu",
                                 "--out", str(tmp_path / "zs.json")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "warning: 1 folder(s) of the zero-shot benchmark could not be read" in r.output
    assert "dog (Permission denied)" in r.output
    zs = json.loads((tmp_path / "zs.json").read_text())["zeroshot"]
    assert zs["classes"] == 2 and zs["unreadable_folders"] == ["dog (Permission denied)"]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "huge"])
@pytest.mark.parametrize("which", ["--templates", "templates.txt", "classnames.txt"])
def test_templates_and_classnames_are_read_only_from_small_regular_files(tmp_path, monkeypatch, kind, which):
    import os

    monkeypatch.chdir(tmp_path)
    root = benchmark(tmp_path / "zs")
    target = tmp_path / "given.txt" if which == "--templates" else root / which
    if kind == "fifo":
        os.mkfifo(target)  # reading it would wait forever
    elif kind == "dev-zero":
        target.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "folder":
        target.mkdir()
    else:
        target.write_text("a {}\n" * 300_000)
    extra = ["--templates", str(target)] if which == "--templates" else []
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    r = CliRunner().invoke(app, ["eval", str(ckpt), "--zeroshot-folder", str(root), *extra, "--device", "cpu"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output + repr(r.exception)
    assert ("not a regular file" if kind != "huge" else "more than 1,048,576 bytes") in lines[0], lines[0]


def test_a_bom_is_read_and_caption_mode_refuses_a_class_listed_twice(tmp_path):
    from tests.conftest import colour_pairs

    root = benchmark(tmp_path / "zs")
    (root / "classnames.txt").write_bytes("\ufeffcat\tkitten\n".encode())  # a BOM is legal UTF-8
    assert image_folder(root)["names"] == ["kitten", "dog", "red car"]
    shards = colour_pairs(tmp_path, 8)
    (tmp_path / "classes.txt").write_text("red\nblue\nred\n")
    r = CliRunner().invoke(app, ["eval", str(tiny_checkpoint(tmp_path / "ckpt.pt")), str(shards), "--zeroshot",
                                 str(tmp_path / "classes.txt"), "--device", "cpu", "--out", str(tmp_path / "e.json")])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert r.exit_code == 2 and len(lines) == 1 and "class name 'red' is listed twice" in lines[0], r.output


NAMES = [f"class{c}" for c in range(10)]


def test_a_nan_image_is_no_hit_at_any_k_below_the_class_count():
    """NaN scores rank last, as in retrieval: six NaN images among 10 classes hit nothing (their rank came out -1,
    a hit at every K: top-5 was 100), and predict nothing, so they are in no confusion."""
    classes = torch.nn.functional.normalize(torch.randn(10, 16, generator=torch.Generator().manual_seed(1)), dim=-1)
    labels = torch.arange(6)
    out = zeroshot_metrics(torch.full((6, 16), float("nan")), classes, labels, NAMES)
    assert (out["top1"], out["top5"], out["mean_per_class"], out["confusions"]) == (0.0, 0.0, 0.0, [])
    images = torch.cat([classes[:4] + 0.01, torch.full((2, 16), float("nan"))])  # 4 right, 2 NaN
    out = zeroshot_metrics(images, classes, labels, NAMES)
    assert (out["top1"], out["top5"]) == (round(100 * 4 / 6, 2), round(100 * 4 / 6, 2))


def test_a_tie_with_the_true_class_is_a_miss_and_a_confusion():
    """Classes 0 and 1 score the same for every image: a tie counts against the image (top-1 0) whichever index is
    true, and the confusion list shows it both ways (it dropped the mistakes whose argmax was the true class)."""
    classes = torch.eye(3, 4)
    classes[1] = classes[0]
    images = torch.tensor([[1.0, 0, 0, 0]] * 3 + [[1.0, 0, 0.5, 0]] * 2)
    labels = torch.tensor([0, 0, 0, 1, 1])
    out = zeroshot_metrics(images, classes, labels, ["a", "b", "c"])
    assert out["top1"] == 0.0 and out["top5"] == 100.0
    assert out["confusions"] == [{"true": "a", "predicted": "b", "count": 3},
                                 {"true": "b", "predicted": "a", "count": 2}]


def test_zeroshot_ranks_as_retrieval_ranks_with_ties_and_nans():
    """top-1 / top-5 equal retrieval's text->image R@1 / R@5 with each image a caption and each class an image (the
    same rank rule, written independently in vltrain.evaluate), on scores with exact ties and NaN rows and columns;
    every missed image with a number for some other class is in the confusion counts, at its top other class."""
    g = torch.Generator().manual_seed(3)
    classes = torch.randint(-2, 3, (12, 8), generator=g).double()  # small integers: many exact ties
    classes[5] = float("nan")
    images = torch.randint(-2, 3, (60, 8), generator=g).double()
    images[[7, 19]] = float("nan")
    labels = torch.cat([torch.arange(12), torch.randint(0, 12, (48,), generator=g)])
    out = zeroshot_metrics(images, classes, labels, [f"c{i}" for i in range(12)])
    recall = recall_at_k(classes @ images.t(), labels, ks=(1, 5))  # images as captions of their class "image"
    assert (out["top1"], out["top5"]) == (recall["t2i_r1"], recall["t2i_r5"])
    scores = (images @ classes.t()).tolist()
    counts = {}
    for row, t in zip(scores, labels.tolist()):
        row = [float("-inf") if v != v else v for v in row]
        others = [(v, -c) for c, v in enumerate(row) if c != t]
        best, c = max(others)
        if best >= row[t] and best > float("-inf"):
            counts[(f"c{t}", f"c{-c}")] = counts.get((f"c{t}", f"c{-c}"), 0) + 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1], int(kv[0][0][1:]), int(kv[0][1][1:])))[:5]
    assert out["confusions"] == [{"true": t, "predicted": p, "count": n} for (t, p), n in top]

"""Every `vlprep` command with an OUT refuses, in one line and before anything is deleted, an OUT that is one of the
inputs it reads (SRC, --exclude, --embeddings, --keys, --checkpoint, --from-file, ...) or that holds one.

Before: `vlprep filter SRC OUT --overwrite` with OUT the --exclude dataset or the --embeddings folder cleared OUT,
then failed ("not a vlprep dataset"): the eval set or the vectors were gone; OUT was compared with SRC only."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import colour_pairs, make_dataset, tiny_checkpoint
from tests.vlprep.test_probe_faults import error_line


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The inputs every command reads, in one folder that each test copies: datasets, embeddings of both modalities,
    an eval set and its embeddings, a checkpoint, keys, detections, overrides, weights, a Karpathy split file."""
    from vlprep.detect import DetectConfig, detect
    from vlprep.embed import EmbedConfig, embed
    from vltrain.checkpoint_encoder import CheckpointEncoder

    tmp = tmp_path_factory.mktemp("out-apart")
    w = tmp / "w"
    w.mkdir()
    ds = colour_pairs(w, 8)  # w/src (images and captions) and w/ds
    make_dataset(w / "ev", ["an eval picture", "another eval picture"], 2, seed=70)
    make_dataset(w / "un", ["nobody reads this"] * 3, 3, seed=90, prefix="un")
    ckpt = tiny_checkpoint(w / "ckpt.pt")
    enc = CheckpointEncoder(ckpt, "cpu")
    for src, out, modality in ((ds, "emb", "image"), (ds, "embt", "text"), (w / "ev", "embev", "image")):
        embed(EmbedConfig(src=src, out=w / out, modality=modality), enc)
    shutil.copytree(w / "emb", w / "embraw", ignore=shutil.ignore_patterns("*.json"))  # hand-made: no meta.json
    keys = [f"shard_{i:09d}" for i in range(8)]
    (w / "keys.txt").write_text("\n".join(keys[:5]) + "\n")
    lines = [json.dumps({"key": k, "objects": [{"label": "dog", "score": 0.9, "box": [0, 0, 0.5, 1]}]}) for k in keys]
    (w / "dets.jsonl").write_text("\n".join(lines) + "\n")
    detect(DetectConfig(src=ds, out=w / "det", from_file=w / "dets.jsonl"))
    (w / "overrides.yaml").write_text("{}\n")
    (w / "weights.pt").write_bytes(b"not a state dict")
    images = [{"filepath": "", "filename": p.name, "split": "test", "sentences": [{"raw": "a picture"}]}
              for p in sorted((w / "src").glob("*.png"))[:3]]
    (w / "karpathy.json").write_text(json.dumps({"images": images}))
    return w


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or the file itself) -> its bytes."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


CKPT = ["--checkpoint", "{ckpt.pt}", "--device", "cpu"]

# (command line with {NAME} for the world's files and OUT for the output, the input OUT is set to)
CASES = {
    "shards-src": (["shards", "{src}", "OUT"], "src"),
    "shards-image-root": (["shards", "{karpathy.json}", "OUT", "--image-root", "{src}"], "src"),
    "bow-src": (["bow", "{ds}", "OUT"], "ds"),
    "filter-src": (["filter", "{ds}", "OUT", "--dedup", "image"], "ds"),
    "filter-keys": (["filter", "{ds}", "OUT", "--keys", "{keys.txt}"], "keys.txt"),
    "filter-drop-keys": (["filter", "{ds}", "OUT", "--drop-keys", "{keys.txt}"], "keys.txt"),
    "filter-exclude": (["filter", "{ds}", "OUT", "--exclude", "{ev}"], "ev"),
    "filter-embeddings": (["filter", "{ds}", "OUT", "--near-dup", "0.9", "--embeddings", "{emb}"], "emb"),
    # (its warning about the missing meta.json would come before the error: the OUT check comes first)
    "filter-embeddings-handmade": (["filter", "{ds}", "OUT", "--near-dup", "0.9", "--embeddings", "{embraw}"],
                                   "embraw"),
    "filter-text-embeddings": (["filter", "{ds}", "OUT", "--clip-score-min", "0", "--embeddings", "{emb}",
                                "--text-embeddings", "{embt}"], "embt"),
    "filter-exclude-embeddings": (["filter", "{ds}", "OUT", "--near-dup", "0.9", "--embeddings", "{emb}",
                                   "--exclude", "{ev}", "--exclude-embeddings", "{embev}"], "embev"),
    "filter-checkpoint": (["filter", "{ds}", "OUT", "--near-dup", "0.9", *CKPT], "ckpt.pt"),
    "detect-src": (["detect", "{ds}", "OUT", "--from-file", "{dets.jsonl}"], "ds"),
    "detect-from-file": (["detect", "{ds}", "OUT", "--from-file", "{dets.jsonl}"], "dets.jsonl"),
    "detect-weights": (["detect", "{ds}", "OUT", "--backend", "torchvision:fasterrcnn_resnet50_fpn",
                        "--weights", "{weights.pt}"], "weights.pt"),
    "features-src": (["features", "{ds}", "OUT", "--size", "32", "--device", "cpu"], "ds"),
    "features-weights": (["features", "{ds}", "OUT", "--image-model", "torchvision:resnet18", "--weights",
                          "{weights.pt}", "--size", "32", "--device", "cpu"], "weights.pt"),
    "ontology-src": (["ontology", "{det}", "OUT"], "det"),
    "ontology-overrides": (["ontology", "{det}", "OUT", "--overrides", "{overrides.yaml}"], "overrides.yaml"),
    "embed-dataset": (["embed", "{ds}", "OUT", *CKPT], "ds"),
    "embed-checkpoint": (["embed", "{ds}", "OUT", *CKPT], "ckpt.pt"),
    "pseudolabel-aligned": (["pseudolabel", "{ds}", "{un}", "OUT", *CKPT], "ds"),
    "pseudolabel-unaligned": (["pseudolabel", "{ds}", "{un}", "OUT", *CKPT], "un"),
    "pseudolabel-checkpoint": (["pseudolabel", "{ds}", "{un}", "OUT", *CKPT], "ckpt.pt"),
}


def command(args: list[str], w: Path, out: Path) -> list[str]:
    line = [str(out) if a == "OUT" else str(w / a[1:-1]) if a.startswith("{") else a for a in args]
    return line + (["--overwrite"] if line[0] != "stats" else [])


@pytest.mark.parametrize("case", sorted(CASES))
def test_out_that_is_an_input_is_one_line_and_the_input_is_untouched(case, world, tmp_path, monkeypatch, capsys):
    w = tmp_path / "w"
    shutil.copytree(world, w, symlinks=True)
    args, target = CASES[case]
    before = snapshot(w / target)
    line = error_line(monkeypatch, capsys, *command(args, w, w / target))
    assert "OUT" in line and ("is the input" in line or "contains the input" in line), line
    assert snapshot(w / target) == before


# A file input inside an earlier vlprep output given as OUT with --overwrite: the files --overwrite clears (.json
# among them) would take the user's file with them.
HELD = {
    "filter-keys": (["filter", "{ds}", "OUT", "--keys", "{prev/keep.json}"], "keys.txt"),
    "detect-from-file": (["detect", "{ds}", "OUT", "--from-file", "{prev/dets.json}"], "dets.jsonl"),
    "ontology-overrides": (["ontology", "{det}", "OUT", "--overrides", "{prev/overrides.json}"], "overrides.yaml"),
}


@pytest.mark.parametrize("case", sorted(HELD))
def test_out_that_holds_an_input_file_is_one_line_and_the_file_is_kept(case, world, tmp_path, monkeypatch, capsys):
    w = tmp_path / "w"
    shutil.copytree(world, w, symlinks=True)
    shutil.copytree(w / "un", w / "prev")  # an earlier vlprep output: --overwrite may clear it
    args, source = HELD[case]
    held = w / args[-1][1:-1]
    shutil.copyfile(w / source, held)
    line = error_line(monkeypatch, capsys, *command(args, w, w / "prev"))
    assert "contains the input" in line and held.name in line, line
    assert held.read_bytes() == (w / source).read_bytes()


def test_stats_out_that_is_the_dataset_is_refused_and_its_report_kept(world, tmp_path, monkeypatch, capsys):
    """Before: `vlprep stats DS --out DS` wrote its own report.json over the stage's."""
    w = tmp_path / "w"
    shutil.copytree(world, w, symlinks=True)
    before = snapshot(w / "ds")
    line = error_line(monkeypatch, capsys, "stats", w / "ds", "--out", w / "ds")
    assert "is the dataset" in line, line
    assert snapshot(w / "ds") == before

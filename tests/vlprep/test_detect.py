"""vlprep detect: imported detections (--from-file), the packaged SSD and a torchvision backend, on the engine."""

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import image_bytes
from tests.vlprep.test_ontology import detected  # noqa: F401  (the imported-detections dataset both stages' tests use)
from vlprep import VlprepError
from vlprep.dataset import iter_samples
from vlprep.detect import DetectConfig, detect
from vlprep.shards import ShardsConfig, build_shards


def test_detect_from_file_keeps_images_and_adds_objects(detected, tmp_path):
    raw = list(iter_samples(tmp_path / "raw"))
    det = list(iter_samples(detected))
    assert [s["png"] for s in det] == [s["png"] for s in raw]
    assert det[1]["json"]["objects"] == [{"label": "dog", "score": 0.9, "box": [0, 0, 0.5, 1]},
                                         {"label": "person", "score": 0.9, "box": [0, 0, 0.5, 1]}]
    side = pq.read_table(detected / "shard-000000.parquet").to_pylist()
    assert [len(r["objects"]) for r in side] == [1, 2, 1, 1]


@pytest.mark.parametrize("line,match", [
    ("{oops", r"dets.jsonl:2: malformed JSON"),
    ('{"key": "nope", "objects": []}', r"dets.jsonl:2: unknown key 'nope'"),
    ('{"key": "shard_000000001"}', r"dets.jsonl:2: expected an object with fields 'key' and 'objects'"),
    ('{"key": "shard_000000001", "objects": [{"label": "dog", "score": 1}]}', r"dets.jsonl:2: object 0 needs"),
    ('{"key": "shard_000000001", "objects": [{"label": "dog", "score": 1, "box": [0, 0, 2, 1]}]}',
     r"dets.jsonl:2: object 0: box must be 4 numbers in \[0, 1\]"),
    ('{"key": "shard_000000000", "objects": []}', r"dets.jsonl:2: key 'shard_000000000' appears twice"),
])
def test_bad_detection_files_name_the_line(tmp_path, line, match):
    (tmp_path / "img").mkdir()
    for i in range(2):
        (tmp_path / "img" / f"{i}.png").write_bytes(image_bytes(8, 8, seed=i))
        (tmp_path / "img" / f"{i}.txt").write_text("x")
    build_shards(ShardsConfig(src=tmp_path / "img", out=tmp_path / "raw", workers=1))
    (tmp_path / "dets.jsonl").write_text('{"key": "shard_000000000", "objects": []}\n' + line + "\n")
    with pytest.raises(VlprepError, match=match):
        detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "o", from_file=tmp_path / "dets.jsonl"))
    assert not (tmp_path / "o").exists()


def test_workers_give_the_same_bytes_and_resume(detected, tmp_path):
    def files(d):
        return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".tar", ".parquet")}

    rep = detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "w2", from_file=tmp_path / "dets.jsonl",
                              min_score=0.3, workers=2))
    assert files(tmp_path / "w2") == files(detected) and rep["shards_resumed"] == 0
    (tmp_path / "w2" / "shard-000001.tar").unlink()
    rep = detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "w2", from_file=tmp_path / "dets.jsonl",
                              min_score=0.3, workers=2))
    assert rep["shards_resumed"] == 1 and files(tmp_path / "w2") == files(detected)
    with pytest.raises(VlprepError, match="--workers must be at least 1"):
        detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "w0", from_file=tmp_path / "dets.jsonl", workers=0))
    assert not (tmp_path / "w0").exists()


@pytest.mark.slow  # runs the packaged SSD-MobileNet-v2
def test_default_detector_finds_the_cat_in_chelsea(tmp_path):
    from skimage import data

    buf = io.BytesIO()
    Image.fromarray(data.chelsea()).save(buf, format="JPEG")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "chelsea.jpg").write_bytes(buf.getvalue())
    (tmp_path / "img" / "chelsea.txt").write_text("a cat")
    (tmp_path / "img" / "broken.jpg").write_bytes(buf.getvalue())
    (tmp_path / "img" / "broken.txt").write_text("x")
    build_shards(ShardsConfig(src=tmp_path / "img", out=tmp_path / "raw", workers=1))
    rep = detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "det", min_score=0.5))
    s = next(s for s in iter_samples(tmp_path / "det") if s["txt"] == "a cat")
    top = max(s["json"]["objects"], key=lambda o: o["score"])
    assert top["label"] == "cat" and top["score"] > 0.8
    x0, y0, x1, y1 = top["box"]
    assert 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1 and (x1 - x0) * (y1 - y0) > 0.3
    assert rep["images_per_s"] > 0


@pytest.mark.slow  # builds a small torchvision detector
def test_torchvision_backend_loads_local_weights(tmp_path):
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None,
                                                                               num_classes=91)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    (tmp_path / "img").mkdir()
    arr = (np.random.default_rng(0).random((64, 80, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(tmp_path / "img" / "a.png")
    (tmp_path / "img" / "a.txt").write_text("noise")
    build_shards(ShardsConfig(src=tmp_path / "img", out=tmp_path / "raw", workers=1))
    rep = detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "det", weights=tmp_path / "w.pt", min_score=0.0,
                              backend="torchvision:fasterrcnn_mobilenet_v3_large_320_fpn"))
    assert rep["samples"] == 1 and rep["backend"] == "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn"
    for o in next(iter_samples(tmp_path / "det"))["json"]["objects"]:
        assert all(0 <= v <= 1 for v in o["box"]) and o["label"] not in ("N/A", "__background__")
    torch.save({"not": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(VlprepError, match="cannot load .*bad.pt into fasterrcnn_resnet50_fpn"):
        detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "d2", weights=tmp_path / "bad.pt",
                            backend="torchvision:fasterrcnn_resnet50_fpn"))
    with pytest.raises(VlprepError, match="unknown torchvision detector 'nope'"):
        detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "d2", weights=tmp_path / "w.pt",
                            backend="torchvision:nope"))


@pytest.mark.slow  # runs the packaged SSD-MobileNet-v2
def test_mixed_image_modes_are_detected_in_one_batch(tmp_path):
    (tmp_path / "img").mkdir()
    for i, mode in enumerate(["RGB", "L", "RGBA"]):
        (tmp_path / "img" / f"{i}.png").write_bytes(image_bytes(40, 30, "PNG", seed=i, mode=mode))
        (tmp_path / "img" / f"{i}.txt").write_text(mode)
    (tmp_path / "img" / "p.png").write_bytes(image_bytes(40, 30, "PNG"))
    Image.open(tmp_path / "img" / "p.png").convert("P").save(tmp_path / "img" / "p.png", transparency=0)
    (tmp_path / "img" / "p.txt").write_text("palette")
    build_shards(ShardsConfig(src=tmp_path / "img", out=tmp_path / "raw", workers=1))
    rep = detect(DetectConfig(src=tmp_path / "raw", out=tmp_path / "det", batch_size=4))
    assert rep["samples"] == 4 and rep["undecodable"] == 0


# --- triplet rule: all (appendix A.1) vs detected -----------------------------------------------

"""vlprep detect: imported detections (--from-file), the packaged SSD and a torchvision backend, on the engine."""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import image_bytes
from tests.memrule import growth_per_sample
from tests.vlprep.test_ontology import detected  # noqa: F401  (the imported-detections dataset both stages' tests use)
from vlprep import VlprepError
from vlprep.dataset import iter_samples, open_dataset
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
    # a key error comes before the same line's object errors, as the line is read left to right
    ('{"key": "shard_000000000", "objects": 3}', r"dets.jsonl:2: key 'shard_000000000' appears twice"),
    ('{"key": "nope", "objects": [{}]}', r"dets.jsonl:2: unknown key 'nope'"),
    ('{"key": 7, "objects": []}', r"dets.jsonl:2: unknown key 7 "),
    ('{"key": "\\ud800", "objects": []}', r"dets.jsonl:2: unknown key '\\ud800' "),  # no UTF-8 form: no index has it
    ('{"key": "shard_000000001", "objects": {}}', r"dets.jsonl:2: 'objects' must be a list"),
    ('{"key": "shard_000000001", "objects": [{"label": 1, "score": 1, "box": [0, 0, 1, 1]}]}',
     r"dets.jsonl:2: object 0: label must be a string"),
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


LABELS = ["person", "dog", "chien", "\u732b", "traffic light"]


def table_dataset(root, m: int, per_shard: int):
    """root/raw: m samples (one 16 px image, captions "c I") in shards of per_shard, from a Parquet table."""
    root.mkdir(parents=True)
    pq.write_table(pa.table({"image": [image_bytes(16, 16)] * m, "caption": [f"c {i}" for i in range(m)]}),
                   root / "src.parquet")
    build_shards(ShardsConfig(src=root / "src.parquet", out=root / "raw", samples_per_shard=per_shard, workers=1))
    return root / "raw"


def detections_lines(m: int) -> list[str]:
    """Lines for keys m-1 .. 0 (every 7th left out), with 0-4 objects whose scores and boxes need rounding."""
    lines = []
    for i in reversed(range(m)):
        if i % 7 == 3:
            continue
        objs = [{"label": LABELS[(i + j) % 5], "score": (i * 13 + j) % 100 / 99, "box": [j / 7, 0, 1, 1 / 3]}
                for j in range(i % 5)]
        lines.append(json.dumps({"key": f"shard_{i:09d}", "objects": objs, "extra": i}, ensure_ascii=i % 2 == 0))
    return lines


def test_imported_detections_match_a_whole_file_reading_and_keep_their_fingerprint(tmp_path, monkeypatch):
    """Every sample's objects as a plain reading of the whole file gives them, and the shards' fingerprints as
    before the file was indexed (blake2b of the options, the file's bytes and the input sidecar): an OUT written
    then resumes. The index leaves nothing behind in TMPDIR."""
    raw = table_dataset(tmp_path / "ds", 47, 10)
    lines = detections_lines(47)
    # CRLF line ends, blank lines and a last line without its newline are all read as lines
    data = ("\r\n".join(lines[:20]) + "\n\n   \n" + "\n".join(lines[20:])).encode()
    (tmp_path / "dets.jsonl").write_bytes(data)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    rep = detect(DetectConfig(src=raw, out=tmp_path / "det", from_file=tmp_path / "dets.jsonl", min_score=0.25))
    assert list((tmp_path / "tmp").iterdir()) == []
    expected = {}
    for line in data.decode().splitlines():
        if line.strip():
            row = json.loads(line)
            expected[row["key"]] = [{"label": o["label"], "score": round(o["score"], 4),
                                     "box": [round(v, 4) for v in o["box"]]}
                                    for o in row["objects"] if round(o["score"], 4) >= 0.25]
    got = {s["__key__"]: s["json"]["objects"] for s in iter_samples(tmp_path / "det")}
    assert got == {f"shard_{i:09d}": expected.get(f"shard_{i:09d}", []) for i in range(47)}
    assert rep["objects"] == sum(map(len, expected.values())) and rep["samples"] == 47
    assert rep["with_objects"] == sum(bool(v) for v in expected.values())
    salt = json.dumps({"backend": "file:dets.jsonl", "min_score": 0.25}).encode()
    salt += hashlib.blake2b(data, digest_size=16).digest()
    for shard in open_dataset(raw).shards:
        side = pq.read_table(tmp_path / "det" / shard.replace(".tar", ".parquet"))
        stored = json.loads(side.schema.metadata[b"vlprep"])["stats"]["fingerprint"]
        assert stored == hashlib.blake2b(salt + (raw / shard.replace(".tar", ".parquet")).read_bytes(),
                                         digest_size=16).hexdigest()
        f32 = [[{"label": o["label"], "score": float(np.float32(o["score"])),
                 "box": [float(np.float32(v)) for v in o["box"]]}
                for o in got[k]] for k in side.column("key").to_pylist()]  # the sidecar's columns are float32
        assert side.column("objects").to_pylist() == f32
    (tmp_path / "dets.jsonl").write_bytes(data + b'\n{"key": "nope", "objects": []}\n')
    with pytest.raises(VlprepError, match=r"dets.jsonl:43: unknown key 'nope'"):
        detect(DetectConfig(src=raw, out=tmp_path / "det2", from_file=tmp_path / "dets.jsonl"))
    assert list((tmp_path / "tmp").iterdir()) == [] and not (tmp_path / "det2").exists()
    with pytest.raises(VlprepError, match=r"^detections file .*missing.jsonl: not found$"):
        detect(DetectConfig(src=raw, out=tmp_path / "det2", from_file=tmp_path / "missing.jsonl"))


def test_sigterm_while_the_index_is_built_removes_it(tmp_path):
    """SIGTERM stops the driver as Ctrl-C does (lifeline's Stopped), and the index's folder goes with it."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "d.jsonl").write_text('{"key": "k", "objects": []}\n')
    script = f"""
import os, signal, sys, tempfile
from vlprep.detfile import detection_index
tempfile.tempdir = {str(tmp_path / "tmp")!r}
def keys():
    yield ["k"]
    assert os.listdir(tempfile.tempdir)  # the index exists by now
    signal.raise_signal(signal.SIGTERM)
    yield ["j"]
try:
    with detection_index({str(tmp_path / "d.jsonl")!r}, keys()):
        pass
except KeyboardInterrupt as e:
    sys.exit(type(e).__name__)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert (r.returncode, r.stderr.strip()) == (1, "Stopped")
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow  # about 10 s
def test_the_driver_holds_no_per_sample_structure_of_the_detections(tmp_path):
    """The memory rule (tests/memrule.py) for `detect --from-file`, one inline worker: from 1,000 to 4,000 samples in
    shards of 50 (2.2 objects per line), the Python peak grew by 1,255 bytes per sample when the driver read the
    whole file into a dict (and every key into a set); it grows by 8 with the index (the per-shard counts)."""
    n = 1000
    srcs = {}
    for m in (n, 4 * n):
        srcs[m] = table_dataset(tmp_path / f"ds{m}", m, 50)
        (tmp_path / f"ds{m}" / "dets.jsonl").write_text("\n".join(detections_lines(m)) + "\n")

    def run(m: int) -> None:
        out = tmp_path / f"det{m}"  # the same paths each time: no new interned path strings after the first runs
        detect(DetectConfig(src=srcs[m], out=out, from_file=tmp_path / f"ds{m}" / "dets.jsonl"))
        shutil.rmtree(out)

    run(4 * n)  # the interpreter's own tables (interned strings) grow on a first run over new paths: not the stage
    assert growth_per_sample(run, n) < 100


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

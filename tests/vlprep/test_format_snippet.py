"""docs/FORMAT.md's Compatibility snippet, run as written on a dataset with a transparent PNG: webdataset and wids
give the images vlprep.dataset.as_rgb gives (transparency on white), without a warning; `.decode("pil")`, the trap the
section warns of, gives the transparent pixels' stored colour (black here) instead."""

import io
import re
import warnings
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from vlprep.dataset import as_rgb
from vlprep.output import Out, finish_dataset, write_shard

DOC = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"


def snippet() -> str:
    """The first Python block of the Compatibility section."""
    section = DOC.read_text().split("\n## Compatibility\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def dataset(root: Path) -> tuple[Path, list[Image.Image]]:
    """Two samples: an RGBA PNG, transparent black but for one opaque red pixel and one half-transparent blue one,
    and an opaque RGB PNG."""
    rgba = np.zeros((6, 5, 4), np.uint8)
    rgba[1, 2] = (255, 0, 0, 255)
    rgba[3, 3] = (0, 0, 255, 128)
    rgb = np.arange(6 * 5 * 3, dtype=np.uint8).reshape(6, 5, 3)
    images = [Image.fromarray(rgba, "RGBA"), Image.fromarray(rgb, "RGB")]
    samples, rows = [], []
    for i, im in enumerate(images):
        buf = io.BytesIO()
        im.save(buf, "PNG")
        key = f"k_{i:09d}"
        samples.append({"__key__": key, "png": buf.getvalue(), "txt": f"caption {i}", "json": {"width": 5, "height": 6}})
        rows.append({"key": key, "caption": f"caption {i}", "width": 5, "height": 6, "image_ext": "png"})
    root.mkdir()
    write_shard(Out(root), "shard-000000.tar", samples, rows)
    finish_dataset(Out(root), {"shard-000000.tar": 2}, {"stage": "test"})
    return root, images


def test_snippet_reads_images_as_vlprep_does_without_a_warning(tmp_path, monkeypatch):
    root, images = dataset(tmp_path / "raw")
    monkeypatch.chdir(tmp_path)  # the snippet's paths are data/raw/...
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "raw").symlink_to(root)
    ns: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(snippet(), str(DOC), "exec"), ns)
        got = list(ns["ds"])
    assert [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)] == []
    want = [np.asarray(as_rgb(im)) for im in images]
    assert [np.asarray(s["png"]).tolist() for s in got] == [w.tolist() for w in want]
    assert np.asarray(ns["sample"][".png"]).tolist() == want[0].tolist()  # wids, the first sample
    # the independent rule: a = alpha/255; out = a * colour + (1 - a) * 255, rounded as PIL does (within 1)
    px = want[0].astype(int)
    assert px[0, 0].tolist() == [255, 255, 255] and px[1, 2].tolist() == [255, 0, 0]
    a = 128 / 255
    assert np.abs(px[3, 3] - np.array([(1 - a) * 255, (1 - a) * 255, a * 255 + (1 - a) * 255])).max() <= 1
    # the trap: "pil" drops the alpha channel, so the transparent pixels keep their stored black
    pil = next(iter(wds.WebDataset([str(root / "shard-000000.tar")], shardshuffle=False).decode("pil")))
    assert np.asarray(pil["png"])[0, 0].tolist() == [0, 0, 0]

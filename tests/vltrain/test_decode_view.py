"""`decode_view`, the training views' decode: an RGB or grey JPEG by libjpeg-turbo through simplejpeg, the same
pixels and the same views as PIL's decode (the path every other caller keeps), and the same skips."""

import io

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from vlprep.dataset import decode_rgb
from vltrain.data.samples import FIRST, decode_view, load_sample, skip_reason, train_transform


def jpeg(w: int, h: int, seed: int, mode: str = "RGB", **save) -> bytes:
    """A photograph-like image (smooth colour field plus grain, sigma 12 grey levels), JPEG q90 unless `save` says."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    field = np.stack([128 + 90 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c) for c in range(3)], -1)
    img = Image.fromarray(np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG", **{"quality": 90, **save})
    return buf.getvalue()


# every JPEG layout a dataset holds: chroma 4:2:0 (PIL's default), 4:2:2 and 4:4:4, progressive, low and high
# quality, grey, odd sizes (partial MCUs) and a tiny one
VARIANTS = [
    ((500, 375), "RGB", {}), ((640, 480), "RGB", {"subsampling": 1}), ((333, 500), "RGB", {"subsampling": 0}),
    ((301, 227), "RGB", {"progressive": True}), ((257, 255), "RGB", {"quality": 40}),
    ((240, 320), "RGB", {"quality": 98, "subsampling": 0}), ((250, 251), "L", {}), ((17, 9), "RGB", {}),
    ((230, 229), "L", {"progressive": True}),
]


def pil_pixels(data: bytes) -> torch.Tensor:
    """The reference: PIL's decode to RGB, as a (3, H, W) tensor by torchvision's own PIL conversion."""
    return F.pil_to_tensor(decode_rgb(data))


@pytest.mark.parametrize("size,mode,save", VARIANTS)
def test_jpeg_pixels_are_pils(size, mode, save):
    data = jpeg(*size, seed=size[0], mode=mode, **save)
    x = decode_view(data)
    assert isinstance(x, torch.Tensor) and x.dtype == torch.uint8
    assert x.shape == (3, size[1], size[0])
    assert torch.equal(x, pil_pixels(data))


@pytest.mark.parametrize("augment,interpolation", [("none", "bilinear"), ("none", "bicubic"), ("albef", "bicubic"),
                                                   ("softmask", "bicubic")])
def test_training_views_are_the_pil_views(augment, interpolation):
    """Same seed, same view: the transforms read the same pixels in the same (3, H, W) strides as ToImage's."""
    tf = train_transform(64, (0.5,) * 3, (0.25,) * 3, 0.5, augment, interpolation)
    for i, (size, mode, save) in enumerate(VARIANTS):
        data = jpeg(*size, seed=i, mode=mode, **save)
        torch.manual_seed(i)
        ours = tf(decode_view(data, tf.draft))
        torch.manual_seed(i)
        theirs = tf(decode_rgb(data, tf.draft))
        assert torch.equal(ours, theirs), (augment, size, mode, save)


def test_other_formats_and_drafts_go_to_pil():
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    for fmt, img in (("PNG", rgb), ("WEBP", rgb), ("JPEG", rgb.convert("CMYK"))):
        buf = io.BytesIO()
        img.save(buf, fmt)
        out = decode_view(buf.getvalue())
        assert isinstance(out, Image.Image), fmt
        assert np.array_equal(np.asarray(out), np.asarray(decode_rgb(buf.getvalue()))), fmt
    # a JPEG the draft shrinks: PIL's scaled decode, at the draft's size
    data = jpeg(1280, 960, seed=1)
    tf = train_transform(224, (0.5,) * 3, (0.25,) * 3, 0.5)
    assert tf.draft(1280, 960) == 2
    out = decode_view(data, tf.draft)
    assert isinstance(out, Image.Image) and out.size == (640, 480)
    assert np.array_equal(np.asarray(out), np.asarray(decode_rgb(data, tf.draft)))
    # without a draft rule the same JPEG decodes in full here
    assert decode_view(data).shape == (3, 960, 1280)


def test_corrupt_data_decodes_as_pil_does_and_prints_nothing(capfd):
    """Bytes zeroed inside the scan: libjpeg warns ("Corrupt JPEG data") and PIL still gives an image, so the sample
    trains on PIL's pixels; a truncated file fails in both, and the loader counts that skip as it always did."""
    data = jpeg(200, 150, seed=3)
    corrupt = data[:1500] + bytes(300) + data[1800:]
    pil = pil_pixels(corrupt)  # PIL decodes it (the test's premise)
    with pytest.raises(ValueError, match="Corrupt JPEG data"):  # and libjpeg-turbo's strict decode does not
        simplejpeg.decode_jpeg(corrupt, strict=True)
    out = decode_view(corrupt)
    assert torch.equal(F.pil_to_tensor(out) if isinstance(out, Image.Image) else out, pil)
    truncated = data[: len(data) // 2]
    with pytest.raises(OSError):
        decode_rgb(truncated)
    tf = train_transform(32, (0.5,) * 3, (0.25,) * 3)
    raw = {"__key__": "k", "jpg": truncated, "txt": b"a caption"}
    with pytest.raises(OSError) as e:  # the loader's stream catches it and counts the sample under this reason
        load_sample(raw, tf, False, FIRST)
    assert skip_reason(e.value) == "undecodable"
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_pillows_size_limit_still_refuses(monkeypatch):
    """The header's size goes through Pillow's decompression-bomb check first, as decode_rgb's does."""
    data = jpeg(100, 100, seed=4)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # 10,000 pixels > 2 x 2,000: Pillow refuses
    with pytest.raises(Image.DecompressionBombError):
        decode_view(data)
    with pytest.raises(Image.DecompressionBombError):
        decode_rgb(data)


def test_training_samples_use_it():
    data = jpeg(320, 240, seed=5)
    tf = train_transform(64, (0.5,) * 3, (0.25,) * 3)
    raw = {"__key__": "k", "jpg": data, "txt": b"a caption"}
    torch.manual_seed(0)
    x, caption, key = load_sample(raw, tf, False, FIRST)
    torch.manual_seed(0)
    assert torch.equal(x, tf(decode_rgb(data, tf.draft)))
    assert (caption, key) == ("a caption", "k")

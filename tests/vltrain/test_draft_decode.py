"""JPEG draft decoding for training views: `draft_scale`'s rule against a brute-force enumeration of the crops
RandomResizedCrop can draw, torchvision's own crop sampler on the drafts, and the pixels against a full decode."""

import functools
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from vlprep.dataset import decode_rgb
from vltrain.data.samples import FIRST, draft_scale, load_sample, train_transform


def photo(w: int = 640, h: int = 480, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A photograph-like image: a smooth colour field plus a grain texture (sigma 12 grey levels), JPEG q90."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    field = np.stack([128 + 90 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c) for c in range(3)], -1)
    img = np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def crop_sides(w: int, h: int, min_scale: float, steps: int = 25) -> list[tuple[float, float]]:
    """Every crop (width, height) RandomResizedCrop(scale=(min_scale, 1), ratio=(3/4, 4/3)) can draw on a w x h image,
    on a grid of area fractions and ratios that holds the extremes, before rounding: those that fit inside the image,
    and the centre crop it falls back to (ratio clamped to 3/4..4/3)."""
    area = w * h
    sides = []
    for s in np.linspace(min_scale, 1.0, steps):
        for r in np.linspace(0.75, 1.0, steps):  # r <= 1 and its transpose: 3/4 exactly, not exp(log(3/4))
            a, b = math.sqrt(s * r * area), math.sqrt(s * area / r)
            sides += [(cw, ch) for cw, ch in ((a, b), (b, a)) if cw <= w and ch <= h]
    ratio = w / h
    fallback = (w, w / 0.75) if ratio < 0.75 else (h * 4 / 3, h) if ratio > 4 / 3 else (w, h)
    return sides + [fallback]


def brute_scale(width: int, height: int, size: int, min_scale: float) -> int:
    """The largest k in 8, 4, 2 whose draft has no crop shorter than `size` on a side, else 1: by enumeration."""
    for k in (8, 4, 2):
        w, h = math.ceil(width / k), math.ceil(height / k)
        if all(min(c) >= size for c in crop_sides(w, h, min_scale)):
            return k
    return 1


SIZES = [(640, 480), (480, 640), (1024, 1024), (2000, 300), (300, 2000), (4000, 3000), (225, 225), (1921, 1081),
         (500, 4000), (800, 600)]


@pytest.mark.parametrize("min_scale", [0.2, 0.5, 0.75])
def test_rule_is_the_brute_force_largest_safe_scale(min_scale):
    seen = set()
    for (W, H) in SIZES:
        for size in (32, 64, 96, 224, 384):
            k = draft_scale(W, H, size, min_scale)
            assert k == brute_scale(W, H, size, min_scale), (W, H, size)
            seen.add(k)
    assert seen == {1, 2, 4, 8}


def test_rule_above_three_quarters_is_a_lower_bound():
    """min_scale above 3/4: the extreme crop may not fit a near-square image; the rule is then never larger."""
    for (W, H) in SIZES:
        for size in (32, 96, 224):
            k = draft_scale(W, H, size, 0.9)
            assert k <= brute_scale(W, H, size, 0.9)
            w, h = math.ceil(W / k), math.ceil(H / k)
            assert k == 1 or all(min(c) >= size for c in crop_sides(w, h, 0.9))


def test_torchvision_never_draws_an_upsampled_crop_from_a_draft():
    """RandomResizedCrop's own sampler (with its rounding) on each draft the rule allows: every crop has `size`
    pixels or more per side, so a draft never turns a crop a full decode would have downsampled into an upsampled
    one."""
    from torchvision.transforms import v2

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    drafted = 0
    for _ in range(40):
        W, H = (int(v) for v in rng.integers(100, 3000, 2))
        size, min_scale = int(rng.choice([32, 64, 96, 224])), float(rng.choice([0.2, 0.5, 0.75]))
        k = draft_scale(W, H, size, min_scale)
        if k == 1:
            continue
        drafted += 1
        img = torch.empty(1, math.ceil(H / k), math.ceil(W / k))
        for _ in range(100):
            _, _, ch, cw = v2.RandomResizedCrop.get_params(img, [min_scale, 1.0], [3 / 4, 4 / 3])
            assert min(ch, cw) >= size, (W, H, k, size, min_scale, ch, cw)
    assert drafted > 10


def test_draft_decode_sizes_and_formats():
    data = photo()
    assert decode_rgb(data).size == (640, 480)  # no draft: every vlprep stage's decode is unchanged
    for k in (1, 2, 4, 8):
        assert decode_rgb(data, lambda w, h, k=k: k).size == (math.ceil(640 / k), math.ceil(480 / k))
    odd = photo(641, 479)
    assert decode_rgb(odd, lambda w, h: 2).size == (321, 240)  # ceil, as libjpeg scales
    png = photo(64, 48, fmt="PNG")
    assert decode_rgb(png, lambda w, h: 8).size == (64, 48)  # other formats: decoded in full


def test_draft_pixels_within_the_two_stage_resize_difference():
    """A crop resized from the 1/2 draft against the same crop resized from the full decode.

    A draft is a two-stage resize: the decoder halves the image (libjpeg's scaled inverse DCT, rounded to integers),
    then the crop is resized. Its reference is the same two stages done in pixels: the full decode halved by a 2x2
    box mean (PIL reduce, also rounded), then resized. The draft must differ from the one-stage resize of the full
    decode no more than that, plus half a grey level on average for the two half-size images' integer rounding."""
    from torchvision.transforms.v2 import functional as F

    data = photo()
    draft = functools.partial(draft_scale, size=96, min_scale=0.5)
    full = F.pil_to_tensor(decode_rgb(data))
    half = F.pil_to_tensor(decode_rgb(data, draft))
    box = F.pil_to_tensor(decode_rgb(data).reduce(2))
    assert half.shape[1:] == (240, 320)
    for t, l, h, w in [(0, 0, 480, 640), (40, 100, 300, 260), (100, 60, 200, 240), (10, 20, 222, 196)]:
        one = F.resize(F.crop(full, t, l, h, w), [96, 96], antialias=True).float()
        two = F.resize(F.crop(half, t // 2, l // 2, h // 2, w // 2), [96, 96], antialias=True).float()
        ref = F.resize(F.crop(box, t // 2, l // 2, h // 2, w // 2), [96, 96], antialias=True).float()
        assert (two - one).abs().mean() <= (ref - one).abs().mean() + 0.5, (t, l, h, w)


def test_training_samples_decode_at_the_draft():
    """load_sample decodes a training view's JPEG at train_transform's draft: the view is the transform of the draft,
    the same random draws; an evaluation transform (no .draft) decodes in full."""
    data = photo()
    tf = train_transform(96, [0.5] * 3, [0.5] * 3, 0.5)
    assert tf.draft(640, 480) == 2
    raw = {"jpg": data, "txt": b"a photo", "__key__": "k"}
    torch.manual_seed(3)
    x, caption, key = load_sample(raw, tf, False, FIRST)
    torch.manual_seed(3)
    assert torch.equal(x, tf(decode_rgb(data, tf.draft))) and (caption, key) == ("a photo", "k")
    seen = []
    load_sample(raw, lambda im: seen.append(im.size) or 0, False, FIRST)
    assert seen == [(640, 480)]

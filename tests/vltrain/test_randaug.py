"""albef's RandAugment with vltrain.data.randaug's geometric ops against torchvision's own, the reference: each of
ShearX, ShearY, TranslateX, TranslateY and Rotate byte for byte at many magnitudes, both signs, several sizes and
contents and fills; the source maps against the geometry written out in float64; the same draws from torch's RNG;
and the whole albef view equal to the one torchvision's RandAugment gives."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from vltrain.data import randaug
from vltrain.data.randaug import GEOMETRIC, RandAugment, source_map
from vltrain.data.samples import train_transform

SIZES = [(224, 224), (64, 64), (37, 53), (53, 37), (101, 99), (1, 7)]


def images(h: int, w: int, seed: int = 0) -> dict:
    """uint8 (3, h, w): noise, and a smooth photograph-like field with grain."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    smooth = np.stack([128 + 100 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c) for c in range(3)])
    out = {"noise": rng.integers(0, 256, (3, h, w)), "smooth": np.clip(smooth + rng.normal(0, 12, (3, h, w)), 0, 255)}
    return {k: tv_tensors.Image(torch.from_numpy(v.astype(np.uint8))) for k, v in out.items()}


def magnitudes(op: str, h: int, w: int, n: int, seed: int) -> list[float]:
    """n signed magnitudes in RandAugment's range for op (shear up to 0.3, translation up to 150 / 331 of the side,
    rotation up to 30 degrees), both signs, and the magnitude-7 values albef draws."""
    top = {"ShearX": 0.3, "ShearY": 0.3, "TranslateX": 150 / 331 * w, "TranslateY": 150 / 331 * h, "Rotate": 30.0}[op]
    at7 = float(torch.linspace(0.0, top, 31)[7])
    draws = np.random.default_rng(seed).uniform(0, top, n)
    return [at7, -at7] + [float(m) * (1 if i % 2 else -1) for i, m in enumerate(draws)]


@pytest.mark.parametrize("size", SIZES)
def test_geometric_ops_are_torchvisions_byte_for_byte(size):
    ours, ref = RandAugment(), v2.RandAugment()
    for kind, img in images(*size).items():
        for op in GEOMETRIC:
            for m in magnitudes(op, *size, n=12, seed=len(kind)):
                a = ours._apply_image_or_video_transform(img, op, m, "nearest", ours._fill)
                b = ref._apply_image_or_video_transform(img, op, m, "nearest", ref._fill)
                assert type(a) is type(b) is tv_tensors.Image and torch.equal(a, b), (kind, op, m)
    assert ours.source_maps  # the fast path ran


@pytest.mark.parametrize("fill", [0, 128, 127.5, 254.5, [10, 20, 30], (7.4,), 300, -1, [1, 2]])
def test_fill_outside_the_image_is_torchvisions(fill):
    # a fill each channel can hold goes through the gather (rounded as torchvision rounds it: half to even); one
    # torchvision would convert out of range, or of the wrong length, goes to torchvision, which refuses the latter
    ours, ref = RandAugment(fill=fill), v2.RandAugment(fill=fill)
    img = images(40, 56)["noise"]
    for op in GEOMETRIC:
        for m in magnitudes(op, 40, 56, n=4, seed=1):
            try:
                b = ref._apply_image_or_video_transform(img, op, m, "nearest", ref._fill)
            except ValueError as e:
                with pytest.raises(ValueError, match="fill"):
                    ours._apply_image_or_video_transform(img, op, m, "nearest", ours._fill)
                assert "fill" in str(e)
                continue
            assert torch.equal(ours._apply_image_or_video_transform(img, op, m, "nearest", ours._fill), b), (op, m)
    fast = fill in (0, 128, 127.5, 254.5, [10, 20, 30], (7.4,))
    assert bool(ours.source_maps) == fast


def geometry(op: str, m: float, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 (h, w) x, y: where output pixel (row j, column i) samples the input, in pixel units (pixel centres at
    integers), written out from each op's inverse map. torchvision's grid runs from -(w-1)/2 to (w-1)/2 about the
    image's centre and grid_sample (align_corners False) maps that back so that the centre is (w-1)/2; shears pivot
    on the top-left corner (torchvision's center [0, 0]), so a pixel centre's distance from it is j + 0.5:
    ShearX x = i + tan(atan m) (j + 0.5), ShearY y = j + m (i + 0.5); TranslateX x = i - int(m); Rotate by a
    degrees counter-clockwise about the centre: (x, y) - c = R(-a) applied in image axes (y down) to (i, j) - c."""
    j, i = np.mgrid[0:h, 0:w].astype(np.float64)
    if op == "ShearX":
        return i + math.tan(math.atan(m)) * (j + 0.5), j
    if op == "ShearY":
        return i, j + math.tan(math.atan(m)) * (i + 0.5)
    if op == "TranslateX":
        return i - int(m), j
    if op == "TranslateY":
        return i, j - int(m)
    a = math.radians(m)
    cx, cy = (w - 1) / 2, (h - 1) / 2
    return (cx + math.cos(a) * (i - cx) - math.sin(a) * (j - cy),
            cy + math.sin(a) * (i - cx) + math.cos(a) * (j - cy))


@pytest.mark.parametrize("size", [(224, 224), (37, 53)])
def test_source_maps_follow_the_geometry(size):
    # the map (1 + the flat source index, 0 outside) against round-half-to-even of the exact coordinates: equal
    # everywhere for translations (integers), and for shears and rotations everywhere but where a coordinate lies
    # within float32's error (a few ulps of the side: 1e-3 is far above it) of a .5 tie
    h, w = size
    ref = v2.RandAugment()
    for op in GEOMETRIC:
        for m in magnitudes(op, h, w, n=6, seed=3):
            got = source_map(lambda x: ref._apply_image_or_video_transform(x, op, m, "nearest", {"others": None}),
                             h, w).reshape(h, w)
            x, y = geometry(op, m, h, w)
            xi, yi = np.rint(x), np.rint(y)
            inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
            want = np.where(inside, yi * w + xi + 1, 0)
            tie = (np.abs(np.abs(x - np.floor(x)) - 0.5) < 1e-3) | (np.abs(np.abs(y - np.floor(y)) - 0.5) < 1e-3)
            if op.startswith("Translate"):
                assert not tie.any()
            assert np.array_equal(got[~tie], want[~tie]), (op, m)
            assert tie.mean() < 0.01, (op, m)


def test_draws_are_torchvisions_and_the_rng_ends_where_it_does():
    # the whole transform: the same ops and magnitudes drawn (torchvision's forward), equal output and RNG state
    ours, ref = RandAugment(num_ops=2, magnitude=7), v2.RandAugment(num_ops=2, magnitude=7)
    for size in [(224, 224), (64, 64), (37, 53)]:
        for kind, img in images(*size, seed=5).items():
            for seed in range(40):
                torch.manual_seed(seed)
                b = ref(img)
                state = torch.get_rng_state()
                torch.manual_seed(seed)
                a = ours(img)
                assert torch.equal(a, b) and type(a) is type(b), (size, kind, seed)
                assert torch.equal(torch.get_rng_state(), state)


def test_everything_else_goes_to_torchvision():
    # other interpolations, dtypes, batches, PIL images and the colour ops: torchvision's result, no map computed
    ours, ref = RandAugment(), v2.RandAugment()
    img = images(32, 48)["smooth"]
    cases = [(img, "Rotate", 11.0, "bilinear"), (img.float() / 255, "ShearX", 0.2, "nearest"),
             (img[None].expand(2, -1, -1, -1), "TranslateY", 5.0, "nearest"), (img, "Equalize", 0.0, "nearest"),
             (img, "Brightness", 0.3, "nearest"), (img, "Sharpness", -0.4, "nearest")]
    for x, op, m, how in cases:
        a = ours._apply_image_or_video_transform(x, op, m, how, ours._fill)
        b = ref._apply_image_or_video_transform(x, op, m, how, ref._fill)
        assert torch.equal(a, b), op
    pil = Image.fromarray(img.permute(1, 2, 0).numpy())
    a = ours._apply_image_or_video_transform(pil, "Rotate", 9.0, "nearest", ours._fill)
    b = ref._apply_image_or_video_transform(pil, "Rotate", 9.0, "nearest", ref._fill)
    assert isinstance(a, Image.Image) and np.array_equal(np.asarray(a), np.asarray(b))
    assert not ours.source_maps


def test_source_maps_are_bounded(monkeypatch):
    monkeypatch.setattr(randaug, "MAX_MAPS", 3)
    ours, ref = RandAugment(), v2.RandAugment()
    for k, w in enumerate(range(20, 27)):
        img = images(18, w, seed=k)["noise"]
        a = ours._apply_image_or_video_transform(img, "Rotate", 7.0, "nearest", ours._fill)
        assert torch.equal(a, ref._apply_image_or_video_transform(img, "Rotate", 7.0, "nearest", ref._fill))
        assert len(ours.source_maps) == min(k + 1, 3)
    assert [key[3] for key in ours.source_maps] == [24, 25, 26]  # the oldest went first


def test_albef_view_is_the_one_torchvisions_randaugment_gives():
    # train_transform(albef) with the trainer's RandAugment against the same transform with torchvision's: the same
    # views from the same seeds on photographs of several sizes, and the RNG where torchvision's leaves it
    ours = train_transform(64, (0.5,) * 3, (0.25,) * 3, augment="albef")
    assert type(ours.transforms[3]) is RandAugment
    ref = v2.Compose(ours.transforms[:3] + [v2.RandAugment(num_ops=2, magnitude=7)])
    rng = np.random.default_rng(0)
    for seed in range(60):
        w, h = [(120, 90), (90, 120), (77, 61)][seed % 3]
        photo = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) if seed % 2 else Image.fromarray(
            np.asarray(images(h, w, seed)["smooth"].permute(1, 2, 0)).copy())
        torch.manual_seed(seed)
        b = ref(photo)
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        a = ours(photo)
        assert a.dtype == torch.uint8 and torch.equal(a, b), seed
        assert torch.equal(torch.get_rng_state(), state), seed

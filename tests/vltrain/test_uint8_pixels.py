"""Training views cross the DataLoader queue and the host-to-device copy as uint8 and are normalised on the device:
the same pixels as the former float32 path in the workers, a quarter of its bytes."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vltrain.data.collate import Collate, to_device
from vltrain.data.samples import train_transform
from tests.vltrain.test_data import FakeTokenizer

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # CLIP's: the smallest std
SIZE = 48


def float_path(size, mean, std, min_scale=0.5, augment="none", interpolation="bilinear"):
    """train_transform as it was before the uint8 change: the same ops, then ToDtype + Normalize in the worker.
    softmask's jitter and blur are the trainer's (vltrain.data.colour, checked against torchvision's own in
    test_colour.py): this test is about where the dtype changes, so both paths run the same ops."""
    from torchvision.transforms import v2

    from vltrain.data.colour import ColorJitter, GaussianBlur

    if augment == "none":
        how = v2.InterpolationMode(interpolation)
        return v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True,
                                                              interpolation=how),
                           v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True,
                                                interpolation=v2.InterpolationMode.BICUBIC),
             v2.RandomHorizontalFlip(), v2.RandAugment(num_ops=2, magnitude=7)]
    if augment == "softmask":
        kernel = 2 * max(1, round(0.05 * size)) + 1
        steps += [v2.RandomApply([ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                  v2.RandomApply([GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5)]
    return v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def photo(seed: int, w: int = 120, h: int = 90) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    field = np.stack([128 + 90 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c + seed) for c in range(3)], -1)
    return Image.fromarray(np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))


def one_grey_level(values: torch.Tensor) -> torch.Tensor:
    """(3, 1, 1): one grey level after normalisation, 1 / 255 / std per channel, plus float32 rounding of the three
    ops (x / 255, - mean, / std: at most an ulp of the largest value each, |x| <= max |(0 or 1 - mean) / std|)."""
    std = torch.tensor(STD).view(3, 1, 1)
    return 1 / 255 / std + 3 * torch.finfo(torch.float32).eps * values.abs().max()


def batches(augment: str, seeds=range(12)) -> tuple[torch.Tensor, dict]:
    """The float path's views and the uint8 path's batch (through Collate and to_device) for the same seeds."""
    old, new = float_path(SIZE, MEAN, STD, augment=augment), train_transform(SIZE, MEAN, STD, augment=augment)
    ref, views = [], []
    for s in seeds:
        torch.manual_seed(s)
        ref.append(old(photo(s)))
        torch.manual_seed(s)
        views.append(new(photo(s)))
    collate = Collate(FakeTokenizer(), max_len=5, norm=new.norm)
    batch = collate([(v, "a caption", f"k{i}") for i, v in enumerate(views)])
    return torch.stack(ref), batch


@pytest.mark.parametrize("augment", ["none", "albef", "softmask"])
def test_uint8_views_normalised_on_the_device_match_the_float_path(augment):
    ref, batch = batches(augment)
    assert batch["images"].dtype == torch.uint8 and batch["pixel_norm"].shape == (2, 3)
    out = to_device(batch, torch.device("cpu"))
    assert "pixel_norm" not in out and out["images"].dtype == torch.float32
    assert ((out["images"] - ref).abs() <= one_grey_level(ref)).all()
    # every op already ran on uint8 (ToImage gives uint8; ToDtype came last), and to_device is ToDtype + Normalize
    # op for op: on one CPU the two paths are the same numbers, not merely within a grey level
    assert torch.equal(out["images"], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("augment", ["none", "softmask"])
def test_normalised_on_a_cuda_device_within_one_grey_level(augment):
    ref, batch = batches(augment)
    out = to_device(batch, torch.device("cuda"))
    assert out["images"].is_cuda and out["images"].dtype == torch.float32
    assert ((out["images"].cpu() - ref).abs() <= one_grey_level(ref)).all()


def test_a_quarter_of_the_bytes_through_collate():
    ref, batch = batches("none", seeds=range(4))
    per_sample = batch["images"].nbytes // len(batch["keys"])
    assert per_sample == 3 * SIZE * SIZE and ref.nbytes // len(ref) == 4 * per_sample


def test_float_and_feature_batches_pass_through():
    """Evaluation views (float) and cached tokens (features) are left as they were: no pixel_norm, no conversion;
    a float batch that carries pixel_norm (images swapped after Collate) is not normalised twice."""
    x = torch.randn(2, 3, 8, 8)
    b = Collate(FakeTokenizer(), max_len=5, norm=(MEAN, STD))([(x[0], "a", "k0"), (x[1], "b", "k1")])
    assert "pixel_norm" not in b and torch.equal(to_device(b, torch.device("cpu"))["images"], x)
    f = Collate(FakeTokenizer(), max_len=5, use_features=True)([(x[0, 0], "a", "k0"), (x[1, 0], "b", "k1")])
    assert "pixel_norm" not in f and torch.equal(to_device(f, torch.device("cpu"))["features"], x[:, 0])
    u8 = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    swapped = Collate(FakeTokenizer(), max_len=5, norm=(MEAN, STD))([(u8[0], "a", "k0"), (u8[1], "b", "k1")])
    swapped["images"] = x
    out = to_device(swapped, torch.device("cpu"))
    assert "pixel_norm" not in out and torch.equal(out["images"], x)


def test_uint8_without_a_normalisation_is_a_one_line_error():
    u8 = torch.zeros(3, 4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="norm=") as e:
        Collate(FakeTokenizer(), max_len=5)([(u8, "a", "k0")])
    assert "\n" not in str(e.value)

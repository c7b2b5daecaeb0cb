"""softmask's colour recipe with vltrain.data.colour's ops against torchvision's own, the reference: the hue shift
byte for byte, the blur within one grey level (and only where float32 rounding can decide it), the same draws from
torch's RNG, and the whole softmask view within one grey level of the one torchvision's ops give."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from vltrain.data.colour import (ColorJitter, GaussianBlur, adjust_hue_uint8, gaussian_blur_uint8,
                                 gaussian_kernel1d)
from vltrain.data.samples import train_transform

U = 2.0 ** -24  # float32's unit roundoff


def images(h: int, w: int, seed: int = 0) -> dict:
    """uint8 (3, h, w) images of every kind the recipe meets: noise, a smooth photograph-like field with grain, flat,
    saturated (every channel 0 or 255), grey (r = g = b), hard edges (a checkerboard of two colours) and the
    extremes 0 and 255 with ties between channels (the hue formula's branches)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w, 1)
    smooth = np.stack([128 + 100 * np.sin(2 * np.pi * (1.3 * x + 0.7 * y) + c) for c in range(3)])
    ties = rng.choice(np.array([0, 1, 127, 128, 254, 255]), (3, h, w))
    ties[1] = np.where(rng.random((h, w)) < 0.5, ties[0], ties[1])  # r == g in half the pixels
    board = ((np.arange(h)[:, None] // 3 + np.arange(w)[None] // 3) % 2).astype(bool)
    out = {"noise": rng.integers(0, 256, (3, h, w)),
           "smooth": np.clip(smooth + rng.normal(0, 12, (3, h, w)), 0, 255),
           "flat": np.broadcast_to(np.array([200, 40, 90])[:, None, None], (3, h, w)),
           "saturated": rng.choice(np.array([0, 255]), (3, h, w)),
           "grey": np.broadcast_to(rng.integers(0, 256, (1, h, w)), (3, h, w)),
           "edges": np.where(board, np.array([250, 20, 10])[:, None, None], np.array([5, 30, 240])[:, None, None]),
           "ties": ties}
    return {k: torch.from_numpy(np.ascontiguousarray(v).astype(np.uint8)) for k, v in out.items()}


SIZES = [(224, 224), (64, 64), (37, 61), (13, 12), (1, 1)]
HUES = [-0.5, -0.31, -0.1, -0.013, -1e-6, 0.0, 1e-6, 0.0999, 0.25, 0.5]


@pytest.mark.parametrize("size", SIZES)
def test_hue_shift_is_torchvisions_byte_for_byte(size):
    # the same float32 ops in the same order (see adjust_hue_uint8): equal, not merely close
    for kind, img in images(*size).items():
        for hue in HUES:
            assert torch.equal(adjust_hue_uint8(img, hue), F.adjust_hue(img, hue)), (kind, hue)


def test_hue_shift_at_every_step_of_the_factor():
    # a factor that brings a pixel's hue to 0 or 1 (the wrap-around of the remainder, h6 rounding up to 6): every
    # hue of a 1 / 360 grid against every factor of a 1 / 200 grid and a few next to them
    hues = np.linspace(0, 1, 360, endpoint=False)
    rgb = np.stack([np.clip(np.abs((hues * 6 + k) % 6 - 3) - 1, 0, 1) for k in (0, 4, 2)])  # the HSV wheel, s = v = 1
    rows = [255 * rgb, 60 + 140 * rgb, 90 * rgb]  # v 1, s 1; v 200 / 255, s 0.7; v 90 / 255, s 1
    img = torch.from_numpy(np.round(np.stack(rows, 1)).astype(np.uint8))  # (3, 3, 360)
    for hue in np.concatenate([np.linspace(-0.5, 0.5, 201), np.linspace(-0.5, 0.5, 201) + 1e-7])[:-1]:
        hue = float(np.clip(hue, -0.5, 0.5))
        assert torch.equal(adjust_hue_uint8(img, hue), F.adjust_hue(img, hue)), hue


def exact_blur(img: torch.Tensor, kx: np.ndarray, ky: np.ndarray) -> np.ndarray:
    """float64 (3, H, W): the blur's exact value with the float32 kernels, written out: reflect padding (the edge
    pixel not repeated, numpy's "reflect") and the sum over the (ky, kx) window of ky[i] kx[j] times the pixel."""
    a, b = len(ky) // 2, len(kx) // 2
    x = np.pad(img.numpy().astype(np.float64), ((0, 0), (a, a), (b, b)), mode="reflect")
    h, w = img.shape[1:]
    out = np.zeros((3, h, w))
    for i in range(len(ky)):
        for j in range(len(kx)):
            out += float(ky[i]) * float(kx[j]) * x[:, i:i + h, j:j + w]
    return out


def rounding_band(k: int) -> float:
    """How far a float32 blur can land from the exact value, in grey levels. A float32 sum of n products of weights
    >= 0 and pixels <= 255, each product and addition rounded, is within gamma_n = n u / (1 - n u) of the exact sum
    relative to the sum of the terms (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1: in any
    order, with or without FMA); that sum is at most 255 times the weights' sum, 1 within n u (the softmax's
    rounding). torchvision sums k^2 products whose weights were rounded once more (the outer product): gamma_(k^2+1);
    the separable blur two passes of k (k + 1 where OpenCV adds the symmetric pixel pairs first): gamma_(2k+2). Both
    are within gamma_(k^2+2) for k >= 2."""
    n = k * k + 2
    return n * U / (1 - n * U) * 255 * (1 + n * U)


@pytest.mark.parametrize("size", [(224, 224), (64, 64), (37, 61), (12, 15)])
def test_blur_is_within_one_grey_level_and_only_where_rounding_decides(size):
    """Both blurs round a float32 value within `rounding_band` of the exact one: where the exact value is further
    than that from a half, both are its rounding; elsewhere they may differ, by at most 1 (two values less than 1
    apart round to integers at most 1 apart). 12 x 15 is smaller than the 23-pixel kernel, the smallest torchvision's
    reflect padding allows (a side of at least 12)."""
    for kind, img in images(*size, seed=1).items():
        for k, sigma in ((3, 0.1), (7, 0.8), (23, 1.3), (23, 2.0), ((5, 9), (0.6, 1.7))):
            ks, ss = (list(k), list(sigma)) if isinstance(k, tuple) else ([k, k], [sigma, sigma])
            if ks[0] // 2 >= size[1] or ks[1] // 2 >= size[0]:
                continue
            ours, ref = gaussian_blur_uint8(img, ks, ss), F.gaussian_blur(img, ks, ss)
            assert ours.shape == ref.shape and ours.dtype == torch.uint8
            diff = (ours.int() - ref.int()).abs()
            assert diff.max() <= 1, (kind, k, sigma)
            exact = exact_blur(img, gaussian_kernel1d(ks[0], ss[0]), gaussian_kernel1d(ks[1], ss[1]))
            clear = np.abs(exact - np.floor(exact) - 0.5) > rounding_band(max(ks))
            expected = torch.from_numpy(np.rint(exact)).int()
            assert torch.equal(ours.int()[clear], expected[clear]), (kind, k, sigma)
            assert torch.equal(ref.int()[clear], expected[clear]), (kind, k, sigma)


def test_the_kernel_is_torchvisions():
    from torchvision.transforms.v2.functional._misc import _get_gaussian_kernel1d

    for k in (1, 3, 7, 23, 45):
        for sigma in (0.1, 0.77, 2.0):
            ref = _get_gaussian_kernel1d(k, sigma, torch.float32, torch.device("cpu"))
            assert torch.equal(torch.from_numpy(gaussian_kernel1d(k, sigma)), ref)


def view(seed: int, size: int = 96) -> tv_tensors.Image:
    """A uint8 RGB tv_tensors.Image as ToImage gives the recipe, a different kind of image per seed."""
    kinds = images(size, size + 7, seed)
    return tv_tensors.Image(list(kinds.values())[seed % len(kinds)])


def same_draws(ours, ref, inputs):
    """Each input through `ours` and `ref` from the same torch RNG state: the outputs (as uint8 ints) and whether
    the RNG state after each pair is the same (the same draws were made)."""
    out = []
    for i, x in enumerate(inputs):
        torch.manual_seed(i)
        a = ours(x)
        state = torch.get_rng_state()
        torch.manual_seed(i)
        b = ref(x)
        assert torch.equal(state, torch.get_rng_state()), i
        assert type(a) is type(b), i
        out.append((a, b))
    return out


def test_color_jitter_is_torchvisions_draws_and_bytes():
    jitters = (ColorJitter(0.4, 0.4, 0.4, 0.1), v2.ColorJitter(0.4, 0.4, 0.4, 0.1))
    for a, b in same_draws(*jitters, [view(s) for s in range(40)]):
        assert isinstance(a, tv_tensors.Image) and torch.equal(a, b)
    # hue only, the full range, on plain tensors: plain tensors back
    jitters = (ColorJitter(hue=0.5), v2.ColorJitter(hue=0.5))
    for a, b in same_draws(*jitters, [view(s).as_subclass(torch.Tensor) for s in range(20)]):
        assert type(a) is torch.Tensor and torch.equal(a, b)


def test_blur_transform_is_torchvisions_draws_within_one_grey_level():
    blurs = (GaussianBlur(23, sigma=(0.1, 2.0)), v2.GaussianBlur(23, sigma=(0.1, 2.0)))
    for a, b in same_draws(*blurs, [view(s) for s in range(20)]):
        assert isinstance(a, tv_tensors.Image) and (a.int() - b.int()).abs().max() <= 1


def test_other_inputs_go_to_torchvision():
    """PIL images, float images, batches and images torchvision's padding refuses take torchvision's own kernels:
    the same result, or the same refusal."""
    rng = np.random.default_rng(3)
    pil = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    flt = torch.rand(3, 40, 50)
    batch = torch.from_numpy(rng.integers(0, 256, (2, 3, 40, 50), dtype=np.uint8))
    for ours, ref in ((ColorJitter(0.4, 0.4, 0.4, 0.1), v2.ColorJitter(0.4, 0.4, 0.4, 0.1)),
                      (GaussianBlur(9, sigma=(0.1, 2.0)), v2.GaussianBlur(9, sigma=(0.1, 2.0)))):
        for (a, b) in same_draws(ours, ref, [pil, flt, batch]):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    small = tv_tensors.Image(torch.zeros(3, 11, 40, dtype=torch.uint8))  # 23 // 2 = 11: too small to reflect
    for blur in (GaussianBlur(23), v2.GaussianBlur(23)):
        with pytest.raises(RuntimeError):
            blur(small)


def torchvision_softmask(size: int, mean, std):
    """train_transform(augment="softmask") written out with torchvision's own jitter and blur: the reference."""
    kernel = 2 * max(1, round(0.05 * size)) + 1
    return v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True,
                                                          interpolation=v2.InterpolationMode.BICUBIC),
                       v2.RandomHorizontalFlip(), v2.RandAugment(num_ops=2, magnitude=7),
                       v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                       v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5)])


@pytest.mark.parametrize("size,n", [(224, 24), (64, 60)])
def test_softmask_views_within_one_grey_level_of_torchvisions_with_the_same_draws(size, n):
    """The jitter is byte for byte and the blur comes last, so a view differs from torchvision's only by the blur's
    rounding: at most 1 grey level; and every call makes the same draws (torch's RNG state after it is the same)."""
    mean, std = (0.5,) * 3, (0.25,) * 3
    ours, ref = train_transform(size, mean, std, augment="softmask"), torchvision_softmask(size, mean, std)
    assert [repr(t) for t in ours.transforms] == [repr(t) for t in ref.transforms]
    rng = np.random.default_rng(size)
    photos = []
    for i in range(n):
        kinds = images(int(rng.integers(size, 2 * size)), int(rng.integers(size, 2 * size)), seed=i)
        photos.append(Image.fromarray(list(kinds.values())[i % len(kinds)].permute(1, 2, 0).numpy()))
    for a, b in same_draws(ours, ref, photos):
        assert a.shape == (3, size, size) and a.dtype == torch.uint8
        assert (a.int() - b.int()).abs().max() <= 1

"""TCL's colour recipe (softmask's MMDA) on uint8 views at a fraction of torchvision's CPU cost: ColorJitter and
GaussianBlur subclassed, torchvision's own parameter draws (`make_params`, same RNG calls in the same order), only
how the hue shift and the blur are applied changed. The hue shift gives torchvision's bytes exactly; the blur is
within one grey level of it (float32 sums in another order before the rounding)."""

import cv2
import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

F32 = np.float32
# torchvision's float -> uint8 rule (to_dtype_image): x * (255 + 1 - 1e-3), truncated; not rounding
TO_UINT8 = F32(255 + 1.0 - 1e-3)
# hsv -> rgb: which of (v, p, q, t) each channel takes in each of the six hue sectors (torchvision's `select`)
SECTORS = (("v", "q", "p", "p", "t", "v"), ("t", "v", "v", "q", "p", "p"), ("p", "p", "t", "v", "v", "q"))


def _rgb_uint8(inpt) -> bool:
    """Whether `inpt` is what the fast paths take: one RGB image, a CPU uint8 (3, H, W) tensor or tv_tensors.Image;
    anything else (PIL, float, a batch, a video, a box) goes to torchvision's own kernel."""
    return (type(inpt) in (torch.Tensor, tv_tensors.Image) and inpt.dtype == torch.uint8 and inpt.ndim == 3
            and inpt.shape[0] == 3 and inpt.device.type == "cpu")


def _like(out: torch.Tensor, inpt):
    """`out` in `inpt`'s type: a tv_tensors.Image stays one, as torchvision's registered kernels return it."""
    return tv_tensors.wrap(out, like=inpt) if isinstance(inpt, tv_tensors.TVTensor) else out


def adjust_hue_uint8(image: torch.Tensor, hue_factor: float) -> torch.Tensor:
    """uint8 (3, H, W) RGB -> uint8 (3, H, W): torchvision's adjust_hue on uint8, byte for byte.

    The same float32 arithmetic as torchvision's `_rgb_to_hsv`, hue shift and `_hsv_to_rgb`, op for op and in the
    same order, so every rounding is the same (IEEE float32 add, subtract, multiply and divide are correctly
    rounded in numpy as in torch); what changes is everything around it, which is where torchvision spends its
    time: numpy's ufuncs on (H, W) planes instead of torch ops on stacked tensors, aminmax over the channel axis
    replaced by two maximum/minimum (exact), the masked sum of the three hue terms kept as torchvision writes it,
    fmod and remainder by 1 replaced by the subtraction or addition of 1 they come to on these ranges, and the
    int64 index and gather that pick (v, p, q, t) per channel replaced by byte masks on the four planes already
    converted to uint8 (conversion and selection commute). 0.75-0.87 ms against 3.1-3.3 ms at 224 px
    (benchmarks/colour.py).
    """
    x = image.numpy().astype(F32)
    x *= F32(1.0 / 255)  # to_dtype_image(uint8 -> float32): x.to(float32).mul_(1 / 255)
    r, g, b = x
    maxc = np.maximum(np.maximum(r, g), b)
    minc = np.minimum(np.minimum(r, g), b)
    span = maxc - minc
    eqc = span == 0
    # torchvision divides by 1 where max == min; adding the 0/1 mask is that divisor, exactly (span is 0 there)
    s = span / (maxc + eqc)
    div = span + eqc
    rc, gc, bc = (maxc - r) / div, (maxc - g) / div, (maxc - b) / div
    eq_r = maxc == r
    eq_g = (maxc == g) & ~eq_r
    eq_b = ~(eq_r | eq_g)
    # hr + hg + hb with two of them multiplied by 0: torchvision's own sum, in its order
    h = ((bc - gc) * eq_r + ((rc + F32(2.0)) - bc) * eq_g) + ((gc + F32(4.0)) - rc) * eq_b
    h *= F32(1.0 / 6.0)
    h += F32(1.0)
    h -= h >= 1  # fmod(h, 1) on [0, 2]: h - 1, exact there (Sterbenz)
    h += F32(hue_factor)
    # remainder(h, 1) on [-0.5, 1.5]: torch's fmod (h - 1 from 1 up, exact), then + 1 where that is negative,
    # rounded as torch rounds it (a tiny negative h gives 1.0, as there)
    negative = h < 0
    h -= h >= 1
    h += negative
    h6 = h * F32(6.0)
    i = np.floor(h6)
    f = h6 - i
    sxf = s * f
    one_minus_s = F32(1.0) - s
    planes = {"v": maxc,
              "q": np.clip((F32(1.0) - sxf) * maxc, 0.0, 1.0),
              "t": np.clip((sxf + one_minus_s) * maxc, 0.0, 1.0),
              "p": np.clip(one_minus_s * maxc, 0.0, 1.0)}
    planes = {k: (z * TO_UINT8).astype(np.uint8) for k, z in planes.items()}
    sector = i.astype(np.uint8)
    sector[sector == 6] = 0  # i.remainder_(6): h6 can round up to 6
    masks = []
    for k in range(6):
        m = (sector == k).view(np.uint8)
        masks.append(np.negative(m, out=m))  # 1 -> 255: a byte mask
    out = np.zeros(image.shape, np.uint8)
    for c, row in enumerate(SECTORS):
        for name, plane in planes.items():
            m = [masks[k] for k in range(6) if row[k] == name]  # the one or two sectors where c takes this plane
            out[c] |= plane & (m[0] if len(m) == 1 else m[0] | m[1])
    return torch.from_numpy(out)


def gaussian_kernel1d(size: int, sigma: float) -> np.ndarray:
    """float32 (size,): torchvision's 1-D Gaussian kernel (`_get_gaussian_kernel1d`), the same torch calls, so the
    same numbers: softmax of -(x / sigma)^2 over `size` points evenly spaced on +-(size - 1) / (2 sqrt 2)."""
    lim = (size - 1) / (2.0 * 2.0 ** 0.5)
    x = torch.linspace(-lim, lim, steps=size, dtype=torch.float32)
    return torch.softmax(x.div(sigma).pow(2).neg(), dim=0).numpy()


def gaussian_blur_uint8(image: torch.Tensor, kernel_size, sigma) -> torch.Tensor:
    """uint8 (C, H, W) -> uint8 (C, H, W): torchvision's gaussian_blur on uint8 within one grey level, separably.

    torchvision convolves with the (ky, kx) kernel, the outer product of two 1-D kernels, in float32 with reflect
    padding, then rounds (half to even). The same blur as two 1-D passes costs 2k instead of k^2 multiply-adds a
    pixel: OpenCV's sepFilter2D on float32 planes with BORDER_REFLECT_101 (torch's "reflect": the edge pixel not
    repeated), then the same rounding. OpenCV rather than torch's conv2d with (1, k) and (k, 1) kernels: 0.6 ms
    against 3.0 ms a 224 px view at k = 23 (torchvision's 2-D conv: 9-11 ms); it runs on the calling thread (no
    parallel loop in this filter: the same time with cv2.setNumThreads(1)). Each float32 sum of non-negative terms
    is within gamma_n = n u / (1 - n u) (u = 2^-24) of the exact value times 255: n = k^2 = 529 for torchvision's,
    0.008 grey levels, 2k for this one; two values less than 1 apart round to integers at most 1 apart, and they
    differ at all only where the exact value lies within 0.008 of a half.
    """
    kx = gaussian_kernel1d(kernel_size[0], sigma[0])
    ky = gaussian_kernel1d(kernel_size[1], sigma[1])
    x = image.numpy().astype(F32)
    out = np.empty_like(x)
    for c, plane in enumerate(x):  # a contiguous plane at a time: no interleaved (H, W, C) copy
        out[c] = cv2.sepFilter2D(plane, cv2.CV_32F, kx, ky, borderType=cv2.BORDER_REFLECT_101)
    return torch.from_numpy(np.rint(out, out=out).astype(np.uint8))


class ColorJitter(v2.ColorJitter):
    """torchvision's ColorJitter (its draws, its random order of the four ops, its brightness, contrast and
    saturation kernels) with the hue shift of a uint8 RGB image done by `adjust_hue_uint8`: the same bytes; the hue
    shift was 3.1-3.3 of the jitter's 4.4-4.7 ms at 224 px, now 0.75-0.87 of 2.0-2.3 (benchmarks/colour.py)."""

    def transform(self, inpt, params: dict):
        if params["hue_factor"] is None or not _rgb_uint8(inpt):
            return super().transform(inpt, params)
        output = inpt
        for fn_id in params["fn_idx"]:  # v2.ColorJitter.transform's loop, hue taken out
            if fn_id == 0 and params["brightness_factor"] is not None:
                output = self._call_kernel(F.adjust_brightness, output, brightness_factor=params["brightness_factor"])
            elif fn_id == 1 and params["contrast_factor"] is not None:
                output = self._call_kernel(F.adjust_contrast, output, contrast_factor=params["contrast_factor"])
            elif fn_id == 2 and params["saturation_factor"] is not None:
                output = self._call_kernel(F.adjust_saturation, output, saturation_factor=params["saturation_factor"])
            elif fn_id == 3:
                output = _like(adjust_hue_uint8(output.as_subclass(torch.Tensor), params["hue_factor"]), inpt)
        return output


class GaussianBlur(v2.GaussianBlur):
    """torchvision's GaussianBlur (its sigma draw) with the blur of a uint8 RGB image done separably by
    `gaussian_blur_uint8`: within one grey level, 9-10x faster at 224 px with a 23-pixel kernel (1.0 against
    9.4-9.6 ms a call, benchmarks/colour.py). An image
    torchvision's reflect padding refuses (a side not longer than half the kernel) goes to torchvision, which
    refuses it."""

    def transform(self, inpt, params: dict):
        kx, ky = self.kernel_size
        if not _rgb_uint8(inpt) or kx // 2 >= inpt.shape[-1] or ky // 2 >= inpt.shape[-2]:
            return super().transform(inpt, params)
        return _like(gaussian_blur_uint8(inpt.as_subclass(torch.Tensor), self.kernel_size, params["sigma"]), inpt)

"""albef's RandAugment on uint8 views at a fraction of torchvision's CPU cost for its five geometric ops: torchvision's
v2.RandAugment subclassed, its own draws (op, magnitude, sign: the same RNG calls in the same order, its `forward`
untouched), and ShearX, ShearY, TranslateX, TranslateY and Rotate with NEAREST interpolation applied as a gather of
uint8 pixels through a map of source pixels that torchvision's own kernel computes once per (op, signed magnitude,
image size). The same bytes as torchvision's, on any CPU, by construction."""

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
# source maps a transform keeps: 10 for albef (five ops, two signs, one view size); the bound only matters for
# images of many sizes, where the oldest map is dropped
MAX_MAPS = 64
# the map is sampled from a float32 image of pixel numbers, exact while every number is below 2^24
MAX_PIXELS = 2 ** 24 - 1


def source_map(apply, h: int, w: int) -> np.ndarray:
    """intp (h * w,): for each output pixel of the geometric op `apply` (float32 (1, h, w) -> float32 (1, h, w),
    torchvision's kernel with NEAREST interpolation and fill None), 1 + the flat index of the input pixel it copies,
    or 0 where it copies none (outside the image).

    The op is run on an image whose every pixel holds 1 + its own flat index: nearest sampling copies a value
    without arithmetic (float32 holds these integers exactly) and zero padding gives 0 outside, so the output is the
    source of each pixel as torchvision's grid (`_affine_grid`'s bmm) and grid_sample's unnormalise-and-round (half
    to even) find it, ties and last-bit rounding included, whatever BLAS and vector unit computed them.
    """
    numbers = torch.arange(1, h * w + 1, dtype=torch.float32).view(1, h, w)
    return apply(numbers).reshape(-1).numpy().astype(np.intp)


def gather_uint8(image: torch.Tensor, sources: np.ndarray, fill: np.ndarray) -> torch.Tensor:
    """uint8 (C, H, W) -> uint8 (C, H, W): out[c, p] = image[c].flat[sources[p] - 1], or fill[c] where sources[p] is
    0 (`source_map`'s numbering): one np.take over the pixels with the fill prepended as pixel 0."""
    c, h, w = image.shape
    table = np.empty((c, h * w + 1), np.uint8)
    table[:, 0] = fill
    table[:, 1:] = image.numpy().reshape(c, h * w)
    return torch.from_numpy(np.take(table, sources, axis=1).reshape(c, h, w))


def fill_bytes(fill, channels: int) -> np.ndarray | None:
    """uint8 (channels,): what torchvision's grid transform writes outside the image of a uint8 image with NEAREST
    interpolation: 0 for fill None (zero padding), else each fill value as float32 rounded half to even
    (`round_().to(uint8)`); None (torchvision decides, and refuses a bad length) unless every value is a number in
    [0, 255] and there are 1 or `channels` of them."""
    if fill is None:
        return np.zeros(channels, np.uint8)
    values = [fill] if isinstance(fill, (int, float)) else list(fill)
    if len(values) not in (1, channels) or not all(isinstance(v, (int, float)) and 0 <= v <= 255 for v in values):
        return None
    return np.broadcast_to(np.rint(np.asarray(values, np.float32)), (channels,)).astype(np.uint8)


def gatherable(image, interpolation) -> bool:
    """Whether `image` is what the gather takes: one CPU uint8 (C, H, W) tensor or tv_tensors.Image, of at most
    MAX_PIXELS pixels, sampled NEAREST; anything else (PIL, float, a batch, a video, bilinear) goes to torchvision."""
    return (interpolation in (v2.InterpolationMode.NEAREST, "nearest")
            and type(image) in (torch.Tensor, tv_tensors.Image) and image.dtype == torch.uint8 and image.ndim == 3
            and image.device.type == "cpu"
            and 0 < image.shape[-1] * image.shape[-2] <= MAX_PIXELS)


class RandAugment(v2.RandAugment):
    """torchvision's RandAugment (its op set, its draws, its other nine ops) with the five geometric ops of a CPU
    uint8 (C, H, W) image and NEAREST interpolation (RandAugment's default) applied by `gather_uint8`: the same bytes.

    torchvision applies each by building a float32 sampling grid (0.6 of the 1.0 ms a call takes at 224 px, most
    of it a (H W, 3) x (3, 2) bmm) and grid-sampling a float copy of the image (about 0.25 ms with the
    conversions). With
    magnitude fixed, an op's grid depends only on the op, the magnitude's sign and the image size: albef's views
    need ten. So the source of every output pixel is computed once by torchvision's own kernel (`source_map`) and
    kept in `self.source_maps` (per transform object, so per loader worker; at most MAX_MAPS of them, 0.4 MB each
    at 224 px), and each later call is a gather of uint8 bytes: 0.14 ms against torchvision's 0.98-1.00 ms, and
    RandAugment(2, 7) 1.07 against 1.62 ms a view (benchmarks/randaug.py; the first call at a new op, sign and size
    costs what torchvision's does).
    Everything else (the other ops, other dtypes, batches, PIL images, other interpolations, a fill torchvision
    would convert oddly) goes to torchvision unchanged.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.source_maps: dict[tuple, np.ndarray] = {}

    def _apply_image_or_video_transform(self, image, transform_id: str, magnitude: float, interpolation, fill):
        if transform_id not in GEOMETRIC or not gatherable(image, interpolation):
            return super()._apply_image_or_video_transform(image, transform_id, magnitude, interpolation, fill)
        # torchvision's lookup of the fill for this input type (`_get_fill`)
        fill_ = fill[type(image)] if type(image) in fill else fill.get("others")
        outside = fill_bytes(fill_, image.shape[0])
        if outside is None:
            return super()._apply_image_or_video_transform(image, transform_id, magnitude, interpolation, fill)
        h, w = image.shape[-2:]
        key = (transform_id, magnitude, h, w)
        sources = self.source_maps.get(key)
        if sources is None:
            def apply(numbers):  # torchvision's own op, its arguments from the same magnitude, on the numbers
                return super(RandAugment, self)._apply_image_or_video_transform(
                    numbers, transform_id, magnitude, interpolation, {"others": None})

            sources = source_map(apply, h, w)
            if len(self.source_maps) >= MAX_MAPS:
                del self.source_maps[next(iter(self.source_maps))]  # the oldest
            self.source_maps[key] = sources
        out = gather_uint8(image.as_subclass(torch.Tensor), sources, outside)
        return tv_tensors.wrap(out, like=image) if isinstance(image, tv_tensors.TVTensor) else out

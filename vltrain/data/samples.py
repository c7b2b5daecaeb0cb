"""One sample decoded: captions, `npy` tokens, image transforms, bad-sample counts, worker seeds."""

import functools
import hashlib
import io
import json
import random
import warnings
from typing import NamedTuple

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from vlprep.dataset import decode_rgb, image_ext


# RandomResizedCrop's default aspect ratios: the crops the draft rule allows for
CROP_RATIO = (3 / 4, 4 / 3)
DRAFT_SCALES = (8, 4, 2)


def draft_scale(width: int, height: int, size: int, min_scale: float) -> int:
    """The JPEG DCT scale k (1, 2, 4 or 8) a width x height image can be decoded at for RandomResizedCrop(size,
    scale=(min_scale, 1), ratio=(3/4, 4/3)): the largest k at which every crop the transform can draw from the
    ceil(width / k) x ceil(height / k) draft still has `size` pixels or more per side, so no crop is upsampled.

    On a w x h draft a crop of area fraction s and aspect ratio r is sqrt(s r w h) x sqrt(s w h / r) (before
    rounding), and fits when it lies inside the image; after ten draws that do not fit torchvision takes the centre
    crop of ratio clamped to 3/4..4/3, whose short side is min(w, h). The shortest side is therefore
    min(min(w, h), sqrt(min_scale * 3/4 * w * h)) (s = min_scale, r = 3/4 or 4/3, whichever fits the image's
    orientation; the centre crop when it does not fit): k is safe when both are >= size. With min_scale above 3/4
    the extreme crop may not fit a near-square image, and the rule is then a lower bound (it never picks a larger k
    than the exact one).
    """
    for k in DRAFT_SCALES:
        w, h = -(-width // k), -(-height // k)
        if min(w, h) >= size and min_scale * CROP_RATIO[0] * w * h >= size * size:
            return k
    return 1


def train_transform(size: int, mean, std, min_scale: float = 0.5, augment: str = "none",
                    interpolation: str = "bilinear", decode: str = "cpu") -> "v2.Compose | DeviceView":
    """Training view of an image, uint8 (3, size, size): augment none (crop at scale min_scale..1 + flip, resized with
    `interpolation`, the model's: bicubic for a CLIP tower), albef or softmask (MMDA).

    albef is ALBEF's pre-training recipe: crop at scale 0.2..1, flip, RandAugment with 2 ops at magnitude 7
    (torchvision's op set and draws, not ALBEF's hand-written one; its shears, translations and rotation gather uint8
    pixels through source maps torchvision's kernel computes once, `vltrain.data.randaug`: the same bytes).
    softmask adds TCL's colour recipe, which SoftMask++'s MMDA takes: ColorJitter(0.4, 0.4, 0.4, 0.1) at p 0.8,
    grayscale at p 0.2, Gaussian blur (sigma 0.1..2) at p 0.5; torchvision's transforms and draws, with the hue
    shift and the blur computed faster (`vltrain.data.colour`: the same bytes for the jitter, within one grey level
    for the blur).

    Every op runs on uint8 (as it always did: ToImage gives uint8), and the view stays uint8 through the DataLoader
    queue and the host-to-device copy, a quarter of float32's bytes: `.norm` is the (mean, std) that `Collate` puts
    on the batch and `to_device` applies there, (x / 255 - mean) / std. `.draft` (width, height) -> k is the JPEG
    draft scale the crop allows (`draft_scale`), for `decode_rgb`.

    decode gpu (augment none only: `resolve` refuses the others) gives a `DeviceView`, which ships a JPEG's bytes
    with the crop and flip drawn here, for `decode_on_device` to finish on the run's device.
    """
    # imported here: `import torchvision` loads its models and, through them, torch._dynamo (about 3 s), which a run
    # on cached features, an evaluation or `vltrain --help` never needs
    from torchvision.transforms import v2

    if augment == "none":
        how = v2.InterpolationMode(interpolation)
        steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True, interpolation=how),
                 v2.RandomHorizontalFlip()]
    else:
        # torchvision's RandAugment with its draws, the five geometric ops a gather of uint8 pixels through source
        # maps its own kernel computes once: the same bytes at a seventh of the cost (vltrain.data.randaug)
        from vltrain.data.randaug import RandAugment

        min_scale = 0.2
        steps = [v2.ToImage(), v2.RandomResizedCrop(size, scale=(min_scale, 1.0), antialias=True,
                                                    interpolation=v2.InterpolationMode.BICUBIC),
                 v2.RandomHorizontalFlip(), RandAugment(num_ops=2, magnitude=7)]
    if augment == "softmask":
        # torchvision's ColorJitter and GaussianBlur with their draws, the hue shift (same bytes) and the blur (within
        # a grey level, separable) computed faster: the recipe at about a quarter of the CPU time (vltrain.data.colour)
        from vltrain.data.colour import ColorJitter, GaussianBlur

        kernel = 2 * max(1, round(0.05 * size)) + 1  # SimCLR's blur kernel: about a tenth of the image side, odd
        steps += [v2.RandomApply([ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), v2.RandomGrayscale(p=0.2),
                  v2.RandomApply([GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5)]
    tf = v2.Compose(steps)
    tf.norm = (tuple(float(m) for m in mean), tuple(float(s) for s in std))
    tf.draft = functools.partial(draft_scale, size=size, min_scale=min_scale)
    if decode == "gpu":
        if augment != "none":  # resolve.check_gpu_decode's line: whichever of the two a caller meets first
            raise ValueError(gpu_augment_refusal(augment))
        return DeviceView(tf, steps[1])
    return tf


def gpu_augment_refusal(augment: str) -> str:
    """The one line that refuses data.decode gpu with an augmentation the device cannot match per sample."""
    return (f"data.decode=gpu matches data.augment=none only (a crop and flip drawn per sample on the loader); "
            f"data.augment={augment} draws its ops per sample, which a batch transform on the device cannot repeat: "
            "use data.decode=cpu (the albef and softmask presets set it)")


class JpegView(NamedTuple):
    """A training view the device finishes (data.decode gpu): the JPEG's bytes (uint8 (N,)), the RandomResizedCrop
    box (top, left, height, width) in the full-size image and the flip, both drawn on the loader worker, and the
    view's side and interpolation."""

    data: torch.Tensor
    box: tuple[int, int, int, int]
    flip: bool
    size: int
    interpolation: str


# JPEG colour modes the device decodes as the worker would: PIL and torchvision both give RGB from these (grey
# replicated); a CMYK / YCCK JPEG converts by PIL's own formula, so it stays on the worker with the other formats
WIRE_MODES = ("RGB", "L")


class DeviceView:
    """augment none with data.decode gpu: a JPEG member -> JpegView, its crop box and flip drawn by the very
    transforms of the CPU view (`cpu`, a train_transform) from the same RNG, in the same order, at the size the
    JPEG's header gives (no draft: the device decodes in full); any other member (PNG, a CMYK JPEG) -> the CPU
    view's uint8 (3, size, size), decoded here as with decode cpu. `.norm` as the CPU view's."""

    def __init__(self, cpu, crop):
        self.cpu, self.crop = cpu, crop  # crop: the CPU view's v2.RandomResizedCrop, whose make_params draws the box
        self.norm, self.draft = cpu.norm, None
        self.size, self.interpolation = crop.size[0], crop.interpolation.value

    def __call__(self, image):
        """A decoded image (a non-JPEG member): the CPU view of it."""
        return self.cpu(image)

    def ship(self, data: bytes):
        """A member's bytes -> JpegView, or the CPU view's uint8 tensor when it is not an RGB / grey JPEG."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # the header only: size and mode, no pixels decoded
        if im.format != "JPEG" or im.mode not in WIRE_MODES:
            return self.cpu(decode_rgb(data))
        p = self.crop.make_params([im])  # the draws RandomResizedCrop makes on the decoded image of this size
        flip = bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip(p=0.5): flips unless torch.rand(1) >= p
        box = (p["top"], p["left"], p["height"], p["width"])
        return JpegView(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip, self.size,
                        self.interpolation)


def decode_view(data: bytes, draft=None) -> "torch.Tensor | Image.Image":
    """A training view's image: an RGB or grey JPEG decoded at full size -> uint8 (3, H, W), a view of the (H, W, 3)
    array libjpeg-turbo wrote through simplejpeg; anything else (another format, CMYK, a JPEG the draft shrinks,
    see `draft_scale`) -> `decode_rgb`'s PIL image.

    The pixels are PIL's: both run libjpeg-turbo's default decode (accurate integer IDCT, fancy upsampling), grey
    replicated into RGB, no EXIF turn, and the transforms see the same (3, H, W) uint8 strides that ToImage gives a
    PIL image. What is saved is PIL's decode into its own buffer and ToImage's copy out of it: decode plus crop
    1.33x (500x375) and 1.30x (640x480) faster in CPU time (benchmarks/decode.py). Decoding is strict: any libjpeg warning (corrupt
    or truncated data), where PIL may still give an image or raise, hands the bytes to PIL, which decides as before;
    so a sample is skipped exactly when it was, and libjpeg prints nothing.
    """
    with warnings.catch_warnings():
        # decode_rgb's rule: Pillow's bomb check on the header's size (a refusal above 179M pixels is a skip)
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        im = Image.open(io.BytesIO(data))  # the header only: format, size and mode, no pixels decoded
    if im.format == "JPEG" and im.mode in WIRE_MODES and (draft is None or draft(*im.size) == 1):
        try:
            return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)).permute(2, 0, 1)
        except ValueError:  # a libjpeg warning or error: PIL's decode below keeps or skips the sample as it always did
            pass
    return decode_rgb(data, draft)


def decode_on_device(data: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int,
                     interpolation: str, device: torch.device) -> torch.Tensor:
    """JPEG bytes (CPU uint8 tensors, n of them), boxes (n, 4) (top, left, height, width) and flips (n,) -> the uint8
    views (n, 3, size, size) on `device`: decoded there in one batch (nvjpeg on CUDA, libjpeg on a CPU), each box
    cropped and resized by torchvision's resized_crop with antialias as RandomResizedCrop does, then flipped."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 marks its image IO deprecated, each call
        images = decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device)
    how = InterpolationMode(interpolation)
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for i, (im, (top, left, h, w), flip) in enumerate(zip(images, boxes.tolist(), flips.tolist())):
        view = F.resized_crop(im, top, left, h, w, [size, size], interpolation=how, antialias=True)
        out[i] = F.horizontal_flip(view) if flip else view
    return out


class BadSample(ValueError):
    """A sample that cannot be used, with the reason it is counted under (one of LoadCounts.REASONS)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class LoadCounts:
    """Samples read and samples skipped as bad (by reason), summed over the main process and DataLoader workers.

    The counts live in a shared-memory tensor with one row per worker (no locks needed): workers are new
    processes every epoch, and only shared memory carries their counts back to the training loop.
    """

    SLOTS = 65
    # Why a sample was skipped: an image, caption or other member that does not decode, and the `npy` checks of
    # `load_tokens`. Column 0 of the counts is the samples read, column 1 + i the samples skipped for REASONS[i].
    REASONS = ("undecodable", "npy_missing", "npy_unreadable", "npy_dtype", "npy_shape", "npy_nonfinite")
    # Reading shards, apart from samples: retried remote reads (vlprep.objstore) and shards left out as unreadable.
    IO = ("read_retries", "shards_skipped")

    def __init__(self):
        self.counts = torch.zeros((self.SLOTS, 1 + len(self.REASONS)), dtype=torch.int64).share_memory_()
        self.io = torch.zeros((self.SLOTS, len(self.IO)), dtype=torch.int64).share_memory_()

    @staticmethod
    def _slot() -> int:
        info = get_worker_info()
        return 0 if info is None else 1 + info.id % (LoadCounts.SLOTS - 1)

    def add(self, read: int, bad: int, reason: str = "undecodable") -> None:
        slot = self._slot()
        self.counts[slot, 0] += read
        self.counts[slot, 1 + self.REASONS.index(reason)] += bad

    def retry(self) -> None:
        """A remote read that failed transiently and is tried again."""
        self.io[self._slot(), 0] += 1

    def skip_shard(self) -> None:
        self.io[self._slot(), 1] += 1

    def io_totals(self) -> dict[str, int]:
        """{'read_retries': n, 'shards_skipped': m} over the main process and the loader workers."""
        return {k: int(v) for k, v in zip(self.IO, self.io.sum(dim=0).tolist())}

    def totals(self) -> tuple[int, int]:
        """(samples read, of which skipped as bad)."""
        total = self.counts.sum(dim=0)
        return int(total[0]), int(total[1:].sum())

    def reasons(self) -> dict[str, int]:
        """The skipped samples by reason, the reasons that occurred only."""
        total = self.counts.sum(dim=0)[1:].tolist()
        return {r: int(n) for r, n in zip(self.REASONS, total) if n}

    def skipped(self) -> dict:
        """{'count': skipped samples, 'reasons': {reason: count}}, as eval.json and the held-out results carry it."""
        return {"count": self.totals()[1], "reasons": self.reasons()}


def skip_reason(e: Exception) -> str:
    return e.reason if isinstance(e, BadSample) else "undecodable"


def loader_error(e: Exception) -> Exception:
    """The one line a DataLoader worker's exception had there (torch prefixes its text with the worker traceback)."""
    text = str(e)
    if "Original Traceback" not in text:
        return e
    last = text.strip().splitlines()[-1]  # "vlprep.dataset.BadShardError: the message"
    _, sep, msg = last.partition(": ")
    try:
        return type(e)(msg) if sep else e
    except TypeError:
        return e


def sample_captions(raw: dict) -> list[str]:
    """Every caption of a raw sample: `json.captions` of a multi-caption sample (docs/FORMAT.md), else [txt]."""
    text = raw["txt"].decode("utf-8")
    meta = raw.get("json")
    if not meta or b'"captions"' not in meta:  # most samples have one caption: no json parse for them
        return [text]
    captions = json.loads(meta).get("captions")
    if captions is None:  # the bytes only mentioned "captions" somewhere else
        return [text]
    if not isinstance(captions, list) or not captions or not all(isinstance(c, str) and c for c in captions):
        raise ValueError(f"sample {raw.get('__key__')}: json.captions is not a list of captions")
    return captions


def drawn_caption(captions: list[str], seed: int, epoch: int, key: str) -> str:
    """The caption a multi-caption sample trains on in an epoch: a function of (seed, epoch, key) only, so every
    worker, rank and resumed run draws the same one, and each epoch may draw another (ALBEF trains on them all)."""
    if len(captions) == 1:
        return captions[0]
    h = hashlib.blake2b(f"caption:{seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return captions[int.from_bytes(h, "big") % len(captions)]


# Which caption(s) load_sample returns: "first" (txt), "all" (a tuple, for evaluation) or (seed, epoch) to draw one.
FIRST = "first"
ALL = "all"


def token_shape(folders) -> tuple[int, int] | None:
    """(N, D): the shape every `npy` member of these folders has, from their `features` records (None when none has
    a record: nothing to check a member's shape against); ValueError when the records disagree."""
    from vlprep.encoders import features_spec

    shapes = {}
    for folder in folders:
        spec = features_spec(folder)
        if spec and "tokens" in spec and "dim" in spec:
            shapes.setdefault((int(spec["tokens"]), int(spec["dim"])), str(folder))
    if len(shapes) > 1:
        raise ValueError("the features records of " + " and ".join(f"{f} ({n}x{d} tokens)" for (n, d), f in
                                                                   shapes.items()) + " disagree")
    return next(iter(shapes), None)


def load_tokens(data: bytes, shape: tuple[int, int] | None) -> torch.Tensor:
    """An `npy` member -> float32 tokens (N, D), checked against the dataset's `features` record (docs/FORMAT.md):
    float16, float32 and float64 are read as float32, in C order and native byte order; BadSample when the member
    does not load, has another dtype kind or shape (`shape`; any 2-D shape when None) or a value that is not finite."""
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as e:  # not an npy file, a pickled (object) array, cut short: numpy's error names it
        raise BadSample("npy_unreadable", f"not a readable npy array ({type(e).__name__}: {e})") from None
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (2, 4, 8):
        raise BadSample("npy_dtype", f"npy dtype {arr.dtype}, not float16, float32 or float64")
    if arr.shape != (shape or arr.shape) or arr.ndim != 2:
        want = f"{shape[0]}x{shape[1]}" if shape else "2-D"
        raise BadSample("npy_shape", f"npy shape {arr.shape}, the features record says {want}")
    # One copy: float32 (float64 values beyond float32's range become inf, caught below), C order, native bytes.
    with np.errstate(over="ignore"):
        x = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if not bool(torch.isfinite(x).all()):
        raise BadSample("npy_nonfinite", "npy tokens hold NaN or infinite values")
    return x


def load_sample(raw: dict, transform, use_features: bool, captions=FIRST, shape=None) -> tuple:
    """Raw sample (member bytes by extension) -> (image tensor or feature tokens, caption(s), key).

    With `use_features` the `npy` member is read by `load_tokens` against `shape` (N, D); a bad one is a BadSample.
    """
    if captions == FIRST:
        caption = raw["txt"].decode("utf-8")  # only the caption: the json member is not needed here
    elif captions == ALL:
        caption = tuple(sample_captions(raw))
    else:
        caption = drawn_caption(sample_captions(raw), *captions, raw["__key__"])
    if use_features:
        if "npy" not in raw:
            raise BadSample("npy_missing", f"{raw.get('__url__', '')}: sample {raw['__key__']} has no npy features")
        x = load_tokens(raw["npy"], shape)
    else:
        data = raw[image_ext(raw)]
        if isinstance(transform, DeviceView):  # data.decode gpu: the JPEG's bytes and drawn crop go to the device
            x = transform.ship(data)
        elif hasattr(transform, "draft"):  # a train_transform view: a JPEG decoded only as large as its crops need
            x = transform(decode_view(data, transform.draft))
        else:  # any other transform (an evaluation view) is given the PIL image
            x = transform(decode_rgb(data))
    return x, caption, raw["__key__"]


def caption_of(raw: dict, captions) -> str:
    """The caption `load_sample` would train on for `raw` ('' when it cannot be read: the load counts that)."""
    try:
        if captions == FIRST:
            return raw["txt"].decode("utf-8")
        return drawn_caption(sample_captions(raw), *captions, raw["__key__"])
    except (KeyError, UnicodeDecodeError, ValueError):
        return ""


class EpochCounter:
    """The data's epoch in shared memory: DataLoader workers that live across epochs (persistent_workers) read the
    epoch the main process set, not the one they were forked with."""

    def __init__(self):
        self._value = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def value(self) -> int:
        return int(self._value)

    @value.setter
    def value(self, epoch: int) -> None:
        self._value.fill_(epoch)


def reseed_worker(seed: int, epoch: int, worker: int) -> None:
    """A DataLoader worker's torch, numpy and random generators, as a function of (run seed, epoch, worker id)
    only: a worker kept across epochs then draws the augmentations a freshly started one would, so a run resumed
    mid-training replays them bit for bit."""
    s = (seed * 1_000_003 + epoch * 10_007 + worker * 101 + 17) % 2 ** 32
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)

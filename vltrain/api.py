"""A trained model as a Python object: `vltrain.load(path)` and what open_clip / LAVIS users expect of it.

    model = vltrain.load("runs/albef/best.pt")          # a checkpoint of `vltrain run`, or a `vltrain export` folder
    img = model.encode_images(["a.png", pil_image, uint8_array])   # (B, E), L2-normalised, preprocessing included
    txt = model.encode_texts(["a dog", "a cat"])
    probs = model.zero_shot(["a.png"], ["dog", "cat"])  # (B, C) class probabilities, prompt ensemble
    p = model.match(images, texts)                      # ITM p(match) of each (image, text) pair

Every caller that needs a trained model (`vltrain eval`, `vltrain gradcam`, the encoder `vlprep embed` and
`vlprep pseudolabel` take) loads it here. docs/API.md documents it.
"""

import contextlib
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vlprep import VlprepError, cut
from vlprep.encoders import eval_transform
from vltrain import hub
from vltrain.checkpoint import load as load_file
from vltrain.checkpoint import model_from
from vltrain.config import Config
from vltrain.config_load import from_dict
from vltrain.losses import upcast
from vltrain.model import autocast, image_interpolation, image_squash, model_tokenizer, resolve_device
from vltrain.zeroshot import DEFAULT_TEMPLATES, check_templates, class_embeddings, read_image

IMAGE_BATCH = 32
TEXT_BATCH = 256


def pixel_transform(net, image_size: int):
    """The deterministic eval transform for a model's pixels (shorter side to S, centre crop S x S, normalise with
    the encoder's statistics); a model trained on cached tokens uses its frozen encoder's size."""
    size = net.image_size if net.cfg.image_model == "features" else image_size
    return eval_transform(size, net.image_mean, net.image_std, image_interpolation(net.cfg), image_squash(net.cfg))


def to_pil(image) -> Image.Image:
    """A path, PIL image or array (H, W[, C] uint8) as RGB; transparency is composited on white, as in training."""
    from vlprep.dataset import as_rgb

    if isinstance(image, (str, os.PathLike)):
        return read_image(image)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ValueError(f"an image array must be uint8 (H, W), (H, W, 3) or (H, W, 4), not {image.dtype} "
                             f"{tuple(image.shape)}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    if isinstance(image, Image.Image):
        if 0 in image.size:
            raise ValueError(f"an image must have pixels, not size {image.size[0]} x {image.size[1]}")
        return as_rgb(image)
    raise ValueError(f"an image must be a path, a PIL image or a uint8 array, not {type(image).__name__}")


class Model:
    """A trained vltrain model ready for inference: embeddings, zero-shot and ITM, preprocessing included.

    `net` is the underlying VLModel (eval mode, on `device`), `config` its vltrain Config, `transform` the eval
    transform (PIL image -> normalised float tensor (3, S, S)), `tokenizer` the Hugging Face tokenizer."""

    def __init__(self, net, config: Config, path: Path, device: torch.device, step: int | None = None):
        self.net, self.config, self.path, self.device, self.step = net, config, path, device, step
        self.tokenizer = model_tokenizer(net)
        self.max_len = config.data.max_len
        self.transform = pixel_transform(net, config.data.image_size) if net.image_mean is not None else None

    def __repr__(self) -> str:
        c = self.net.cfg
        return (f"vltrain.Model({self.path}: {c.text_model} + {c.image_model}, embed_dim {c.embed_dim}, "
                f"fusion layers {c.fusion_layers if self.net.fusion is not None else 0}, on {self.device})")

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        stack.enter_context(autocast(self.device))  # bf16 on CUDA (fp16 without native bf16), nothing elsewhere
        return stack

    def pixels(self, images) -> torch.Tensor:
        """Paths, PIL images or uint8 arrays -> the (B, 3, S, S) float32 batch the image encoder reads."""
        if self.transform is None:
            raise ValueError(f"{self.path}: this model reads `vlprep features` tokens and has no record of their "
                             "encoder, so it cannot read pixels")
        return torch.stack([self.transform(to_pil(im)) for im in _as_list(images)])

    def tokens(self, texts) -> dict:
        """Texts -> {'input_ids', 'attention_mask'} (B, L) on the model's device, padded to the longest."""
        enc = self.tokenizer(list(_as_list(texts, str)), padding="longest", truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        return {k: enc[k].to(self.device) for k in ("input_ids", "attention_mask")}

    def encode_images(self, images, batch_size: int = IMAGE_BATCH) -> torch.Tensor:
        """(B, E) float32 L2-normalised ITC embeddings of paths, PIL images or uint8 arrays (on the CPU)."""
        images = _as_list(images)
        out = []
        _check_batch(batch_size)
        with self._context():
            for a in range(0, len(images), batch_size):
                _, emb = self.net.encode_image(self.pixels(images[a:a + batch_size]).to(self.device))
                out.append(F.normalize(upcast(emb).float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.net.cfg.embed_dim)

    def encode_texts(self, texts, batch_size: int = TEXT_BATCH) -> torch.Tensor:
        """(B, E) float32 L2-normalised ITC embeddings of texts (on the CPU)."""
        texts = _as_list(texts, str)
        out = []
        _check_batch(batch_size)
        with self._context():
            for a in range(0, len(texts), batch_size):
                tok = self.tokens(texts[a:a + batch_size])
                _, emb = self.net.encode_text(tok["input_ids"], tok["attention_mask"])
                out.append(F.normalize(upcast(emb).float(), dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.net.cfg.embed_dim)

    def classifier(self, classnames, templates=None) -> torch.Tensor:
        """(C, E) zero-shot class embeddings: per class, the re-normalised mean of its normalised prompt embeddings
        over `templates` (each with `{}` for the name; default CLIP's 7 ImageNet templates)."""
        names = _as_list(classnames, str)
        if not names:
            raise ValueError("classnames is empty: give at least one class name")
        templates = DEFAULT_TEMPLATES if templates is None else templates
        check_templates(templates, "templates")
        with self._context():
            return class_embeddings(self.net, names, list(templates), self.max_len, self.device).float()

    def zero_shot(self, images, classnames, templates=None) -> torch.Tensor:
        """(B, C) class probabilities: softmax over classes of cosine similarity / the model's ITC temperature."""
        logits = self.encode_images(images) @ self.classifier(classnames, templates).t()
        return (logits / float(self.net.temperature().detach())).softmax(dim=-1)

    def match(self, images, texts, batch_size: int = IMAGE_BATCH) -> torch.Tensor:
        """(B,) ITM p(match) of each (image, text) pair, images[i] with texts[i]; needs a fusion encoder."""
        images = _as_list(images)
        texts = _as_list(texts, str)
        _check_batch(batch_size)
        if len(images) != len(texts):
            raise ValueError(f"match pairs images[i] with texts[i]: {len(images)} images, {len(texts)} texts")
        if self.net.fusion is None:
            raise ValueError(f"{self.path}: this model has no fusion encoder (fusion_layers=0), so no ITM head")
        out = []
        with self._context():
            for a in range(0, len(images), batch_size):
                tokens, _ = self.net.encode_image(self.pixels(images[a:a + batch_size]).to(self.device))
                tok = self.tokens(texts[a:a + batch_size])
                hidden, _ = self.net.encode_text(tok["input_ids"], tok["attention_mask"])
                logits = self.net.itm_logits(self.net.fuse(hidden, tok["attention_mask"], tokens))
                out.append(upcast(logits).float().softmax(dim=-1)[:, 1].cpu())
        return torch.cat(out) if out else torch.zeros(0)


def _as_list(items, kind=None) -> list:
    """One item or a sequence of them as a list (a single string or image is a batch of one); with kind=str every
    item must be a string of valid Unicode (tokenizers fail on a lone surrogate). A one-line ValueError otherwise."""
    if kind is str and isinstance(items, str):
        items = [items]
    elif kind is None and (isinstance(items, (str, os.PathLike, Image.Image)) or (
            isinstance(items, np.ndarray) and items.ndim in (2, 3) and items.dtype == np.uint8)):
        return [items]
    if isinstance(items, (dict, bytes, np.ndarray) if kind is str else (dict, bytes)) or not hasattr(items, "__iter__"):
        what = "strings" if kind is str else "images"
        raise ValueError(f"expected one item or a list of {what}, not {type(items).__name__}")
    items = list(items)
    for i, item in enumerate(items if kind is str else ()):
        if not isinstance(item, str):
            raise ValueError(f"text {i} is a {type(item).__name__}, not a string")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"text {i} is not valid Unicode (it holds a lone surrogate)") from None
    return items


def _check_batch(batch_size) -> None:
    """A batch size is a positive integer; a one-line ValueError otherwise (range() would silently yield nothing)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}"[:120])


def load(path, device: str = "auto") -> Model:
    """A trained model from a `vltrain run` checkpoint (last.pt, best.pt: read with weights_only=True) or a
    `vltrain export` folder (local, or `hf-hub:ORG/NAME` where a network is); device "auto" takes CUDA when present. One-line CheckpointError (a ValueError) for a
    file that is not one."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a checkpoint file or an export folder, not {type(path).__name__}")
    path = hub.fetch(path) if hub.is_hub(path) else Path(path)  # hf-hub:ORG/NAME: an export on the Hub
    try:  # first: a machine without the device says so before any file is read
        name = str(device) if isinstance(device, torch.device) else device
        if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
            raise VlprepError(f"--device must be auto, cpu or cuda[:N], got {cut(repr(name))}")
        dev = resolve_device(name)
    except VlprepError as e:  # the shared resolver words it as the CLI flag; this is the API's ValueError
        raise ValueError(str(e).replace("--device", "device", 1)) from None
    ckpt = load_file(path)
    net = model_from(ckpt, path).to(dev).eval()
    return Model(net, from_dict(ckpt["config"]), path, dev, ckpt.get("step"))

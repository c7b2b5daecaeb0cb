"""A vltrain checkpoint's ITC encoders as the encoder object `vlprep embed` and `vlprep pseudolabel` take.

vlprep's stages never import vltrain (data flows one way, vlprep -> shards -> vltrain): its CLI builds a
`CheckpointEncoder` and hands it over.
The object has what vlprep.embed documents as an encoder: `.dim`, `.texts()`, `.images()`, the preprocessing the
model was trained with (`.image_size`, `.min_crop_scale`), and what identifies the weights (`.name`,
`.fingerprint`); a model trained on `vlprep features` tokens adds `.reads_tokens(spec)` and `.tokens()`, so that a
dataset holding the same encoder's tokens is embedded from them, and its `.images()` runs the recorded frozen
encoder exactly as `vlprep features` does with its defaults (same numbers as the cached tokens). It pickles as
(path, device), so each worker of vlprep's engine loads the model itself: weights never travel.
"""

import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from vlprep import VlprepError


class CheckpointEncoder:
    """A vltrain checkpoint's ITC encoders with the preprocessing of its config; every output is (B, E) float32."""

    def __init__(self, checkpoint: str | os.PathLike, device: str = "auto"):
        from vltrain.api import load

        self.path, self.device_name = Path(checkpoint), device
        try:
            loaded = load(checkpoint, device)
        except ValueError as e:
            raise VlprepError(str(e)) from None
        self.model, self.device, data = loaded.net, loaded.device, loaded.config.data
        self.dim = self.model.cfg.embed_dim
        self.max_len = int(data.max_len)
        st = (self.path / "model.safetensors" if self.path.is_dir() else self.path).stat()  # an export: its weights
        self.name = str(self.path.resolve())
        self.fingerprint = f"{self.name}:{st.st_size}:{st.st_mtime_ns}"
        self.info = {"checkpoint": self.name, "model": asdict(self.model.cfg)}
        # A model whose image encoder reads `vlprep features` npy tokens cannot embed pixels: image_size None says so
        # (vlprep refuses image work with it before writing anything).
        self.image_size = None
        if self.model.image_mean is not None:
            feat_size = self.model.image_size if self.model.cfg.image_model == "features" else None
            self.image_size = int(feat_size or data.image_size or self.model.image_size or 224)
        self.min_crop_scale = float(data.min_crop_scale)
        if self.image_size is not None:
            # NHWC convolutions: faster for EfficientNet-Lite0 on CPU (oneDNN), same outputs to ~1e-7.
            self.model.image_encoder.to(memory_format=torch.channels_last)
        self.tokenizer = loaded.tokenizer

    def __reduce__(self):
        return CheckpointEncoder, (str(self.path), self.device_name)

    def _autocast(self):
        from vltrain.model import autocast  # loaded with vltrain.api in __init__

        return autocast(self.device)  # bf16 on a card with native bf16, fp16 on other CUDA cards, none on a CPU

    @torch.inference_mode()
    def texts(self, captions: list[str]) -> np.ndarray:
        """Captions -> (B, E) L2-normalised float32."""
        enc = self.tokenizer(list(captions), padding="longest", truncation=True, max_length=self.max_len,
                             return_tensors="pt")
        with self._autocast():
            _, feat = self.model.encode_text(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))
        return _normalise(feat.float().cpu().numpy())

    def reads_tokens(self, spec: dict | None) -> bool:
        """Whether a dataset with this `vlprep features` record (None: pixels only) is embedded from its cached `npy`
        tokens: the model reads tokens and the record is its own encoder's (vltrain eval's rule: the fields of
        SAME_ENCODER equal; a model with no record takes any features dataset's tokens of its width)."""
        from vltrain.data.shards import SAME_ENCODER

        if spec is None or self.model.cfg.image_model != "features":
            return False
        own = self.model.cfg.feature_encoder
        if own:
            return all(spec.get(k) == own.get(k) for k in SAME_ENCODER)
        return spec.get("dim") == self.model.cfg.feature_dim

    @torch.inference_mode()
    def tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Cached feature tokens (B, N, D), any float dtype -> (B, E) L2-normalised float32."""
        x = torch.from_numpy(np.ascontiguousarray(tokens)).to(self.device).float()
        with self._autocast():
            _, feat = self.model.encode_image(x)
        return _normalise(feat.float().cpu().numpy())

    def _pixel_tokens(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (B, S, S, 3) -> the recorded frozen encoder's tokens (B, N, D) in the stored dtype, normalised and
        encoded as `vlprep features` does (VLModel.pixel_tokens, vltrain.model.frozen_tokens): the cache's bytes."""
        from vlprep.encoders import normalise

        spec = self.model.cfg.feature_encoder
        x = normalise(torch.from_numpy(pixels).permute(0, 3, 1, 2), spec["mean"], spec["std"]).to(self.device)
        tokens = self.model.pixel_tokens(x).cpu().numpy()
        return tokens.astype(np.dtype(spec.get("dtype", "float32")), copy=False)

    @torch.inference_mode()
    def images(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (B, S, S, 3) -> (B, E) L2-normalised float32; scaling and normalisation happen here, batched."""
        if self.image_size is None:
            raise VlprepError(f"{self.path}: the image encoder reads precomputed features, not pixels")
        if self.model.cfg.image_model == "features":
            return self.tokens(self._pixel_tokens(pixels))
        # (B, S, S, 3) permuted to (B, 3, S, S) is already the channels_last layout: no copy before the convs.
        x = torch.from_numpy(pixels).to(self.device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        mean = torch.tensor(self.model.image_mean, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(self.model.image_std, device=self.device).view(1, 3, 1, 1)
        with self._autocast():
            _, feat = self.model.encode_image((x - mean) / std)
        return _normalise(feat.float().cpu().numpy())


def _normalise(x: np.ndarray) -> np.ndarray:
    """Rows to unit L2 norm in float32 (half-precision autocast on CUDA leaves them slightly off)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

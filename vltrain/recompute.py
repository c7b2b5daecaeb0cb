"""Gradient checkpointing (activations recomputed in the backward pass) and the model-wide dropout override."""

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _keep_buffers(module: nn.Module):
    """Run the body and put `module`'s buffers back as they were: the recompute of a block with BatchNorm in
    training mode would otherwise move its running statistics a second time in the same step."""
    saved = [(b, b.clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, before in saved:
                b.copy_(before)


def checkpointed(module: nn.Module, *args, **kwargs):
    """module(*args, **kwargs) with its activations recomputed in backward; the RNG state is replayed (dropout
    draws the same masks) and its buffers are left as the first forward left them."""
    if not any(True for _ in module.buffers()):
        return checkpoint(module, *args, use_reentrant=False, **kwargs)
    return checkpoint(module, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(),
                                                                             _keep_buffers(module)), **kwargs)


def recomputing(model: nn.Module) -> bool:
    """Whether a forward of `model` now should checkpoint: switched on, training, and gradients recorded."""
    return getattr(model, "grad_ckpt", False) and model.training and torch.is_grad_enabled()


def set_text_checkpointing(encoder: nn.Module, on: bool) -> None:
    """HF's own per-layer checkpointing of a text encoder (it covers every call, the length groups' too)."""
    if on:
        if getattr(encoder.config, "use_cache", False):  # an encoder caches nothing; HF warns of it under checkpointing
            encoder.config.use_cache = False
        enable = getattr(encoder, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5.x; gradient_checkpointing_enable is its deprecated alias
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # pragma: no cover (older transformers)
            encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    flag = "is_activation_checkpointing" if hasattr(type(encoder), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # the older name warns of its deprecation where the new one exists
    if not getattr(encoder, flag, False):
        return
    disable = getattr(encoder, "activation_checkpointing_disable", None) or encoder.gradient_checkpointing_disable
    disable()


def image_blocks(encoder: nn.Module):
    """How a trained image tower runs block by block: a callable (images, run) -> output where run(block, x)
    applies one block, or None when the tower checkpoints itself (timm) or has no blocks to checkpoint. A torchvision
    ViT's patch dropout (the Backbone's `patch_drop`) drops its tokens before the blocks, outside any recompute."""
    from vlprep.encoders import EffNetTrunk, ViTTokens

    net = getattr(encoder, "net", encoder)
    if isinstance(encoder, EffNetTrunk):
        return lambda x, run: _effnet(encoder.net, x, run)
    if isinstance(net, ViTTokens):
        return lambda x, run: torchvision_vit(net, x, run, getattr(encoder, "patch_drop", None))
    if isinstance(net, nn.Sequential):  # a torchvision CNN trunk (the tiny CNN: single layers, nothing to recompute)
        return lambda x, run: _sequence(net, x, run)
    return None


def _sequence(blocks: nn.Sequential, x: torch.Tensor, run) -> torch.Tensor:
    """The blocks in turn, those made of submodules (a ResNet stage, an MBConv) through `run`; a single layer (a
    stem's conv, an in-place ReLU that would overwrite a checkpointed input) runs as it is."""
    for block in blocks:
        x = run(block, x) if any(True for _ in block.children()) else block(x)
    return x


def _effnet(net: nn.Module, x: torch.Tensor, run) -> torch.Tensor:
    """EfficientNet.extract_features with each MBConv block run through `run`."""
    x = net._swish(net._bn0(net._conv_stem(x)))
    for idx, block in enumerate(net._blocks):
        rate = net._global_params.drop_connect_rate
        if rate:
            rate *= float(idx) / len(net._blocks)
        x = run(block, x, drop_connect_rate=rate)
    return net._swish(net._bn1(net._conv_head(x)))


def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """block(x): the `run` of a forward without recompute."""
    return block(x)


def torchvision_vit(net: nn.Module, x: torch.Tensor, run, drop: nn.Module | None = None) -> torch.Tensor:
    """ViTTokens.forward with each encoder layer run through `run`, and `drop` (FLIP's patch dropout, or None)
    applied to the tokens right after the position embedding is added, before the encoder's dropout."""
    vit = net.vit
    size = vit.image_size
    if x.shape[-2:] != (size, size):
        return net(x)  # its one-line size error
    tokens = vit._process_input(x)
    tokens = torch.cat([vit.class_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
    enc = vit.encoder
    tokens = tokens + enc.pos_embedding
    if drop is not None:
        tokens = drop(tokens)
    return enc.ln(_sequence(enc.layers, enc.dropout(tokens), run))


def set_image_checkpointing(encoder: nn.Module, on: bool) -> None:
    """timm and Hugging Face towers checkpoint their own blocks; the others run through `image_blocks`.
    A timm network with BatchNorm is refused: timm's recompute would move its running statistics twice a step."""
    if hasattr(encoder, "config") and hasattr(encoder, "gradient_checkpointing_enable"):  # a Hugging Face tower
        set_text_checkpointing(encoder, on)  # (CLIP's or SigLIP's vision model): its own per-layer checkpointing
        return
    timm_net = getattr(getattr(encoder, "net", None), "net", None)
    if timm_net is None or not hasattr(timm_net, "set_grad_checkpointing"):
        return
    if on and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in timm_net.modules()):
        raise ValueError("train.grad_checkpointing: this timm image tower has BatchNorm, whose running statistics "
                         "timm's recompute would update twice a step; use a torchvision:ARCH tower, a ViT, or "
                         "model.freeze_image=true")
    timm_net.set_grad_checkpointing(on)


def set_dropout(model: nn.Module, p: float) -> None:
    """Every dropout probability of `model` set to p, in its modules and in the HF config its attention reads;
    p = 0 also turns off stochastic depth (timm's DropPath, torchvision's StochasticDepth, EfficientNet's
    drop-connect), so a training forward draws nothing."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = p
        elif hasattr(m, "attn_drop") and isinstance(m.attn_drop, float):  # vltrain.layers.Attention's rate
            m.attn_drop = p
        if p == 0:
            _no_stochastic_depth(m)
        config = getattr(m, "config", None)
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
            if config is not None and isinstance(getattr(config, key, None), float):
                setattr(config, key, p)


def _no_stochastic_depth(m: nn.Module) -> None:
    if hasattr(m, "drop_prob") and isinstance(m.drop_prob, float):  # timm DropPath
        m.drop_prob = 0.0
    if type(m).__name__ == "StochasticDepth":  # torchvision
        m.p = 0.0
    params = getattr(m, "_global_params", None)
    if params is not None and getattr(params, "drop_connect_rate", None):  # EfficientNet (a namedtuple)
        m._global_params = params._replace(drop_connect_rate=0.0)

"""FLIP's patch dropout (Li et al. 2023, "Scaling Language-Image Pre-training via Masking", section 3): a ViT image
tower's training forward reads a random share (1 - p) of its patch tokens, so the tower costs about (1 - p) of its
full cost; evaluation and export read every token."""

import torch
from torch import nn


def kept(n: int, p: float) -> int:
    """How many of n patch tokens a training forward keeps: floor((1 - p) * n), at least 1 (timm's and open_clip's
    rule, so a run here and one there keep the same count)."""
    return max(1, int(n * (1 - p)))


def drop_patches(x: torch.Tensor, p: float, prefix: int) -> torch.Tensor:
    """Tokens (B, P + N, D), the P prefix tokens (class, registers) first -> (B, P + k, D), k = kept(N, p): the prefix
    tokens, then each row's own uniform random k of its N patch tokens, in position order.

    The draw is torch's global RNG on x's device (the training stream: a resume restores it, and gradient
    accumulation's replay draws the same rows again), one normal per patch, whose argsort is a uniform permutation.
    Position order costs one small sort and keeps the kept tokens in the order a full forward gives them.
    """
    b, n = x.shape[0], x.shape[1] - prefix
    order = torch.randn(b, n, device=x.device).argsort(dim=1)
    idx = order[:, :kept(n, p)].sort(dim=1).values
    patches = x[:, prefix:].gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return torch.cat([x[:, :prefix], patches], dim=1)


class PatchDropout(nn.Module):
    """drop_patches in training mode with p > 0, the identity otherwise (eval, export, the momentum copy's p = 0).
    No parameters or buffers: a model's state dict is the same with and without it."""

    def __init__(self, p: float, prefix: int):
        super().__init__()
        self.p = float(p)
        self.prefix = int(prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_patches(x, self.p, self.prefix) if self.training and self.p > 0 else x

    def hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        """As a forward hook on a Hugging Face vision tower's `embeddings` (patches + position embedding): its
        output with the patches dropped, before the tower's first layer reads it."""
        return self(output)

    def extra_repr(self) -> str:
        return f"p={self.p}, prefix={self.prefix}"

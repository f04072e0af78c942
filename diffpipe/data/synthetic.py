"""Random latents with captions, of the model's input shape: for planning, benchmarks and smoke tests."""
from __future__ import annotations

import torch

from .digits import digit_caption

__all__ = ["SyntheticDataset"]


class SyntheticDataset:
    """`size` random latents of `shape` with digit captions; with `controls` (an edit model) a random control latent
    beside each, drawn after them (the latents are the same either way)."""

    def __init__(self, shape: tuple[int, ...], size: int = 256, seed: int = 0, controls: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, *shape, generator=gen)
        self.captions = [digit_caption(i % 10) for i in range(size)]
        self.controls = torch.randn(size, *shape, generator=gen) if controls else None

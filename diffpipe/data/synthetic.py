"""Random latents with captions, of the model's input shape: for planning, benchmarks and smoke tests."""
from __future__ import annotations

import torch

from .digits import digit_caption

__all__ = ["SyntheticDataset"]


class SyntheticDataset:
    def __init__(self, shape: tuple[int, ...], size: int = 256, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, *shape, generator=gen)
        self.captions = [digit_caption(i % 10) for i in range(size)]

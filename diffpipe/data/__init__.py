"""Training data: datasets and the deterministic batches each step draws from them."""
from __future__ import annotations

from .digits import DigitsDataset
from .synthetic import SyntheticDataset

__all__ = ["make_dataset"]


def make_dataset(name: str, sample_shape: tuple[int, int, int], seed: int):
    """A dataset with `.images` (N, C, H, W) and `.captions`, by the name in `data.dataset`."""
    factories = {"digits": lambda: DigitsDataset(), "synthetic": lambda: SyntheticDataset(sample_shape, seed=seed)}
    return factories[name]()

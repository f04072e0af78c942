"""Training data: datasets and the deterministic batches each step draws from them."""
from __future__ import annotations

from .batches import TensorImages
from .digits import DigitsDataset
from .moving_digits import MovingDigits
from .synthetic import SyntheticDataset

__all__ = ["make_dataset"]


def make_dataset(name: str, sample_shape: tuple[int, ...], seed: int) -> TensorImages:
    """The images (N, C, H, W) or clips (N, C, F, H, W) and captions of `data.dataset` digits, moving_digits or
    synthetic (folders: data/images.py)."""
    factories = {"digits": lambda: DigitsDataset(), "synthetic": lambda: SyntheticDataset(sample_shape, seed=seed),
                 "moving_digits": lambda: MovingDigits(frames=sample_shape[1])}
    data = factories[name]()
    return TensorImages(data.images, data.captions)

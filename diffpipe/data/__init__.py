"""Training data: datasets and the deterministic batches each step draws from them.

The package imports nothing at import time: the config reads data/sources.py, whose data modules read the config.
"""
from __future__ import annotations

__all__ = ["make_dataset"]


def make_dataset(name: str, sample_shape: tuple[int, ...], seed: int, controls: bool = False):
    """The images (N, C, H, W) or clips (N, C, F, H, W) and captions of `data.dataset` digits, moving_digits or
    synthetic, as `TensorImages` (folders: data/images.py); with `controls`, synthetic data's control latents, or
    for moving digits each clip's first frame (an image-to-video model's: data/first_frames.py)."""
    from .batches import TensorImages
    from .digits import DigitsDataset
    from .moving_digits import MovingDigits
    from .synthetic import SyntheticDataset

    factories = {"digits": lambda: DigitsDataset(),
                 "synthetic": lambda: SyntheticDataset(sample_shape, seed=seed, controls=controls),
                 "moving_digits": lambda: MovingDigits(frames=sample_shape[1])}
    data = factories[name]()
    if name == "moving_digits" and controls:
        from .frames import grey_after

        return TensorImages(data.images, data.captions, grey_after(data.images[:, :, 0], data.images.shape[2]))
    return TensorImages(data.images, data.captions, getattr(data, "controls", None))

"""scikit-learn's handwritten digits (1,797 images, 8x8, grey) with captions such as "a handwritten digit seven".

Every fourth image (449 of them) is held out: the model never trains on them, so `examples/digits_quality.py` can
judge generated digits with a classifier fitted on digits the model has not seen.
"""
from __future__ import annotations

from typing import Literal

import torch
from sklearn.datasets import load_digits

__all__ = ["DigitsDataset", "DIGIT_WORDS", "digit_caption"]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_HELD_OUT_EVERY = 4  # image i is held out when i % 4 == 3


def digit_caption(digit: int) -> str:
    return f"a handwritten digit {DIGIT_WORDS[digit]}"


class DigitsDataset:
    """Images scaled to [-1, 1], shape (N, 1, 8, 8), with labels and captions: the training split (1,348 images)
    or the held-out one (449)."""

    MAX_VALUE = 16.0  # load_digits pixel values are integers 0..16

    def __init__(self, split: Literal["train", "held_out"] = "train"):
        digits = load_digits()
        held_out = torch.arange(len(digits.target)) % _HELD_OUT_EVERY == _HELD_OUT_EVERY - 1
        keep = held_out if split == "held_out" else ~held_out
        pixels = torch.tensor(digits.images, dtype=torch.float32)[keep]
        self.images = pixels.unsqueeze(1) / (self.MAX_VALUE / 2) - 1
        self.labels = torch.tensor(digits.target, dtype=torch.long)[keep]
        self.captions = [digit_caption(int(d)) for d in self.labels]

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def to_pixel_values(cls, images: torch.Tensor) -> torch.Tensor:
        """Inverse of the scaling: [-1, 1] back to the dataset's 0..16 range."""
        return ((images.clamp(-1, 1) + 1) * (cls.MAX_VALUE / 2))

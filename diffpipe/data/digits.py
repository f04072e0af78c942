"""scikit-learn's handwritten digits (1,797 images, 8x8, grey) with captions such as "a handwritten digit seven"."""
from __future__ import annotations

import torch
from sklearn.datasets import load_digits

__all__ = ["DigitsDataset", "DIGIT_WORDS", "digit_caption"]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digit_caption(digit: int) -> str:
    return f"a handwritten digit {DIGIT_WORDS[digit]}"


class DigitsDataset:
    """Images scaled to [-1, 1], shape (N, 1, 8, 8), with labels and captions."""

    MAX_VALUE = 16.0  # load_digits pixel values are integers 0..16

    def __init__(self):
        digits = load_digits()
        self.images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / (self.MAX_VALUE / 2) - 1
        self.labels = torch.tensor(digits.target, dtype=torch.long)
        self.captions = [digit_caption(int(d)) for d in digits.target]

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def to_pixel_values(cls, images: torch.Tensor) -> torch.Tensor:
        """Inverse of the scaling: [-1, 1] back to the dataset's 0..16 range."""
        return ((images.clamp(-1, 1) + 1) * (cls.MAX_VALUE / 2))

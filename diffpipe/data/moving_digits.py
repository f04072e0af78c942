"""Clips of scikit-learn's handwritten digits sliding one pixel a frame (wrapping round) left, right, up or down,
captioned with the digit and the motion ("a handwritten digit seven moving left"): video data made on the spot,
for the tiny video job and the video families' tests.
"""
from __future__ import annotations

import torch

from .digits import DIGIT_WORDS, DigitsDataset

__all__ = ["MovingDigits", "MOTIONS", "MOTION_WORDS", "moving_caption", "moving_prompts"]

MOTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (rows, columns) a frame
MOTION_WORDS = ("moving", "left", "right", "up", "down")  # what the tiny text encoder must also know


def moving_caption(digit: int, motion: str) -> str:
    return f"a handwritten digit {DIGIT_WORDS[digit]} moving {motion}"


def moving_prompts() -> list[str]:
    """What samples show: four digits, each in another motion."""
    return [moving_caption(d, m) for d, m in zip((0, 3, 7, 9), MOTIONS)]


class MovingDigits:
    """Clips (N, 1, frames, 8, 8) in [-1, 1]: every digit of the split, each in the motion its index picks."""

    def __init__(self, frames: int, split: str = "train"):
        digits = DigitsDataset(split)
        names = list(MOTIONS)
        clips, captions = [], []
        for i, (image, label) in enumerate(zip(digits.images, digits.labels.tolist())):
            motion = names[i % len(names)]
            dy, dx = MOTIONS[motion]
            clips.append(torch.stack([torch.roll(image, (dy * f, dx * f), dims=(-2, -1)) for f in range(frames)], dim=1))
            captions.append(moving_caption(label, motion))
        self.images, self.captions = torch.stack(clips), captions

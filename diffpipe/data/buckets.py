"""Aspect-ratio buckets: sizes of about the same area (resolution squared) and different shapes, each image
resized to cover the bucket nearest its aspect ratio and centre-cropped into it (NovelAI's bucketing, as kohya
sd-scripts and diffusion-pipe do it).

The crop's offset and the image's size before resizing are what SDXL's micro-conditioning (`time_ids`: original
size, crop top-left, target size; Podell et al., arXiv:2307.01952, section 2.2) is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

__all__ = ["Bucket", "Placement", "make_buckets", "place", "placed", "pixels_of", "to_pixels", "clip_to_pixels"]


@dataclass(frozen=True, order=True)
class Bucket:
    width: int
    height: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Placement:
    """Where an image goes: its bucket, the size it is resized to, and the crop's top-left in that size; for a video
    family also its clip length in frames (its frame bucket; an image is a clip of 1)."""

    bucket: Bucket
    resized: tuple[int, int]  # (width, height)
    top: int
    left: int
    frames: int = 0  # 0: an image model's image

    @property
    def name(self) -> str:
        """The batch shape in the user's words: 832x480, or 832x480x33f for clips of 33 frames."""
        return f"{self.bucket}x{self.frames}f" if self.frames else str(self.bucket)


def make_buckets(resolution: int, step: int, max_aspect: float) -> list[Bucket]:
    """Every (width, height) in multiples of `step`, of area at most resolution squared and as near it as the step
    allows, with aspect ratio within 1/max_aspect..max_aspect; the square one included."""
    area = resolution * resolution
    buckets = {Bucket(resolution // step * step, resolution // step * step)}
    width = step
    while width <= resolution * max_aspect:
        height = area // width // step * step
        if height >= step and max(width / height, height / width) <= max_aspect:
            buckets.add(Bucket(width, height))
        width += step
    return sorted(buckets, key=lambda b: b.width / b.height)


def place(width: int, height: int, buckets: list[Bucket], frames: int = 0) -> Placement:
    """The bucket nearest the image's aspect ratio (in log ratio), the cover resize and the centred crop."""
    ratio = math.log(width / height)
    bucket = min(buckets, key=lambda b: (abs(math.log(b.width / b.height) - ratio), b))
    scale = max(bucket.width / width, bucket.height / height)
    resized = (max(bucket.width, round(width * scale)), max(bucket.height, round(height * scale)))
    return Placement(bucket, resized, (resized[1] - bucket.height) // 2, (resized[0] - bucket.width) // 2, frames)


def placed(image: Image.Image, placement: Placement) -> Image.Image:
    """An RGB image resized and cropped into its bucket."""
    b = placement.bucket
    resized = image.resize(placement.resized, Image.LANCZOS)
    return resized.crop((placement.left, placement.top, placement.left + b.width, placement.top + b.height))


def pixels_of(image: Image.Image) -> torch.Tensor:
    """An RGB image as (3, height, width) in [-1, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 127.5 - 1


def to_pixels(image: Image.Image, placement: Placement) -> torch.Tensor:
    """An RGB image resized and cropped into its bucket: (3, height, width) in [-1, 1]."""
    return pixels_of(placed(image, placement))


def clip_to_pixels(frames: list[Image.Image], placement: Placement) -> torch.Tensor:
    """Frames resized and cropped alike into their bucket: (3, frames, height, width) in [-1, 1]."""
    return torch.stack([to_pixels(frame, placement) for frame in frames], dim=1)

"""A clip's first frame as an image-to-video model is given it (WanImageToVideoPipeline.prepare_latents): the frame
placed in its clip's bucket, followed by grey frames (zeros in the VAE's [-1, 1] range) for the clip's length. A
still image is its own first frame. data/first_frames.py finds and caches them for a folder's clips.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from .buckets import Placement, placed, to_pixels
from .folder import ImageItem, read_rgb
from .videos import VIDEO_SUFFIXES, read_clip

__all__ = ["read_first_frame", "grey_after", "first_frame_pixels", "placed_first_frame"]


def read_first_frame(path: Path) -> Image.Image:
    """A video's first frame, or an image itself."""
    return read_clip(path, 1)[0] if Path(path).suffix.lower() in VIDEO_SUFFIXES else read_rgb(path)


def grey_after(first: torch.Tensor, frames: int) -> torch.Tensor:
    """(..., C, H, W) pixels (or moving digits' pixel latents) of a first frame -> (..., C, frames, H, W): it, then
    grey (zero) frames."""
    pixels = first.new_zeros(*first.shape[:-2], frames, *first.shape[-2:])
    pixels[..., 0, :, :] = first
    return pixels


def first_frame_pixels(item: ImageItem, placement: Placement) -> torch.Tensor:
    """(3, F, H, W): the clip's first frame as placed, then F - 1 grey frames."""
    return grey_after(to_pixels(read_first_frame(item.path), placement), max(placement.frames, 1))


def placed_first_frame(path: Path, placement: Placement) -> Image.Image:
    """The clip's (or image's) first frame placed in its bucket: the picture a text encoder that reads pictures is
    shown."""
    return placed(read_first_frame(path), placement)

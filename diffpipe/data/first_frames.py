"""The first frame of each clip, as an image-to-video model is given it (WanImageToVideoPipeline.prepare_latents):
the frame placed in its clip's bucket, followed by grey frames (zeros in the VAE's [-1, 1] range) for the clip's
length, encoded by the VAE as one clip and cached in the latents' store, keyed by the clip's bytes and placement.
A still image in a video dataset is its own first frame (a clip of one frame).
"""
from __future__ import annotations

import torch

from pathlib import Path

from PIL import Image

from ..config import DataConfig
from .buckets import Placement, placed, to_pixels
from .cache import ShardStore
from .folder import ImageItem, Skipped, read_rgb, scan_folders
from .images import FolderImages, caption_key, data_folders, store_latents
from .videos import VIDEO_SUFFIXES, read_clip

__all__ = ["first_frame_pixels", "find_first_frames", "first_frame_key", "placed_first_frame", "cache_first_frames", "read_first_frame", "first_clips",
           "grey_after"]


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


def first_clips(data: DataConfig, count: int) -> list[tuple[str, Path]]:
    """The first `count` clips (or images) of data.path in name order, each once: their captions and files, what a
    sample grid continues when sample.control_images is unset."""
    items = scan_folders(data_folders(data), 0, Skipped(), videos=True, first=count)
    return [(item.caption, item.path) for item in {item.path: item for item in items}.values()]


def first_frame_key(clip_key: str) -> str:
    """A clip's first frame's key, apart from the clip's own (`latent_key`) it is made of."""
    return f"{clip_key}:first-frame"


def find_first_frames(dataset: FolderImages, clip_keys: list[str] | None = None) -> None:
    """Each item's first frame as its control: its own file, placed as its clip. `clip_keys` (the items' latent
    keys), where the text encoder reads each first frame as a picture (Wan 2.1 I2V's CLIP): the pictures' keys."""
    dataset.controls = [item.path for item in dataset.items]
    dataset.control_placements = list(dataset.placements)
    dataset.first_frames = True
    if clip_keys is not None:
        dataset.control_keys = [first_frame_key(key) for key in clip_keys]


def placed_first_frame(path: Path, placement: Placement) -> Image.Image:
    """The clip's (or image's) first frame placed in its bucket: the picture a text encoder that reads pictures is
    shown."""
    return placed(read_first_frame(path), placement)


def cache_first_frames(dataset: FolderImages, clip_keys: list[str], store: ShardStore, vae, rank, world, barrier,
                       show) -> None:
    """The items' first-frame latents from the store (this process encoding its share of what it lacks), keyed apart
    from their clips' latents (`clip_keys`, one per item: the files already hashed for those)."""
    keys = [caption_key(first_frame_key(key)) for key in clip_keys]
    latents, reasons = store_latents(dataset.items, dataset.control_placements, store, vae, rank, world, barrier, show,
                                     "caching first frames' latents", keys=keys, reader=first_frame_pixels)
    for i, why in reasons.items():
        dataset.skipped.add(dataset.items[i].path, f"its first frame: {why}")
    dataset.cached_controls = latents
    dataset.keep([i for i, latent in enumerate(latents) if latent is not None])

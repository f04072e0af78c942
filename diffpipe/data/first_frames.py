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
from .buckets import Placement, to_pixels
from .cache import ShardStore
from .folder import ImageItem, Skipped, read_rgb, scan_folders
from .images import FolderImages, caption_key, data_folders, file_hash, latent_key, store_latents
from .videos import VIDEO_SUFFIXES, read_clip

__all__ = ["first_frame_pixels", "find_first_frames", "cache_first_frames", "first_frame_conditions",
           "read_first_frame", "first_clips", "grey_after"]


def read_first_frame(path: Path) -> Image.Image:
    """A video's first frame, or an image itself."""
    return read_clip(path, 1)[0] if Path(path).suffix.lower() in VIDEO_SUFFIXES else read_rgb(path)


def grey_after(first: torch.Tensor, frames: int) -> torch.Tensor:
    """(..., 3, H, W) pixels of a first frame -> (..., 3, frames, H, W): it, then grey (zero) frames."""
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


def first_frame_conditions(clips: torch.Tensor) -> torch.Tensor:
    """Clips (N, C, F, H, W) in pixel space (moving digits: no VAE): each first frame, then zeros."""
    conditions = torch.zeros_like(clips)
    conditions[:, :, 0] = clips[:, :, 0]
    return conditions


def find_first_frames(dataset: FolderImages) -> None:
    """Each item's first frame as its control: its own file, placed as its clip, keyed apart from the clip's latents."""
    contents = {path: file_hash(path) for path in {item.path for item in dataset.items}}
    dataset.controls = [item.path for item in dataset.items]
    dataset.control_placements = list(dataset.placements)
    dataset.control_keys = [caption_key(latent_key(contents[item.path], p) + ":first-frame")
                            for item, p in zip(dataset.items, dataset.placements)]
    dataset.first_frames = True


def cache_first_frames(dataset: FolderImages, store: ShardStore, vae, rank, world, barrier, show) -> None:
    """The items' first-frame latents from the store (this process encoding its share of what it lacks)."""
    latents, reasons = store_latents(dataset.items, dataset.control_placements, store, vae, rank, world, barrier, show,
                                     "caching first frames' latents", keys=dataset.control_keys,
                                     reader=first_frame_pixels)
    for i, why in reasons.items():
        dataset.skipped.add(dataset.items[i].path, f"its first frame: {why}")
    dataset.cached_controls = latents
    dataset.keep([i for i, latent in enumerate(latents) if latent is not None])

"""The first frame of each clip, as an image-to-video model is given it (WanImageToVideoPipeline.prepare_latents):
the frame placed in its clip's bucket, followed by grey frames (zeros in the VAE's [-1, 1] range) for the clip's
length, encoded by the VAE as one clip and cached in the latents' store, keyed by the clip's bytes and placement.
A still image in a video dataset is its own first frame (a clip of one frame).
"""
from __future__ import annotations

from pathlib import Path

from ..config import DataConfig
from .cache import ShardStore
from .folder import Skipped, scan_folders
from .frames import first_frame_pixels
from .images import FolderImages, caption_key, data_folders, store_latents

__all__ = ["find_first_frames", "first_frame_key", "cache_first_frames", "first_clips"]


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

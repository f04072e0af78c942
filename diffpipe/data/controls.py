"""Control images beside the pictures of an edit dataset (data.control_path), as diffusion-pipe and musubi-tuner lay
them out: for each picture, the image with the same path relative to its data folder and the same name (any image
suffix) in data.control_path, what the picture was made from (an edit's source). An edit model (Flux Kontext) reads
its latents beside the noisy picture's.

Each control is placed in its picture's bucket as a picture is (resized to cover it, centre-cropped), so a control of
the picture's size lands pixel for pixel where the picture does; encoded by the same VAE and cached in the same store,
keyed by its own bytes and placement. A picture whose control is missing stops the run before anything is encoded; one
whose control cannot be decoded is skipped and counted with the broken files.
"""
from __future__ import annotations

from pathlib import Path

from ..config import DataConfig
from .buckets import place
from .cache import ShardStore
from .folder import BadImage, ImageItem, Skipped, files_beside, probe_image, scan_folders
from .images import FolderImages, data_folders, file_hash, latent_key, regularisation_folders, store_latents

__all__ = ["find_controls", "cache_controls", "first_edits", "GRID_EDITS"]

GRID_EDITS = 4  # pictures a sample grid edits when sample.prompts and sample.control_images are unset


def _controls_of(items: list[ImageItem], folders: list[Path], data: DataConfig) -> list[Path]:
    return files_beside(items, folders, Path(data.control_path), "data.control_path",
                        "control image (what the picture is made from)")


def find_controls(dataset: FolderImages, data: DataConfig) -> None:
    """Give each item of `dataset` its control image, that image's placement in the item's bucket and its key (as
    its cached latents'); items whose control has no readable header are skipped."""
    folders = [f for f, _ in data_folders(data) + data_folders(data, eval_split=True) + regularisation_folders(data)]
    controls = _controls_of(dataset.items, folders, data)
    placements, kept = [], []
    for i, (control, placement) in enumerate(zip(controls, dataset.placements)):
        try:
            width, height, *_ = probe_image(control)
        except BadImage as exc:
            dataset.skipped.add(dataset.items[i].path, f"its control image {control.name}: {exc}")
            placements.append(None)
            continue
        placements.append(place(width, height, [placement.bucket]))
        kept.append(i)
    contents = {path: file_hash(path) for path in {controls[i] for i in kept}}
    dataset.controls, dataset.control_placements = controls, placements
    dataset.control_keys = [latent_key(contents[c], p) if p is not None else "" for c, p in zip(controls, placements)]
    dataset.keep(kept)


def cache_controls(dataset: FolderImages, store: ShardStore, vae, rank, world, barrier, show) -> None:
    """The items' control latents from the store (this process encoding its share of what it lacks); items whose
    control cannot be decoded are skipped."""
    as_items = [ImageItem(path, "", 0, 0) for path in dataset.controls]
    latents, reasons = store_latents(as_items, dataset.control_placements, store, vae, rank, world, barrier, show,
                                     "caching control images' latents", keys=dataset.control_keys)
    for i, why in reasons.items():
        dataset.skipped.add(dataset.items[i].path, f"its control image {dataset.controls[i].name}: {why}")
    dataset.cached_controls = latents
    dataset.keep([i for i, latent in enumerate(latents) if latent is not None])


def first_edits(data: DataConfig) -> list[tuple[str, Path]]:
    """The first pictures of data.path (in name order, each once): their captions and control images, what a sample
    grid edits when sample.prompts and sample.control_images are unset."""
    scanned = scan_folders(data_folders(data), 0, Skipped(), first=GRID_EDITS)  # the rest of the folder unread
    items = list({item.path: item for item in scanned}.values())
    controls = _controls_of(items, [folder for folder, _ in data_folders(data)], data)
    return list(zip([item.caption for item in items], controls))

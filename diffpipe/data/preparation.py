"""A folder's data prepared for a run (`prepare_folder_images`): its images (and clips) scanned, split into training
and held-out items, placed in their buckets, their controls, first frames and masks found, and, with data.cache,
their latents and captions' text-encoder outputs read from the cache (each process encoding its share of what it
lacks). data/images.py holds the dataset this makes and its cache keys; data/controls.py and data/first_frames.py
what an edit or image-to-video model adds.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from rich.progress import track

from ..config import DataConfig
from ..errors import DataError
from ..models.folder import component_weights, fingerprint_files, has_component
from ..models.text import CaptionEncoder
from .batches import step_texts
from .buckets import Bucket, Placement, place
from .cache import ShardStore, fill_store
from .controls import cache_controls, find_controls
from .first_frames import cache_first_frames, find_first_frames
from .folder import BadImage, ImageItem, Skipped, files_beside, read_rgb, scan_folders, uncaptioned_note
from .images import (FolderImages, cache_folder, caption_key, data_buckets, data_folders, file_hash, latent_key,
                     regularisation_folders, smallest_side, store_latents)
from .videos import clip_frames

__all__ = ["prepare_folder_images", "latent_keys"]


def prepare_folder_images(data: DataConfig, model_path: Path, vae, text: CaptionEncoder, rank: int = 0, world: int = 1,
                          barrier: Callable[[], None] = lambda: None, show: bool = True,
                          frame_buckets: list[int] | None = None, first_frames: bool = False) -> FolderImages:
    """Scan, bucket and (with data.cache) cache latents and text outputs, this process computing its share of what is
    missing; every process returns the same dataset. Skipped files are printed once (by rank 0) and counted.
    `frame_buckets` (video families): clip lengths in frames; videos are then read too. `first_frames`
    (image-to-video): each clip's first frame is encoded too, as the model is given it."""
    buckets = data_buckets(data)
    videos = frame_buckets is not None
    skipped = Skipped(kind="image or video" if videos else "image")
    min_side = smallest_side(buckets)
    items = scan_folders(data_folders(data), min_side, skipped, videos)
    if data.eval_path:
        eval_items = scan_folders(data_folders(data, eval_split=True), min_side, skipped, videos)
    else:
        items, eval_items = _hold_out(items, data.eval_fraction)
    if data.regularisation_path:  # after the eval split: it holds out training images only
        items += [replace(item, loss_weight=data.regularisation_weight)
                  for item in scan_folders(regularisation_folders(data), min_side, skipped, videos)]
    dataset = _placed(items, buckets, skipped, vae, frame_buckets)
    held = _placed(eval_items, buckets, skipped, vae, frame_buckets) if eval_items else None
    if data.cache:  # the models' fingerprints (a read of their weight files) once for both splits
        if rank == 0:
            print(f"cache: {cache_folder(data)} (data.cache_dir moves it)", flush=True)
        vaes = [name for name in ("vae", "audio_vae") if has_component(model_path, name)]  # LTX-2: both
        vae_fingerprint = fingerprint_files([f for name in vaes for f in component_weights(model_path, name)])
        latent_store = ShardStore(cache_folder(data) / f"latents-{vae_fingerprint[:16]}")
        text_store = ShardStore(cache_folder(data) / f"text-{text.fingerprint()[:16]}")

    parts = (dataset, held) if held is not None else (dataset,)
    if data.control_path:  # a missing control stops the run here, before anything is encoded
        for part in parts:
            find_controls(part, data)
    first_frame_pictures = first_frames and not data.control_path and text.reads_pictures
    for part in parts:
        # each item's key (its file's bytes, hashed once, and its placement): its latents' in the cache, and its first
        # frame's picture's where the text encoder reads first frames (Wan 2.1 I2V's CLIP)
        keys = latent_keys(part.items, part.placements) if data.cache or first_frame_pictures else None
        if first_frames and not data.control_path:
            find_first_frames(part, keys if first_frame_pictures else None)
        if text.reads_pictures:  # the text encoder reads each control picture with its caption
            text.show(part.picture_readers())
        if data.cache:
            clip_keys = _cache_latents(part, keys, latent_store, vae, rank, world, barrier, show)
            if part.first_frames:
                cache_first_frames(part, clip_keys, latent_store, vae, rank, world, barrier, show)
            elif part.controls is not None:
                cache_controls(part, latent_store, vae, rank, world, barrier, show)
            _cache_text(part, text_store, text, rank, world, barrier, show)
        else:
            _check_decodes(part)
    if rank == 0 and skipped.files:
        print(skipped.warning(), flush=True)
    if rank == 0 and (note := uncaptioned_note(dataset.items)):
        print(note, flush=True)
    if not dataset.items:
        what = "images or videos" if videos else "images"
        raise FileNotFoundError(f"data.path: no usable {what} in {', '.join(str(f) for f, _ in data_folders(data))}")
    dataset.held_out = held if held is not None and held.items else None
    if data.mask_path:
        dataset.masks = _find_masks(dataset.items, data)
    return dataset


def _find_masks(items: list[ImageItem], data: DataConfig) -> list[Path]:
    """Each picture's mask in data.mask_path (its path under its data.path folder, any image suffix), each checked
    to decode at the picture's size: a missing or broken mask stops the run before it starts, naming the file."""
    folders = [folder for folder, _ in data_folders(data) + regularisation_folders(data)]
    masks = files_beside(items, folders, Path(data.mask_path), "data.mask_path",
                         "mask (white: trained, black: left out)")
    for mask, item in {m: i for m, i in zip(masks, items)}.items():
        try:
            size = read_rgb(mask).size
        except BadImage as exc:
            raise DataError(f"data.mask_path: {mask} {exc}; replace it, or unset data.mask_path") from None
        if size != (item.width, item.height):
            raise DataError(f"data.mask_path: {mask} is {size[0]}x{size[1]} pixels but its picture {item.path} is "
                            f"{item.width}x{item.height}; a mask must be its picture's size")
    return masks


def _placed(items: list[ImageItem], buckets: list[Bucket], skipped: Skipped, vae,
            frame_buckets: list[int] | None) -> FolderImages:
    if frame_buckets is None:
        return FolderImages(items, [place(i.width, i.height, buckets) for i in items], skipped, vae=vae)
    kept, placements = [], []
    # a VAE that reads clips at a frame rate of its own counts their frames at it (LTX-2's codec: 24 a second)
    frames_of = getattr(vae, "frames_of", lambda item: item.frames)
    for item in items:
        try:
            offered = frames_of(item)
        except BadImage as exc:
            skipped.add(item.path, str(exc))
            continue
        frames = clip_frames(offered, frame_buckets)
        if frames is None:
            if not any(path == item.path for path, _ in skipped.files):  # once, not once per repeat
                counted = (f"{offered} frames" if offered == item.frames
                           else f"{item.frames} frames, {offered} at the frame rate the model reads")
                skipped.add(item.path, f"a still image, and data.frame_buckets {frame_buckets} has no 1"
                            if not item.frames else f"too short: {counted}, and the shortest clip of "
                            f"data.frame_buckets {frame_buckets} is {min(b for b in frame_buckets if b > 1)}")
            continue
        kept.append(item)
        placements.append(place(item.width, item.height, buckets, frames))
    return FolderImages(kept, placements, skipped, vae=vae)


def _hold_out(items: list[ImageItem], fraction: float) -> tuple[list[ImageItem], list[ImageItem]]:
    """Every k-th distinct image file (k = 1 / fraction, in name order) goes to the eval split, all its repeats
    with it; the rest trains."""
    if not fraction:
        return items, []
    every = max(2, round(1 / fraction))
    files = sorted({item.path for item in items})
    held = {path for i, path in enumerate(files) if i % every == every - 1}
    return [i for i in items if i.path not in held], list({i.path: i for i in items if i.path in held}.values())


def _check_decodes(dataset: FolderImages) -> None:
    """Uncached, every image (and control image) is decoded once now: a broken one never fails a step."""
    kept = []
    for i, (item, placement) in enumerate(zip(dataset.items, dataset.placements)):
        try:
            dataset.reader(item, placement)
            if dataset.controls is not None and not dataset.first_frames:  # a first frame: read with its clip
                read_rgb(dataset.controls[i])
            kept.append(i)
        except BadImage as exc:
            dataset.skipped.add(item.path, str(exc))
    dataset.keep(kept)


def latent_keys(items: list[ImageItem], placements: list[Placement]) -> list[str]:
    """Each item's `latent_key`: its file's bytes (each file read once) and its placement."""
    contents = {path: file_hash(path) for path in {item.path for item in items}}
    return [latent_key(contents[item.path], p) for item, p in zip(items, placements)]


def _cache_latents(dataset: FolderImages, keys: list[str], store: ShardStore, vae, rank, world, barrier,
                   show) -> list[str]:
    """The items' latents from the store under their `keys` (`latent_keys`); returns the kept items' keys."""
    latents, reasons = store_latents(dataset.items, dataset.placements, store, vae, rank, world, barrier, show,
                                     "caching VAE latents", keys=keys, reader=dataset.reader)
    for i, why in reasons.items():
        dataset.skipped.add(dataset.items[i].path, why)
    dataset.latents = latents
    kept = [i for i, latent in enumerate(latents) if latent is not None]
    dataset.keep(kept)
    return [keys[i] for i in kept]


def _cache_text(dataset: FolderImages, store: ShardStore, text: CaptionEncoder, rank, world, barrier, show) -> None:
    """Every text a step may ask for: each caption, and "" (a caption dropped for guidance); for an encoder that
    reads pictures, each joined with its item's control picture."""
    captions = {caption_key(c): c for c in sorted(set(step_texts(text, dataset)) or {""})}

    def compute(keys: list[str]):
        entries = {}
        size = 8 if text.reads_pictures else 64  # a picture is a thousand positions of text at 1024^2
        chunks = [keys[s:s + size] for s in range(0, len(keys), size)]
        for chunk in track(chunks, description="caching text-encoder outputs", disable=not (show and rank == 0)):
            texts = [captions[k] for k in chunk]
            hidden, pooled = text.encode(texts)
            entries.update({k: {"hidden": h.cpu(), "pooled": p.cpu()}
                            for k, h, p in zip(chunk, text.rows(texts, hidden), pooled)})
        return entries, {}

    entries, _ = fill_store(store, list(captions), compute, rank, world, barrier)
    text.remember({captions[k]: (e["hidden"], e["pooled"]) for k, e in entries.items()})

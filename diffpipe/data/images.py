"""A folder dataset ready to train on: images (and for video families, videos) scanned and bucketed, VAE latents and
text-encoder outputs cached.

For a video family every item is a clip (3, F, H, W): a video's first F frames, F its frame bucket, or a still
image as a clip of one frame; a batch holds one aspect-ratio bucket and one frame bucket.

Cache keys (data/cache.py) are fingerprints: a latent's of the image file's bytes, its bucket, crop and flip, in a
store named by the VAE weights' fingerprint; a caption's of its text, in a store named by the text encoders' and
tokenizers' fingerprint. A second run reuses every entry; a changed image misses exactly its own; another VAE or
text encoder gets its own store. With `data.cache = false` nothing is stored: the frozen VAE and text encoders run
inside each step.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from PIL import Image
from rich.progress import track

from .. import seeds
from ..config import DataConfig
from ..written_files import cache_home
from ..models.vae import encode_latents
from .buckets import Bucket, Placement, clip_to_pixels, make_buckets, placed, to_pixels
from .cache import ShardStore, fill_store
from .folder import BadImage, ImageItem, Skipped, read_rgb
from .frames import first_frame_pixels, placed_first_frame
from .videos import read_clip

__all__ = ["FolderImages", "data_buckets", "cache_folder", "read_pixels",
           "regularisation_folders", "store_latents", "data_folders"]

_CHUNK = 8  # images per VAE call (clips: one per call)


def smallest_side(buckets: list[Bucket]) -> int:
    """The shortest side a picture or clip needs to be trained on: half the smallest bucket's."""
    return min(min(b.width, b.height) for b in buckets) // 2


def data_buckets(data: DataConfig) -> list[Bucket]:
    if data.bucket_sizes is not None:
        return sorted({Bucket(w, h) for w, h in data.bucket_sizes})
    if not data.buckets:
        return [Bucket(data.resolution, data.resolution)]
    return make_buckets(data.resolution, data.bucket_step, data.max_aspect)


def data_folders(data: DataConfig, eval_split: bool = False) -> list[tuple[Path, int]]:
    """(folder, repeats) of data.path, or with `eval_split` of data.eval_path (each once)."""
    chosen = data.eval_path if eval_split else data.path
    paths = [chosen] if isinstance(chosen, str) else list(chosen or [])
    if eval_split:
        return [(Path(p), 1) for p in paths]
    repeats = data.repeats if isinstance(data.repeats, list) else [data.repeats] * len(paths)
    return [(Path(p), r) for p, r in zip(paths, repeats)]


def regularisation_folders(data: DataConfig) -> list[tuple[Path, int]]:
    """(folder, 1) of data.regularisation_path."""
    chosen = data.regularisation_path
    return [(Path(p), 1) for p in ([chosen] if isinstance(chosen, str) else list(chosen or []))]


def cache_folder(data: DataConfig) -> Path:
    """data.cache_dir, else a folder of diffpipe's cache home named for the first data folder (its name and a hash
    of its absolute path): runs on the same data share it, and nothing is written into the user's folders. A cache
    an earlier diffpipe wrote inside the data folder (`.diffpipe_cache`) is still used where it is."""
    if data.cache_dir:
        return Path(data.cache_dir)
    first = data_folders(data)[0][0]
    if (first / ".diffpipe_cache").is_dir():
        return first / ".diffpipe_cache"
    where = hashlib.sha256(str(first.expanduser().resolve()).encode()).hexdigest()[:12]
    return cache_home() / "data" / f"{first.name}-{where}"


def file_hash(path: Path) -> str:
    """sha256 of the file's bytes, read in blocks (videos may be large)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def latent_key(content: str, placement: Placement, flip: bool = False) -> str:
    p = placement
    text = f"{content}/{p.bucket}/{p.resized[0]}x{p.resized[1]}/{p.left},{p.top}/flip={int(flip)}"
    if p.frames:  # (images of image models keep the keys they had before clips existed)
        text += f"/frames={p.frames}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def caption_key(caption: str) -> str:
    return hashlib.sha256(caption.encode()).hexdigest()[:40]


def read_pixels(item: ImageItem, placement: Placement) -> torch.Tensor:
    """What the VAE encodes of an item: (3, H, W) for an image model, (3, F, H, W) for a video family's clip."""
    if not placement.frames:
        return to_pixels(read_rgb(item.path), placement)
    frames = [read_rgb(item.path)] if item.frames == 0 else read_clip(item.path, placement.frames)
    return clip_to_pixels(frames, placement)


@dataclass
class FolderImages:
    """Items with their placements; `latents` (one per item) when cached, else the VAE encodes them per step."""

    items: list[ImageItem]
    placements: list[Placement]
    skipped: Skipped
    latents: list[torch.Tensor] | None = None
    vae: torch.nn.Module | None = None
    held_out: "FolderImages | None" = None  # the eval split (data.eval_fraction / data.eval_path), if any
    masks: list[Path] | None = None  # data.mask_path's file for each item
    _mask_weights: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # by item, once read
    controls: list[Path] | None = None  # data.control_path's file for each item (data/controls.py)
    control_placements: list[Placement] | None = None  # each control in its item's bucket
    cached_controls: list[torch.Tensor] | None = None  # their latents, when cached
    control_keys: list[str] | None = None  # each control as placed: its latents' key, and its picture's for the text
    first_frames: bool = False  # the controls are each clip's own first frame (image-to-video: data/first_frames.py)

    def keep(self, kept: list[int]) -> None:
        """Only the items at `kept`, with everything held per item."""
        for name in ("items", "placements", "latents", "controls", "control_placements", "cached_controls",
                     "control_keys"):
            if getattr(self, name) is not None:
                setattr(self, name, [getattr(self, name)[i] for i in kept])

    @property
    def kind(self) -> str:
        """What the items are, in the user's words: clips (a video family's) or images."""
        return "clips" if any(p.frames for p in self.placements) else "images"

    @property
    def captions(self) -> list[str]:
        return [item.caption for item in self.items]

    def summary(self, held_out: "FolderImages | None") -> str:
        """What the run trains on, for the log: items per bucket, and those held out for the eval loss."""
        counts = list(self.bucket_counts().items())
        held = f"; {len(held_out.items)} held out for the eval loss" if held_out is not None else ""
        return (f"{len(self.items)} {self.kind} in {len(counts)} bucket(s): "
                + ", ".join(f"{b} {n}" for b, n in counts) + held)

    def bucket_counts(self) -> dict[str, int]:
        """Items per bucket (and frame bucket), by name, narrowest bucket first."""
        counts = Counter((p.bucket, p.frames) for p in self.placements)
        names = {(p.bucket, p.frames): p.name for p in self.placements}
        return {names[key]: counts[key] for key in sorted(counts)}

    def groups(self) -> list[list[int]]:
        """Indices of the items of each bucket (and frame bucket): what may share a batch."""
        groups: dict[tuple[Bucket, int], list[int]] = {}
        for i, p in enumerate(self.placements):
            groups.setdefault((p.bucket, p.frames), []).append(i)
        return [groups[b] for b in sorted(groups)]

    def steps_per_epoch(self, batch_size: int) -> int:
        """Each bucket's items in batches, the last one filled up from the bucket's start (`batch_indices`)."""
        return sum(-(-len(g) // batch_size) for g in self.groups())

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        """The step's items, all from one bucket. Each epoch shuffles every bucket's items, cuts them into batches
        (a bucket's last batch filled up from its start) and shuffles the batches; seeded by (seed, epoch), so every
        process draws the same."""
        groups = self.groups()
        per_epoch = self.steps_per_epoch(batch_size)
        epoch, position = divmod(step, per_epoch)
        gen = torch.Generator().manual_seed(seeds.of_epoch(seed, epoch))
        batches = []
        for group in groups:
            order = [group[i] for i in torch.randperm(len(group), generator=gen).tolist()]
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                while len(batch) < batch_size:
                    batch += order[:batch_size - len(batch)]
                batches.append(batch)
        return batches[torch.randperm(per_epoch, generator=gen)[position]]

    @property
    def reader(self) -> Callable[[ImageItem, Placement], torch.Tensor]:
        """What the VAE encodes of an item: its pixels (`read_pixels`), or what a VAE that reads items itself makes
        of it (LTX-2's codec: the clip with its audio)."""
        read_item = getattr(self.vae, "read_item", None)
        return read_pixels if read_item is None else partial(read_item, read_pixels=read_pixels)

    def x0(self, indices: list[int]) -> torch.Tensor:
        if self.latents is not None:
            return torch.stack([self.latents[i] for i in indices])
        pixels = torch.stack([self.reader(self.items[i], self.placements[i]) for i in indices])
        return encode_latents(self.vae, pixels).cpu()

    def control_latents(self, indices: list[int]) -> torch.Tensor | None:
        """The items' control images' latents (data.control_path), each placed in its item's bucket; None without."""
        if self.controls is None:
            return None
        if self.cached_controls is not None:
            return torch.stack([self.cached_controls[i] for i in indices])
        if self.first_frames:
            pixels = torch.stack([first_frame_pixels(self.items[i], self.control_placements[i]) for i in indices])
        else:
            pixels = torch.stack([to_pixels(read_rgb(self.controls[i]), self.control_placements[i]) for i in indices])
        return encode_latents(self.vae, pixels).cpu()

    def control_pictures(self, indices: list[int]) -> list[str] | None:
        """The keys of the items' control pictures as placed (what `picture_readers` reads), None without."""
        return None if self.control_keys is None else [self.control_keys[i] for i in indices]

    def picture_readers(self) -> dict[str, Callable[[], Image.Image]]:
        """Each control picture, placed in its item's bucket, by its key: what a text encoder that reads pictures
        is shown (CaptionEncoder.show)."""
        if self.control_keys is None:
            return {}
        reader = placed_first_frame if self.first_frames else _placed_picture  # a clip's picture: its first frame
        return {key: partial(reader, path, placement)
                for key, path, placement in zip(self.control_keys, self.controls, self.control_placements)}

    def loss_weights(self, indices: list[int]) -> torch.Tensor:
        """Each item's loss weight: data.regularisation_weight for regularisation images, else 1."""
        return torch.tensor([self.items[i].loss_weight for i in indices], dtype=torch.float32)

    def loss_masks(self, indices: list[int], latent_size: tuple[int, int]) -> torch.Tensor | None:
        """The items' loss masks (data.mask_path) placed as their pictures and averaged down to the latents'
        (height, width): (B, 1, h, w) in [0, 1]; None without masks."""
        if self.masks is None:
            return None
        for i in indices:
            if i not in self._mask_weights:
                placed = to_pixels(read_rgb(self.masks[i]), self.placements[i]).mean(0) * 0.5 + 0.5
                self._mask_weights[i] = F.interpolate(placed[None, None], size=tuple(latent_size), mode="area")[0]
        return torch.stack([self._mask_weights[i] for i in indices])

    def size_ids(self, indices: list[int]) -> torch.Tensor:
        """SDXL's time ids per item: original (height, width), crop (top, left), target (height, width)."""
        rows = []
        for i in indices:
            item, p = self.items[i], self.placements[i]
            rows.append([item.height, item.width, p.top, p.left, p.bucket.height, p.bucket.width])
        return torch.tensor(rows, dtype=torch.float32)


def _placed_picture(path: Path, placement: Placement) -> Image.Image:
    return placed(read_rgb(path), placement)


def _by_shape(ready: list[tuple[str, torch.Tensor]]):
    shapes: dict[tuple, list] = {}
    for key, pixels in ready:
        shapes.setdefault(tuple(pixels.shape), []).append((key, pixels))
    for group in shapes.values():
        yield [k for k, _ in group], torch.stack([p for _, p in group])


def store_latents(items: list[ImageItem], placements: list[Placement], store: ShardStore, vae, rank, world, barrier,
                  show: bool, description: str, keys: list[str],
                  reader: Callable[[ImageItem, Placement], torch.Tensor] = read_pixels
                  ) -> tuple[list[torch.Tensor | None], dict[int, str]]:
    """Each item's latent as placed, from the store, this process encoding its share of what the store lacks; None
    for an item that cannot be read, with the reason by the first such index of each file. `keys`: the items' keys
    in the store (`latent_keys`, or a control's: data/controls.py, data/first_frames.py). `reader`: the pixels the
    VAE encodes of an item (its picture or clip; first_frames.py: a clip's first frame)."""
    first_index: dict[str, int] = {}  # repeated items share a key
    for i, key in enumerate(keys):
        first_index.setdefault(key, i)

    def compute(wanted: list[str]):
        entries, failed = {}, {}
        todo = sorted(((k, first_index[k]) for k in wanted), key=lambda ki: placements[ki[1]].bucket)
        size = 1 if any(p.frames > 1 for p in placements) else _CHUNK
        chunks = [todo[s:s + size] for s in range(0, len(todo), size)]
        for chunk in track(chunks, description=description, disable=not (show and rank == 0)):
            ready = []
            for key, i in chunk:
                try:
                    ready.append((key, reader(items[i], placements[i])))
                except BadImage as exc:
                    failed[key] = str(exc)
            for chunk_keys, pixels in _by_shape(ready):
                entries.update({k: {"latent": z} for k, z in zip(chunk_keys, encode_latents(vae, pixels).cpu())})
        return entries, failed

    entries, failed = fill_store(store, list(first_index), compute, rank, world, barrier)
    reasons = {i: failed[key] for i, key in enumerate(keys) if key in failed and first_index[key] == i}
    return [entries[key]["latent"] if key in entries else None for key in keys], reasons

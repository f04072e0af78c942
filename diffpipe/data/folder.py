"""Folders of images with captions, as kohya sd-scripts, diffusion-pipe and Hugging Face's imagefolder lay them out.

A caption comes from `metadata.jsonl` (one JSON object per line with `file_name` and `text` or `caption`) when the
folder has one, else from a same-named `.txt` beside the image (`cat.jpg` and `cat.txt`), or `.caption` (kohya's
default); an image without any gets the empty caption; a caption file that is not UTF-8 is refused, naming it. jpg,
png, webp, bmp, tiff and avif (`IMAGE_SUFFIXES`); EXIF orientation applied; grey, palette, RGBA (on white), CMYK,
16-bit and float images converted to 8-bit RGB. Files that cannot be used (zero bytes, not an image, truncated, too
small, past Pillow's size limit, a picture or clip of a kind not read: gif, heic, ...) are skipped and reported by
`Skipped`, never trained on, never silently left out and never a crash mid-run. For video families the folders'
videos are listed too (data/videos.py).
"""
from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import BadImage, DataError

__all__ = ["ImageItem", "Skipped", "scan_folders", "read_rgb", "BadImage", "IMAGE_SUFFIXES", "uncaptioned_note",
           "probe_image", "files_beside"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jfif", ".png", ".webp", ".bmp", ".tif", ".tiff", ".avif")
# pictures and clips a folder may hold that are not read: each is reported as skipped, not silently left out
_NOT_READ = (".gif", ".apng", ".heic", ".heif", ".jxl", ".jp2", ".psd", ".tga", ".exr", ".hdr", ".dds", ".ico",
             ".qoi", ".ppm", ".pgm", ".pbm", ".svg", ".raw", ".dng", ".cr2", ".nef", ".arw")


@dataclass(frozen=True)
class ImageItem:
    path: Path
    caption: str
    width: int  # as seen, EXIF orientation applied
    height: int
    frames: int = 0  # a video's frames; 0: a still image
    frame_rate: float = 0.0  # a video's frames a second, as its container states them (read with its frames)
    loss_weight: float = 1.0  # data.regularisation_weight for a regularisation image, else 1


@dataclass
class Skipped:
    """Files left out, with the reason for each."""

    files: list[tuple[Path, str]] = field(default_factory=list)
    kind: str = "image"  # what the files were meant to be, in the warning

    def add(self, path: Path, reason: str) -> None:
        self.files.append((path, reason))

    def __len__(self) -> int:
        return len(self.files)

    def warning(self) -> str:
        """One line counting the skipped files and naming a few."""
        named = "; ".join(f"{p.name}: {why}" for p, why in self.files[:3])
        more = f"; and {len(self.files) - 3} more" if len(self.files) > 3 else ""
        return f"warning: skipped {len(self.files)} {self.kind} file(s) that cannot be trained on ({named}{more})"


def _metadata_captions(folder: Path) -> dict[str, str]:
    path = folder / "metadata.jsonl"
    if not path.is_file():
        return {}
    captions = {}
    text = _read_caption_file(path)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            captions[row["file_name"]] = str(row.get("text", row.get("caption", "")))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{path}, line {number}: expected a JSON object with file_name and text") from None
    return captions


def _caption(image: Path, metadata: dict[str, str], folder: Path) -> str:
    relative = image.relative_to(folder).as_posix()
    if relative in metadata:
        return metadata[relative]
    for suffix in (".txt", ".caption"):  # .caption: kohya sd-scripts' default caption_extension
        beside = image.with_suffix(suffix)
        if beside.is_file():
            return _read_caption_file(beside).strip()
    return ""


def _read_caption_file(path: Path) -> str:
    """A caption file's text: UTF-8 (a byte-order mark dropped), else refused naming the file, as a caption that
    trained with its letters replaced by "\ufffd" would teach the model nothing it was meant to (one rule for .txt
    captions and metadata.jsonl)."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None


def _oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) once the EXIF orientation is applied (5..8 turn the image a quarter)."""
    orientation = image.getexif().get(0x0112, 1)
    w, h = image.size
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def probe_image(path: Path) -> tuple[int, int, int, float]:
    """(width, height, 0, 0.0) of an image as seen (EXIF orientation applied), from its header (the frames and frame
    rate of a still image, as `probe_video` gives a video's); `BadImage` when unreadable."""
    with _pillow_size_limit():
        try:
            with Image.open(path) as image:
                return (*_oriented_size(image), 0, 0.0)
        except (UnidentifiedImageError, OSError) as exc:
            raise BadImage(f"not a readable image ({type(exc).__name__})") from None


@contextlib.contextmanager
def _pillow_size_limit():
    """Pillow's warning for images between its two size limits (89 and 179 M pixels) silenced: such a photo is
    read, and resized to its bucket like any other; past the upper limit Pillow refuses it, a `BadImage` here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            yield
        except Image.DecompressionBombError:
            raise BadImage(f"too large for Pillow to open (over its limit of {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} "
                           "M pixels); downscale it, e.g. its long side to 8192 pixels") from None


def scan_folders(folders: list[tuple[Path, int]], min_side: int, skipped: Skipped,
                 videos: bool = False, first: int | None = None) -> list[ImageItem]:
    """Every usable image (and with `videos`, video) of the folders (subfolders included), each listed `repeats`
    times, in a stable order; with `first`, only the first that many usable files (the rest not read: a sample grid's
    pictures of a large dataset). Reads only the headers: truncated files are caught when they are decoded."""
    from .videos import VIDEO_SUFFIXES, probe_video

    probes = dict.fromkeys(IMAGE_SUFFIXES, probe_image) | (dict.fromkeys(VIDEO_SUFFIXES, probe_video) if videos else {})
    not_read = set(_NOT_READ) | (set() if videos else set(VIDEO_SUFFIXES))
    listed = probes.keys() | not_read
    items, usable = [], 0
    for folder, repeats in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"data.path: {folder} is not a folder")
        metadata = _metadata_captions(folder)
        for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in listed and p.is_file()):
            suffix = path.suffix.lower()
            if suffix in not_read:
                skipped.add(path, _not_read_reason(suffix, videos))
                continue
            try:
                if path.stat().st_size == 0:
                    raise BadImage("empty file (0 bytes)")
                width, height, frames, rate = probes[suffix](path)
            except BadImage as exc:
                skipped.add(path, str(exc))
                continue
            if min(width, height) < min_side:
                skipped.add(path, f"{width}x{height} is too small (shorter side under {min_side} pixels)")
                continue
            items += [ImageItem(path, _caption(path, metadata, folder), width, height, frames, rate)] * repeats
            usable += 1
            if usable == first:
                return items
    return items


def _not_read_reason(suffix: str, videos: bool) -> str:
    from .videos import VIDEO_SUFFIXES

    if suffix in VIDEO_SUFFIXES:
        return "a video, and this model trains still images"
    read = " ".join(IMAGE_SUFFIXES + (VIDEO_SUFFIXES if videos else ()))
    return f"{suffix} files are not read (read: {read}); convert it to .png or .jpg"


def files_beside(items: list[ImageItem], folders: list[Path], root: Path, setting: str, what: str) -> list[Path]:
    """Each item's file in `root` (data.mask_path, data.control_path): under the item's path relative to the one of
    `folders` holding it, with the same name and any image suffix. A missing one stops the run before it starts,
    naming the picture and what to do (`what`: what the file is, in the user's words)."""
    folders = [folder.resolve() for folder in folders]
    found = []
    for item in items:
        picture = item.path.resolve()
        folder = next(f for f in folders if picture.is_relative_to(f))
        stem = picture.relative_to(folder).with_suffix("")
        beside = [root / f"{stem}{suffix}" for suffix in IMAGE_SUFFIXES if (root / f"{stem}{suffix}").is_file()]
        if not beside:
            raise DataError(f"{setting}: {item.path} has no {what} in {root} (looked for {stem} with any of "
                            f"{' '.join(IMAGE_SUFFIXES)} there); add one for every picture, or unset {setting}")
        found.append(beside[0])
    return found


def uncaptioned_note(items: list[ImageItem]) -> str | None:
    """One line counting the files trained with the empty caption (no .txt beside them, not in metadata.jsonl)."""
    empty = sorted({item.path for item in items if not item.caption})
    if not empty:
        return None
    named = ", ".join(p.name for p in empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
    return (f"note: {len(empty)} of {len({item.path for item in items})} file(s) have no caption ({named}): "
            "trained with the empty caption; add NAME.txt beside each or a metadata.jsonl line")


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit grey: scale to 8 bits, not clip
        pixels = np.asarray(image, dtype=np.float64)
        image = Image.fromarray((pixels / max(pixels.max(), 1) * 255 if pixels.max() > 255 else pixels).astype(np.uint8))
    if image.mode == "F":  # float grey (a TIFF): 0..1 as 0..255, a larger range scaled by its largest value
        pixels = np.clip(np.nan_to_num(np.asarray(image, dtype=np.float64)), 0, None)
        image = Image.fromarray((pixels / max(pixels.max(), 1.0) * 255).round().astype(np.uint8))
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA"):
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")  # L, CMYK, YCbCr, RGB


def read_rgb(path: Path) -> Image.Image:
    """The image decoded in full, oriented by its EXIF tag, as 8-bit RGB; `BadImage` when it cannot be."""
    with _pillow_size_limit():
        try:
            with Image.open(path) as image:
                image.load()  # decodes everything: a truncated file fails here
                return _to_rgb(ImageOps.exif_transpose(image))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise BadImage(f"cannot be decoded ({exc})") from None

"""Grids of samples as files: rows of seeds, columns of prompts, each labelled, tiny images enlarged to be seen.

Written by `diffpipe train` (samples.png at the end, samples/step-N.png during training, .gif for clips) and by
`diffpipe sample`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from .sampling import images_to_pil

__all__ = ["save_grid", "enlargement", "label_margins"]

MIN_SIDE_PX = 64  # smaller images (8x8 digits) are enlarged, nearest neighbour, to at least this height
_LINES = 3  # lines of a column's prompt; longer prompts end in "..."
_PAD = 3


def enlargement(height: int) -> int:
    """How many times an image `height` pixels high is enlarged in a grid: to at least MIN_SIDE_PX."""
    return -(-MIN_SIDE_PX // height)


def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()


def _line_height(font) -> int:
    left, top, right, bottom = font.getbbox("Ag")
    return bottom - top + 2


def label_margins(row_labels: list[str]) -> tuple[int, int]:
    """(left, top): the pixels a labelled grid adds, beside its rows and above its columns."""
    font = _font()
    left = max(int(font.getlength(label)) for label in row_labels) + 2 * _PAD
    return left, _LINES * _line_height(font) + 2 * _PAD


def _wrapped(text: str, width: int, font) -> list[str]:
    """`text` in lines no wider than `width` pixels, at most _LINES of them (the last ending in "..." if cut)."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if font.getlength(candidate) <= width or not line:
            line = candidate
        else:
            lines.append(line)
            line = word
    lines.append(line)
    if len(lines) > _LINES:
        lines = lines[:_LINES]
        lines[-1] = lines[-1] + "..."
    out = []
    for line in lines:  # a single word wider than the column: cut
        while len(line) > 1 and font.getlength(line) > width:
            line = line[:-4] + "..." if len(line) > 4 else line[:-1]
        out.append(line)
    return out


def save_grid(images: torch.Tensor, rows: int, path: str | Path, columns: list[str] | None = None,
              row_labels: list[str] | None = None) -> Path:
    """Images (rows x cols, row-major) tiled edge to edge, enlarged when tiny (`enlargement`), each column headed by
    its prompt (`columns`) and each row by its label (`row_labels`, e.g. "seed 0") when given; clips (N, C, F, H, W)
    as an animated GIF of such grids, beside `path` with the suffix .gif. Returns the file written."""
    scale = enlargement(images.shape[-2])
    if images.dim() == 5:
        frames = [_grid(images[:, :, f], rows, scale, columns, row_labels) for f in range(images.shape[2])]
        path = Path(path).with_suffix(".gif")
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=250, loop=0)
        return path
    _grid(images, rows, scale, columns, row_labels).save(path)
    return Path(path)


def _grid(images: torch.Tensor, rows: int, scale: int, columns: list[str] | None,
          row_labels: list[str] | None) -> Image.Image:
    tiles = images_to_pil(images)
    cols = len(tiles) // rows
    w, h = tiles[0].size
    grid = Image.new(tiles[0].mode, (cols * w, rows * h))
    for i, tile in enumerate(tiles):
        grid.paste(tile, ((i % cols) * w, (i // cols) * h))
    if scale != 1:
        grid = grid.resize((cols * w * scale, rows * h * scale), Image.NEAREST)
    if columns is None and row_labels is None:
        return grid
    return _labelled(grid, rows, cols, columns or [""] * cols, row_labels or [""] * rows)


def _labelled(grid: Image.Image, rows: int, cols: int, columns: list[str], row_labels: list[str]) -> Image.Image:
    """The grid on a white page, each column's prompt above it and each row's label at its left."""
    font = _font()
    left, top = label_margins(row_labels)
    page = Image.new(grid.mode, (left + grid.width, top + grid.height), "white")
    page.paste(grid, (left, top))
    draw, ink, line = ImageDraw.Draw(page), "black", _line_height(font)
    tile_w, tile_h = grid.width // cols, grid.height // rows
    for c, prompt in enumerate(columns):
        for k, text in enumerate(_wrapped(prompt, tile_w - 2 * _PAD, font)):
            draw.text((left + c * tile_w + _PAD, _PAD + k * line), text, fill=ink, font=font)
    for r, label in enumerate(row_labels):
        draw.text((_PAD, top + r * tile_h + _PAD), label, fill=ink, font=font)
    return page

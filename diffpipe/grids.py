"""Grids of samples as files: rows of seeds, columns of prompts, each labelled, tiny images enlarged to be seen.

Written by `diffpipe train` (samples.png at the end, samples/step-N.png during training, .gif for clips) and by
`diffpipe sample`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from .sampling import images_to_pil

__all__ = ["save_grid", "enlargement", "label_margins", "Layout", "grid_layout", "prompt_lines"]

MIN_SIDE_PX = 64  # smaller images (8x8 digits) are enlarged, nearest neighbour, to at least this height
_LINES = 3  # lines of a column's prompt; longer prompts end in "..."
_PAD = 3
GAP_PX = 8  # white between a labelled grid's rows and columns; a column's prompt may run over it


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


@dataclass(frozen=True)
class Layout:
    """Where a grid's tiles lie: `left` and `top` margins for the labels (0 unlabelled), tiles of `tile` (w, h)
    pixels in `cols` x `rows`, `gap` pixels apart."""

    left: int
    top: int
    tile: tuple[int, int]
    cols: int
    rows: int
    gap: int

    def origin(self, index: int) -> tuple[int, int]:
        """(x, y) of tile `index` (row-major)."""
        row, col = divmod(index, self.cols)
        return self.left + col * (self.tile[0] + self.gap), self.top + row * (self.tile[1] + self.gap)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the whole picture (a gap after the last column too: its prompt may run over it)."""
        return (self.left + self.cols * (self.tile[0] + self.gap),
                self.top + self.rows * self.tile[1] + (self.rows - 1) * self.gap)


def grid_layout(tile: tuple[int, int], cols: int, rows: int, row_labels: list[str] | None) -> Layout:
    """The layout of a grid of `tile`-sized (as enlarged) images: labelled (`row_labels` given) with margins and
    gaps, else tiled edge to edge."""
    if row_labels is None:
        return Layout(0, 0, tile, cols, rows, 0)
    left, top = label_margins(row_labels)
    return Layout(left, top, tile, cols, rows, GAP_PX)


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
    """Images (rows x cols, row-major) enlarged when tiny (`enlargement`), tiled edge to edge, or, with each column
    headed by its prompt (`columns`) and each row by its label (`row_labels`, e.g. "seed 0"), `GAP_PX` apart; clips (N, C, F, H, W)
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
    labelled = columns is not None or row_labels is not None
    row_labels = (row_labels or [""] * rows) if labelled else None
    layout = grid_layout((w * scale, h * scale), cols, rows, row_labels)
    page = Image.new(tiles[0].mode, layout.size, "white")
    for i, tile in enumerate(tiles):
        page.paste(tile.resize(layout.tile, Image.NEAREST) if scale != 1 else tile, layout.origin(i))
    if labelled:
        _label(page, layout, columns or [""] * cols, row_labels)
    return page


def prompt_lines(prompt: str, layout: Layout) -> list[str]:
    """A column's prompt as written above it: wrapped to its tile and the gap beside it, at most _LINES lines."""
    return _wrapped(prompt, layout.tile[0] + layout.gap - _PAD, _font())


def _label(page: Image.Image, layout: Layout, columns: list[str], row_labels: list[str]) -> None:
    """Each column's prompt above it (running over the gap beside it) and each row's label at its left."""
    font = _font()
    draw, ink, line = ImageDraw.Draw(page), "black", _line_height(font)
    for c, prompt in enumerate(columns):
        x, _ = layout.origin(c)
        for k, text in enumerate(prompt_lines(prompt, layout)):
            draw.text((x + 1, _PAD + k * line), text, fill=ink, font=font)
    for r, label in enumerate(row_labels):
        _, y = layout.origin(r * layout.cols)
        draw.text((_PAD, y + _PAD), label, fill=ink, font=font)

"""Grids of samples as a user opens them: the tiles exactly as generated (tiny ones enlarged to be seen), each column
headed by its prompt and each row by its seed, a long prompt kept within its column, its words whole where they fit
a tile and its gap ("a handwri..." cut the digits' prompts: issue 56), rows and columns apart."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from diffpipe.grids import GAP_PX, grid_layout, label_margins, save_grid
from diffpipe.sampling import images_to_pil


def _tiles(n: int, size: int = 8) -> torch.Tensor:
    """n grey images in [-1, 1], each of its own level (so every tile is told apart)."""
    return torch.linspace(-1, 1, n).view(n, 1, 1, 1).expand(n, 1, size, size).contiguous()


def _ink(region: np.ndarray) -> int:
    return int((region < 128).sum())


def test_a_labelled_grid_holds_the_tiles_as_generated_and_a_label_for_each_prompt_and_seed(tmp_path):
    images, prompts, seeds = _tiles(6), ["a digit one", "a digit two", "a digit three"], ["seed 0", "seed 7"]
    page = np.asarray(Image.open(save_grid(images, 2, tmp_path / "grid.png", prompts, seeds)))
    left, top = label_margins(seeds)
    layout = grid_layout((64, 64), 3, 2, seeds)  # 8x8 tiles enlarged to 64 pixels
    assert page.shape == (top + 2 * 64 + GAP_PX, left + 3 * (64 + GAP_PX)) == layout.size[::-1]
    tiles = images_to_pil(images)
    for i, tile in enumerate(tiles):
        want = np.asarray(tile.resize((64, 64), Image.NEAREST))
        x, y = layout.origin(i)
        assert (page[y:y + 64, x:x + 64] == want).all()
    assert (page[top + 64:top + 64 + GAP_PX] == 255).all()  # the rows do not touch
    assert (page[top:, left + 64:left + 64 + GAP_PX] == 255).all()  # nor the columns
    headers = [page[:top, layout.origin(c)[0]:layout.origin(c)[0] + 64 + GAP_PX] for c in range(3)]
    assert all(_ink(h) > 20 for h in headers)
    assert not (headers[0] == headers[1]).all()  # each column its own prompt
    labels = [page[y:y + 64, :left] for y in (layout.origin(0)[1], layout.origin(3)[1])]
    assert all(_ink(label) > 10 for label in labels) and not (labels[0] == labels[1]).all()


def test_the_digits_prompts_keep_their_words_whole(tmp_path):
    """The default font's "handwritten" is 59 pixels, a 64-pixel tile less its padding 58: it was cut."""
    from diffpipe.grids import prompt_lines

    prompt = "a handwritten digit seven"
    lines = prompt_lines(prompt, grid_layout((64, 64), 10, 1, ["seed 0"]))
    assert " ".join(lines) == prompt and not any(line.endswith("...") for line in lines)


def test_a_long_prompt_stays_in_its_column_and_clips_are_labelled_on_every_frame(tmp_path):
    prompt = "a very long prompt about a handwritten digit seven drawn in thick strokes on a dark background, twice"
    images = _tiles(2)
    page = np.asarray(Image.open(save_grid(images, 1, tmp_path / "grid.png", [prompt, ""], ["seed 0"])))
    left, top = label_margins(["seed 0"])
    assert page.shape == (top + 64, left + 2 * (64 + GAP_PX))
    second = left + 64 + GAP_PX
    assert _ink(page[:top, left:second]) > 20 and _ink(page[:top, second:]) == 0
    clips = torch.stack([_tiles(2) * (f + 1) / 3 for f in range(3)], dim=2)  # (2, 1, 3 frames, 8, 8), each its own
    gif = Image.open(save_grid(clips, 1, tmp_path / "clips.png", ["one", "two"], ["seed 0"]))
    assert gif.n_frames == 3 and gif.size == (left + 2 * (64 + GAP_PX), top + 64)
    for frame in range(3):
        gif.seek(frame)
        assert _ink(np.asarray(gif.convert("L"))[:top, left:]) > 20

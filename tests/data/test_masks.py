"""data.mask_path: a loss mask beside each picture (kohya's masked loss), placed as its picture is (resized and
cropped into the same bucket) and averaged down to the latents; white trains as no mask does, black leaves a pixel
out, grey weighs it in between, through 1 and 2 stages alike; a missing, broken or mis-sized mask stops the run
before it starts, naming the file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from diffpipe.config_files import build_config
from diffpipe.data.folder import read_rgb
from diffpipe.data.images import read_pixels
from diffpipe.data.preparation import _find_masks
from diffpipe.errors import DataError

from ..helpers import run_command

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "photos.toml"
QUICK = ["--set", "train.max_steps=2", "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false",
         "--set", "output.save_weights=false", "--set", "data.caption_dropout=0.0", "--set", "observe.log_every=0"]


def _masks_of(photos: Path, masks: Path, colour) -> Path:
    """A mask for every picture of `photos`: `colour` (a grey level) or a function of the picture."""
    masks.mkdir()
    for picture in photos.glob("*.jpg"):
        with Image.open(picture) as image:
            mask = colour(image) if callable(colour) else Image.new("L", image.size, colour)
        mask.save(masks / f"{picture.stem}.png")
    return masks


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_mask_is_placed_as_its_picture(tiny, tmp_path):
    """With each picture's own grey levels as its mask, the masks the loss receives are the pictures as the VAE
    receives them (same resize, crop and orientation), averaged down to the latents' size."""
    from diffpipe.data.buckets import place
    from diffpipe.data.images import FolderImages, data_buckets
    from diffpipe.data.folder import Skipped, scan_folders

    masks = _masks_of(tiny / "photos", tmp_path / "masks", lambda image: image.convert("RGB").convert("L"))
    data = build_config({"data": {"dataset": "folder", "path": str(tiny / "photos"), "mask_path": str(masks),
                                  "resolution": 128, "bucket_step": 32}}).data
    buckets = data_buckets(data)
    items = scan_folders([(tiny / "photos", 1)], 16, Skipped())
    dataset = FolderImages(items, [place(i.width, i.height, buckets) for i in items], Skipped(),
                           masks=_find_masks(items, data))
    assert {p.bucket.width != p.bucket.height for p in dataset.placements} == {True, False}  # crops both ways
    for i in range(len(items)):
        size = (dataset.placements[i].bucket.height // 8, dataset.placements[i].bucket.width // 8)
        pixels = read_pixels(items[i], dataset.placements[i]) * 0.5 + 0.5
        grey = (0.299 * pixels[0] + 0.587 * pixels[1] + 0.114 * pixels[2])  # PIL's "L", before rounding
        want = F.interpolate(grey[None, None], size=size, mode="area")[0]
        assert (dataset.loss_masks([i], size)[0] - want).abs().max() < 3 / 255  # PIL rounds "L" to 8 bits


def test_white_grey_and_black_masks_weigh_the_loss_through_one_and_two_stages(tiny, tmp_path):
    photos = tiny / "photos"
    runs = {}
    for name, colour, stages in (("none", None, 2), ("white", 255, 2), ("grey", 128, 2), ("grey-1", 128, 1),
                                 ("black", 0, 2)):
        runs[name] = tmp_path / name
        masks = ["--set", f'data.mask_path="{_masks_of(photos, tmp_path / f"masks-{name}", colour)}"'] if colour is not None else []
        result = run_command(["train", str(EXAMPLE), "--output-dir", str(runs[name]), *QUICK, *masks,
                              "--set", f'model.path="{tiny / "sdxl"}"', "--set", f'data.path="{photos}"',
                              "--set", f"pipeline.stages={stages}"])
        assert result.returncode == 0
    none, grey = _losses(runs["none"]), _losses(runs["grey"])
    assert _losses(runs["white"]) == pytest.approx(none, rel=1e-6)
    assert grey[0] == pytest.approx(none[0] * (128 / 255), rel=1e-5)  # the same first batch, each pixel weighed 0.502
    assert _losses(runs["grey-1"]) == pytest.approx(grey, rel=1e-5)  # the masks reach the last stage's loss alike
    assert _losses(runs["black"]) == [0.0, 0.0]


@pytest.mark.parametrize("problem", ["missing", "broken", "size"])
def test_a_missing_broken_or_mis_sized_mask_is_named(tiny, tmp_path, problem):
    masks = _masks_of(tiny / "photos", tmp_path / "masks", 255)
    victim = sorted(masks.glob("*.png"))[3]
    if problem == "missing":
        victim.unlink()
    elif problem == "broken":
        victim.write_bytes(b"not a png")
    else:
        Image.new("L", (7, 5), 255).save(victim)
    data = build_config({"data": {"dataset": "folder", "path": str(tiny / "photos"), "mask_path": str(masks)}}).data
    from diffpipe.data.folder import Skipped, scan_folders

    items = scan_folders([(tiny / "photos", 1)], 16, Skipped())
    with pytest.raises(DataError, match=victim.stem):
        _find_masks(items, data)

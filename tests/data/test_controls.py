"""data.control_path: each picture's control image (an edit's source) found under the same name, placed in the
picture's bucket (a control of another size resized to cover it), encoded by the VAE and cached beside the pictures'
latents, the same latents whether cached or encoded per step (a control changed on disk encoded again); a missing
control stops the run before anything is encoded, a broken one skips its picture and says so; a model that reads no
control refuses the setting."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffpipe.config_files import build_config
from diffpipe.data.buckets import place, to_pixels
from diffpipe.data.folder import read_rgb
from diffpipe.data.preparation import prepare_folder_images
from diffpipe.errors import DataError
from diffpipe.models.families.flux.text import FluxText
from diffpipe.models.vae import encode_latents, load_vae

from ..helpers import run_command

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def models(tiny):
    folder = tiny / "flux_kontext"
    return folder, load_vae(folder), FluxText.from_folder(folder)


def _edits(tiny: Path, tmp_path: Path) -> Path:
    edits = tmp_path / "edits"
    shutil.copytree(tiny / "edits", edits, ignore=shutil.ignore_patterns(".diffpipe_cache"))
    return edits


def _data(edits: Path, **extra):
    return build_config({"data": {"dataset": "folder", "path": str(edits / "pictures"), "resolution": 128,
                                  "bucket_step": 32, "control_path": str(edits / "controls"),
                                  "cache_dir": str(edits / "cache"), **extra}}).data


def _prepared(models, data):
    folder, vae, text = models
    return prepare_folder_images(data, folder, vae, text, show=False)


def test_controls_are_placed_in_their_pictures_buckets_and_cached_as_encoded(tiny, tmp_path, models):
    edits = _edits(tiny, tmp_path)
    half = edits / "controls" / "china_4.png"  # a control of half its picture's size: resized to cover the bucket
    with Image.open(half) as image:
        image.resize((image.width // 2, image.height // 2)).save(half)
    cached = _prepared(models, _data(edits))
    assert len(cached.items) == 8 and len(cached.bucket_counts()) == 3
    vae = models[1]
    for i, (item, control) in enumerate(zip(cached.items, cached.controls)):
        assert control == edits / "controls" / f"{item.path.stem}.png"
        placement = cached.control_placements[i]
        assert placement.bucket == cached.placements[i].bucket
        if control != half:
            assert placement == cached.placements[i]  # same size: pixel for pixel where the picture lands
        pixels = to_pixels(read_rgb(control), place(*read_rgb(control).size, [cached.placements[i].bucket]))
        torch.testing.assert_close(cached.control_latents([i])[0], encode_latents(vae, pixels[None])[0],
                                   rtol=1e-5, atol=1e-6)
    assert cached.control_latents([0]).shape == cached.x0([0]).shape
    uncached = _prepared(models, _data(edits, cache=False))
    for i in range(8):  # one at a time: the items lie in three buckets
        torch.testing.assert_close(uncached.control_latents([i]), cached.control_latents([i]), rtol=1e-5, atol=1e-6)
    shards = sorted((edits / "cache").rglob("*.safetensors"))
    again = _prepared(models, _data(edits))  # a second run reads the cache: nothing new is written
    assert sorted((edits / "cache").rglob("*.safetensors")) == shards
    assert torch.equal(again.control_latents([3]), cached.control_latents([3]))
    changed = again.controls[3]  # a control edited on disk is encoded again, not read stale from the cache
    with Image.open(changed) as image:
        image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(changed)
    fresh = _prepared(models, _data(edits))
    i = fresh.controls.index(changed)
    pixels = to_pixels(read_rgb(changed), fresh.control_placements[i])
    torch.testing.assert_close(fresh.control_latents([i])[0], encode_latents(vae, pixels[None])[0], rtol=1e-5, atol=1e-6)


def test_a_missing_control_stops_before_anything_is_encoded(tiny, tmp_path, models):
    edits = _edits(tiny, tmp_path)
    (edits / "controls" / "flower_4.png").unlink()
    with pytest.raises(DataError, match="flower_4.jpg has no control image"):
        _prepared(models, _data(edits))
    assert not (edits / "cache").exists()


def test_a_broken_control_skips_its_picture_and_says_so(tiny, tmp_path, models):
    edits = _edits(tiny, tmp_path)
    (edits / "controls" / "china_1.png").write_bytes(b"not a png")
    dataset = _prepared(models, _data(edits))
    assert len(dataset.items) == 7 and all(item.path.stem != "china_1" for item in dataset.items)
    assert len(dataset.controls) == len(dataset.cached_controls) == 7
    assert [why for path, why in dataset.skipped.files] == ["its control image china_1.png: not a readable image "
                                                             "(UnidentifiedImageError)"]


def test_a_model_that_reads_no_control_refuses_the_setting(tiny, tmp_path, capfd):
    edits = _edits(tiny, tmp_path)
    result = run_command(["train", str(ROOT / "examples" / "flux_tiny.toml"), "--output-dir", str(tmp_path / "run"),
                          "--set", f'model.path="{tiny / "flux"}"', "--set", f'data.path="{edits / "pictures"}"',
                          "--set", f'data.control_path="{edits / "controls"}"'])
    errors = capfd.readouterr().err
    assert result.returncode != 0
    assert "model.architecture = 'flux' reads none; train an edit model (flux_kontext, qwen_image_edit)" in errors
    assert "Traceback" not in errors and not (tmp_path / "run").exists()


def test_sample_control_images_are_one_per_prompt():
    from diffpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="sample.control_images lists 1 image"):
        build_config({"sample": {"prompts": ["a", "b"], "control_images": ["a.png"]}})

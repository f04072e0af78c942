"""data.regularisation_path: regularisation (prior-preservation) images train beside data.path's in the same buckets
and epochs, each of their samples' loss times data.regularisation_weight (kohya's reg_data_dir and prior_loss_weight).
Weight 1 trains exactly as the same folders given as data.path; the tiny photos' four square pictures as the
regularisation folder make one step of each epoch a batch of them alone, whose loss is 0 at weight 0 and twice the
plain one at weight 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diffpipe.config import ConfigError
from diffpipe.config_files import build_config

from ..helpers import run_command

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "photos.toml"
SQUARE = ("china_6", "china_7", "flower_6", "flower_7")  # the 128x128 bucket's pictures: one batch of 4
QUICK = ["--set", "train.max_steps=4", "--set", "train.batch_size=4", "--set", "pipeline.microbatches=2",
         "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false", "--set", "output.save_weights=false",
         "--set", "data.caption_dropout=0.0", "--set", "observe.log_every=0"]


def _split(photos: Path, root: Path) -> tuple[Path, Path]:
    train, regularisation = root / "train", root / "regularisation"
    for folder in (train, regularisation):
        folder.mkdir(parents=True)
    for f in photos.iterdir():
        if f.is_file():
            shutil.copy(f, (regularisation if f.stem in SQUARE else train) / f.name)
    return train, regularisation


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_regularisation_images_weigh_their_samples_loss(tiny, tmp_path):
    train, regularisation = _split(tiny / "photos", tmp_path / "data")
    runs = {}
    cases = {"both-as-data": [f'data.path=["{train}", "{regularisation}"]'],
             **{f"weight-{w}": [f'data.path="{train}"', f'data.regularisation_path="{regularisation}"',
                                f"data.regularisation_weight={w}"] for w in (1, 0, 2)}}
    for name, settings in cases.items():
        runs[name] = tmp_path / name
        result = run_command(["train", str(EXAMPLE), "--output-dir", str(runs[name]), *QUICK,
                              "--set", f'model.path="{tiny / "sdxl"}"', *(a for s in settings for a in ("--set", s))])
        assert result.returncode == 0
    plain = _losses(runs["both-as-data"])
    assert _losses(runs["weight-1"]) == pytest.approx(plain, rel=1e-6)
    zero, double = _losses(runs["weight-0"]), _losses(runs["weight-2"])
    square = zero.index(0.0)  # the step of the regularisation images alone
    assert zero[:square] == pytest.approx(plain[:square], rel=1e-6) and plain[square] > 0
    assert double[:square] == pytest.approx(plain[:square], rel=1e-6)
    assert double[square] == pytest.approx(2 * plain[square], rel=1e-5)


def test_regularisation_images_need_an_image_folder_dataset():
    with pytest.raises(ConfigError, match="regularisation_path"):
        build_config({"data": {"dataset": "digits", "regularisation_path": "somewhere"}})
    with pytest.raises(ConfigError, match="regularisation_weight"):
        build_config({"data": {"dataset": "folder", "path": ".", "regularisation_weight": -1}})

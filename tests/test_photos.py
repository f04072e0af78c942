"""The second main job (examples/photos.toml): an SDXL-layout pipeline folder fine-tuned on captioned photographs
in aspect-ratio buckets, as a user runs it; 1 and 2 stages train to the same losses; samples decoded by the VAE."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from .helpers import grid_size, run_command

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "photos.toml"


def _train(tiny: Path, photos: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(out),
           "--set", f"model.path=\"{tiny / 'sdxl'}\"", "--set", f"data.path=\"{photos}\"", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_and_two_stages_train_the_photo_folder_to_the_same_losses(tiny, tmp_path):
    photos = tmp_path / "photos"
    shutil.copytree(tiny / "photos", photos)
    (photos / "broken.jpg").write_bytes(b"")  # counted in the metrics, never trained on
    quick = ["--set", "train.max_steps=6", "--set", "sample.steps=2", "--set", "sample.seeds=[0]",
             "--set", "checkpoint.every=0"]
    runs = {}
    for stages in (1, 2):
        runs[stages] = tmp_path / f"stages{stages}"
        result = _train(tiny, photos, runs[stages], *quick, "--set", f"pipeline.stages={stages}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "16 images in 3 bucket(s): 96x160 4, 128x128 4, 160x96 8" in result.stdout
    one, two = _rows(runs[1]), _rows(runs[2])
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=1e-5)
    assert all(r["skipped_images"] == 1 for r in two)
    assert Image.open(runs[2] / "samples.png").size == grid_size(2, 1, (128, 128), [0])  # decoded RGB pixels
    out = tmp_path / "flower.png"
    cmd = [sys.executable, "-m", "diffpipe", "sample", str(runs[2]), "--prompt", "a close photo of a pink flower",
           "--num", "2", "--steps", "2", "--out", str(out)]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
    image = Image.open(out)
    assert image.mode == "RGB" and image.size == (2 * 128, 128)


@pytest.mark.slow
def test_photos_main_job_runs_as_the_readme_says(tmp_path):
    """The README's two commands (the tiny pipeline script, then `diffpipe train examples/photos.toml`), in a scratch
    folder, for 250 of the job's 1,000 steps (the whole job takes 2 min 24 s; the suite's time is kept under 15
    minutes); the loss falls and samples are written."""
    script = [sys.executable, str(ROOT / "examples" / "make_tiny_pipeline.py"), "--out", str(tmp_path / "tiny")]
    assert subprocess.run(script, capture_output=True, text=True, timeout=300).returncode == 0
    run = tmp_path / "photos_run"
    result = _train(tmp_path / "tiny", tmp_path / "tiny" / "photos", run, "--set", "train.max_steps=250")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in _rows(run)]
    assert len(losses) == 250 and sum(losses[-50:]) < 0.5 * sum(losses[:50])
    for name in ("samples.png", "model.safetensors", "loss.png", "checkpoints"):
        assert (run / name).exists(), name


def test_bad_folder_setups_are_one_line_before_anything_starts(tiny, tmp_path, capsys):
    from diffpipe.cli import main

    mixed = tmp_path / "mixed"
    shutil.copytree(tiny / "sdxl", mixed)
    vae_config = mixed / "vae" / "config.json"
    vae_config.write_text(vae_config.read_text().replace('"latent_channels": 4', '"latent_channels": 16'))
    cases = [
        ([f"model.path=\"{tiny / 'sdxl'}\"", f"data.path=\"{tmp_path / 'nowhere'}\""], "is not a folder"),
        ([f"model.path=\"{tiny / 'sdxl' / 'unet'}\"", f"data.path=\"{tiny / 'photos'}\""], "needs a diffusers pipeline folder (with model_index.json"),
        ([f"model.path=\"{mixed}\"", f"data.path=\"{tiny / 'photos'}\""], "16-channel latents but the UNet takes 4"),
        ([f"model.path=\"{tiny / 'sdxl'}\"", "data.path=[\"a\", \"b\"]", "data.repeats=[1]"], "data.repeats lists 1"),
    ]
    for overrides, message in cases:
        args = ["train", str(EXAMPLE), "--output-dir", str(tmp_path / "run")]
        for override in overrides:
            args += ["--set", override]
        assert main(args) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run").exists()


def test_an_sd15_layout_folder_trains_and_samples_too(tiny, tmp_path):
    """One text encoder's last hidden states, no pooled text or time ids; the scheduler's epsilon objective."""
    photos = tmp_path / "photos"
    shutil.copytree(tiny / "photos", photos)
    run = tmp_path / "sd15"
    cmd = ["train", str(EXAMPLE), "--output-dir", str(run),
           "--set", f"model.path=\"{tiny / 'sd15'}\"", "--set", f"data.path=\"{photos}\"", "--set", "train.max_steps=3",
           "--set", "sample.steps=2", "--set", "sample.seeds=[0]", "--set", "checkpoint.every=0"]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "objective = \"epsilon\"" in (run / "config.toml").read_text()
    assert len(_rows(run)) == 3 and Image.open(run / "samples.png").mode == "RGB"

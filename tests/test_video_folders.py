"""Your own videos (examples/wan_clips.toml): a WanPipeline folder fine-tuned on a folder of captioned mp4/webm clips
in aspect-ratio and frame buckets, as a user runs it; 1 and 2 stages train to the same losses; broken and short
files are counted; samples are clips decoded by the video VAE (animated GIFs)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import load_tiny_pipeline_script
from tests.helpers import grid_size

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "wan_clips.toml"


def _train(tiny_video: Path, clips: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(out),
           "--set", f"model.path=\"{tiny_video / 'wan'}\"", "--set", f"data.path=\"{clips}\"", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_one_and_two_stages_train_the_video_folder_to_the_same_losses(tiny_video, tmp_path):
    script = load_tiny_pipeline_script()
    clips = tmp_path / "clips"
    shutil.copytree(tiny_video / "clips", clips)
    script.write_video(clips / "short.mp4", script._shape_frames("disc", "red", "up", 10, (48, 64)))
    (clips / "short.txt").write_text("a red disc moving up")
    (clips / "broken.webm").write_bytes(b"not a video")
    quick = ["--set", "train.max_steps=4", "--set", "sample.steps=2", "--set", "checkpoint.every=0"]
    runs = {}
    for stages in (1, 2):
        runs[stages] = tmp_path / f"stages{stages}"
        result = _train(tiny_video, clips, runs[stages], *quick, "--set", f"pipeline.stages={stages}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "13 clips in 5 bucket(s): 48x80x17f 2, 48x80x33f 2, 80x48x1f 1, 80x48x17f 6, 80x48x33f 2" in result.stdout
        assert "skipped 2 image or video file(s)" in result.stdout and "too short: 10 frames" in result.stdout
    one, two = ([json.loads(line) for line in (runs[s] / "metrics.jsonl").read_text().splitlines()] for s in (1, 2))
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=1e-5)
    assert all(r["skipped_images"] == 2 for r in two) and {r["bucket"] for r in two} <= {
        "48x80x17f", "48x80x33f", "80x48x17f", "80x48x1f", "80x48x33f"}
    gif = Image.open(runs[2] / "samples.gif")  # 2 prompts x 1 seed, 33 frames of 64x64 RGB through the video VAE
    assert gif.is_animated and gif.n_frames == 33 and gif.size == grid_size(2, 1, (64, 64), [0])
    out = tmp_path / "square.gif"
    cmd = [sys.executable, "-m", "diffpipe", "sample", str(runs[2]), "--prompt", "a red square moving right",
           "--num", "1", "--steps", "2", "--out", str(out)]
    sampled = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert Image.open(out).n_frames == 33


def test_frame_buckets_the_video_vae_cannot_make_are_one_line(tiny_video, tiny, tmp_path, capsys):
    from diffpipe.cli import main

    assert main(["train", str(EXAMPLE), "--output-dir", str(tmp_path / "a"), "--set", f"model.path=\"{tiny_video / 'wan'}\"",
                 "--set", f"data.path=\"{tiny_video / 'clips'}\"", "--set", "data.frame_buckets=[1, 16, 33]"]) == 2
    err = capsys.readouterr().err
    assert "data.frame_buckets = [1, 16, 33]" in err and "1 + 4k frames; [16] are not" in err
    mixed = tmp_path / "mixed"  # an SD 1.5 folder given Wan's video VAE
    shutil.copytree(tiny / "sd15", mixed)
    shutil.rmtree(mixed / "vae")
    shutil.copytree(tiny_video / "wan" / "vae", mixed / "vae")
    assert main(["train", str(ROOT / "examples" / "photos.toml"), "--output-dir", str(tmp_path / "b"),
                 "--set", f"model.path=\"{mixed}\"", "--set", f"data.path=\"{tiny / 'photos'}\""]) == 2
    assert "its VAE encodes video clips but the UNet is an image model" in capsys.readouterr().err


def test_a_text_to_video_unet_folder_trains_on_clips_frame_by_frame_through_its_image_vae(tiny, tiny_video, tmp_path):
    """A TextToVideoSDPipeline folder (ModelScope / Zeroscope layout): UNet3DConditionModel, SD's image VAE (each
    frame encoded alone: any clip length) and CLIP; its family, text encoder and objective come from the folder."""
    from diffusers import StableDiffusionPipeline, TextToVideoSDPipeline, UNet3DConditionModel

    from diffpipe.models.families.unet.unet3d import UNET3D_PRESETS

    sd15 = StableDiffusionPipeline.from_pretrained(tiny / "sd15", local_files_only=True)
    unet = UNet3DConditionModel(**dict(UNET3D_PRESETS["digits"], in_channels=4, out_channels=4, sample_size=8))
    TextToVideoSDPipeline(vae=sd15.vae, text_encoder=sd15.text_encoder, tokenizer=sd15.tokenizer, unet=unet,
                          scheduler=sd15.scheduler).save_pretrained(tmp_path / "t2v", safe_serialization=True)
    run = tmp_path / "run"
    result = _train(tmp_path, tiny_video / "clips", run, "--set", f"model.path=\"{tmp_path / 't2v'}\"",
                    "--set", "data.frame_buckets=[1, 6]", "--set", "train.max_steps=2", "--set", "sample.steps=2",
                    "--set", "checkpoint.every=0", "--set", "train.dropout=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training unet3d" in result.stdout and "80x48x6f" in result.stdout
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
    assert Image.open(run / "samples.gif").n_frames == 6

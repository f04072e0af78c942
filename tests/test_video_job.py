"""The tiny video job (examples/video_tiny.toml): a Wan-architecture transformer learns clips of moving digits
across 2 stages, as a user runs it; samples are animated GIFs, from the run and from `diffpipe sample`."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from .helpers import run_command

ROOT = Path(__file__).parent.parent


def test_video_job_trains_across_two_stages_and_samples_animated_clips(tmp_path):
    run = tmp_path / "video"
    cmd = ["train", str(ROOT / "examples" / "video_tiny.toml"), "--output-dir",
           str(run), "--set", "train.max_steps=200", "--set", "checkpoint.every=0", "--set", "sample.steps=4"]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 stage(s)" in result.stdout and "(h, context, temb, tproj, rope)" in result.stdout
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 200 and sum(losses[-50:]) < 0.65 * sum(losses[:50])  # measured 0.57 (1.32 -> 0.75)
    gif = Image.open(run / "samples.gif")  # 2 seeds x 4 prompts, each clip 4 frames of 8x8 shown 4x
    assert gif.is_animated and gif.n_frames == 4 and gif.size == (4 * 32, 2 * 32)
    out = tmp_path / "three.gif"
    cmd = ["sample", str(run), "--prompt", "a handwritten digit three moving left",
           "--num", "2", "--steps", "3", "--out", str(out)]
    sampled = run_command(cmd)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert Image.open(out).n_frames == 4

"""The tiny video job (examples/video_tiny.toml): a Wan-architecture transformer learns clips of moving digits
across 2 stages, as a user runs it; samples are animated GIFs, from the run and from `diffpipe sample`."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from .helpers import grid_size, run_command, wan_output

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
    gif = Image.open(run / "samples.gif")  # 2 seeds x 4 prompts, each clip 4 frames of 8x8 shown 8x, labelled
    assert gif.is_animated and gif.n_frames == 4 and gif.size == grid_size(4, 2, (64, 64), [0, 1])
    out = tmp_path / "three.gif"
    cmd = ["sample", str(run), "--prompt", "a handwritten digit three moving left",
           "--num", "2", "--steps", "3", "--out", str(out)]
    sampled = run_command(cmd)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert Image.open(out).n_frames == 4


def test_a_wan_lora_exports_for_diffusers_and_loads_to_the_trained_output(tmp_path):
    """`diffpipe export --format diffusers` of a Wan LoRA (issue 29: LoRA out for every family): WanPipeline's own
    load_lora_weights turns the base into the trained model (adapters merged), to fp32 rounding."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from diffpipe.build import build_backbone
    from diffpipe.config_files import load_config

    run = tmp_path / "lora"
    cmd = ["train", str(ROOT / "examples" / "video_tiny.toml"), "--output-dir", str(run), "--set",
           "train.max_steps=10", "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false", "--set",
           "adapter.type=\"lora\"", "--set", "adapter.rank=4", "--set", "adapter.alpha=8.0"]
    assert run_command(cmd).returncode == 0
    assert run_command(["export", str(run), "--format", "diffusers", "--out", str(tmp_path / "out")]).returncode == 0
    config = {k: v for k, v in json.loads((run / "model_config.json").read_text()).items() if not k.startswith("_")}
    trained = WanTransformer3DModel(**config)
    trained.load_state_dict(load_file(str(run / "model.safetensors")))  # the base with the adapters merged
    want = wan_output(trained)
    base = build_backbone(load_config(run / "config.toml"), "cpu").model  # the seeded base the run started from
    pipe = WanPipeline(transformer=base, vae=None, text_encoder=None, tokenizer=None, scheduler=None)
    assert (wan_output(base) - want).abs().max() > 1e-3  # the adapters matter
    pipe.load_lora_weights(tmp_path / "out" / "pytorch_lora_weights.safetensors")
    torch.testing.assert_close(wan_output(pipe.transformer), want, rtol=1e-5, atol=1e-5)

"""Wan image-to-video (issue 30) from a folder WanImageToVideoPipeline's own `save_pretrained` wrote (Wan 2.2
I2V-A14B's layout: two experts, no image encoder): what the transformer is fed beside the noisy latents is what the
pipeline's own `__call__` feeds it for the same first frame; a clip's first frame is read, placed and followed by grey
frames; the tiny example trains on 1 and 2 stages to the same losses, cached and not; samples continue the first
frame they are given; a LoRA exported for diffusers loads into WanImageToVideoPipeline with the trained output."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanImageToVideoPipeline

from diffpipe.cli import main
from diffpipe.config_files import build_config
from diffpipe.data.buckets import Bucket, place, to_pixels
from diffpipe.data.frames import first_frame_pixels
from diffpipe.data.folder import ImageItem
from diffpipe.data.videos import read_clip
from diffpipe.models.family import Feed
from diffpipe.models.vae import encode_latents
from diffpipe.models.families.wan.i2v import WanI2VFamily

from ..helpers import check_diffusers_lora, run_command

ROOT = Path(__file__).parent.parent.parent
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0", "--set", "data.caption_dropout=0.0"]
CLIP = "red_square_left_0.mp4"


@pytest.fixture(scope="module")
def clips(tiny_video, tmp_path_factory) -> Path:
    """A copy of the tiny clips (each run's cache is written beside them)."""
    return shutil.copytree(tiny_video / "clips", tmp_path_factory.mktemp("i2v") / "clips")


def _train(tiny_video: Path, clips: Path, out: Path, *extra: str):
    return run_command(["train", str(ROOT / "examples" / "wan_i2v_clips.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny_video / "wan22_i2v"}"', "--set", f'data.path="{clips}"',
                        *QUICK, *extra])


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_transformer_is_fed_the_first_frame_as_the_pipelines_own_call_feeds_it(tiny_video, clips):
    """The pipeline's `__call__` (one step, the high-noise expert, no guidance) with a forward hook on its
    transformer: the channels after the noisy latents are the pipeline's mask and first-frame latents; ours, from the
    same frame through first_frame_pixels and the family's conditions, equal them, and the family's reference forward
    (what the units are tested equal to) feeds the transformer the same joined input."""
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_video / "wan22_i2v")
    frame = read_clip(clips / CLIP, 1)[0]  # 48 x 64 pixels: the bucket below, so neither side resizes it
    fed = {}
    pipe.transformer.register_forward_pre_hook(lambda _, args, kwargs: fed.update(x=kwargs["hidden_states"]),
                                               with_kwargs=True)
    with torch.no_grad():
        pipe(image=frame, prompt_embeds=torch.randn(1, 512, 32), height=64, width=48, num_frames=17,  # (ftfy absent)
             num_inference_steps=1, guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    theirs = fed["x"][:, 4:]  # after the noisy latents' 4 channels: the mask's 4, the first frame's 4
    placement = place(48, 64, [Bucket(48, 64)], frames=17)
    pixels = first_frame_pixels(ImageItem(clips / CLIP, "", 48, 64, frames=24), placement)
    assert torch.equal(pixels[:, 0], to_pixels(frame, placement)) and not pixels[:, 1:].any()  # then grey frames
    latents = encode_latents(pipe.vae, pixels[None])
    family = WanI2VFamily()
    conditions = Feed(family, pipe.transformer.config).conditions(torch.zeros(1, 8, 32), torch.zeros(1, 0),
                                                                  torch.zeros(1, 6), (5, 8, 6), control=latents)
    assert theirs.shape == conditions["first_frame"].shape == (1, 8, 5, 8, 6)
    assert theirs[:, :4, 0].eq(1).all() and not theirs[:, :4, 1:].any()  # the mask: the first latent frame fixed
    torch.testing.assert_close(conditions["first_frame"], theirs, rtol=1e-5, atol=1e-6)
    pipelines = fed.pop("x")  # the family's reference forward joins them in the pipeline's order
    family.diffusers_forward(pipe.transformer, pipelines[:, :4], dict(conditions, timestep=torch.tensor([999.0])))
    torch.testing.assert_close(fed["x"], pipelines, rtol=1e-5, atol=1e-6)


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses_cached_or_not(tiny_video, clips, tmp_path):
    runs = {}
    for name, extra in (("one", ["pipeline.stages=1"]), ("two", ["pipeline.stages=2"]),
                        ("uncached", ["pipeline.stages=1", "data.cache=false"])):
        runs[name] = tmp_path / name
        settings = [a for s in ["train.max_steps=4", *extra] for a in ("--set", s)]
        result = _train(tiny_video, clips, runs[name], *settings, "--set", f'data.cache_dir="{tmp_path / "cache"}"')
        assert result.returncode == 0, result.stderr[-3000:]
    one = _losses(runs["one"])
    assert len(one) == 4 and all(l == l for l in one)
    torch.testing.assert_close(torch.tensor(_losses(runs["two"])), torch.tensor(one), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(_losses(runs["uncached"])), torch.tensor(one), rtol=1e-5, atol=0)
    cached = list((tmp_path / "cache").rglob("*"))
    assert cached  # the clips' and their first frames' latents, and the text, were stored


def predictor(latent_size: tuple[int, int, int], timesteps: tuple[float, float]):
    """`predict(transformer)` for check_diffusers_lora: the family's reference forward on two seeded clips of
    `latent_size` (4 channels), each with a first frame, at `timesteps`."""
    @torch.no_grad()
    def predicted(transformer) -> torch.Tensor:
        family, gen = WanI2VFamily(), torch.Generator().manual_seed(0)
        feed = Feed(family, transformer.config)
        conditions = dict(feed.conditions(torch.randn(2, 512, 32, generator=gen), torch.zeros(2, 0),
                                          torch.zeros(2, 6), latent_size,
                                          control=torch.randn(2, 4, *latent_size, generator=gen)),
                          timestep=torch.tensor(timesteps))
        return family.diffusers_forward(transformer.eval(), torch.randn(2, 4, *latent_size, generator=gen), conditions)

    return predicted


def test_a_lora_loads_into_the_pipeline_and_samples_continue_their_first_frame(tiny_video, clips, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny_video, clips, run, "--set", "train.max_steps=4", "--set", "train.learning_rate=1e-2",
                    "--set", "pipeline.stages=1", "--set", 'adapter.type="lora"', "--set", "adapter.rank=4",
                    "--set", "adapter.alpha=8.0", "--set", f'data.cache_dir="{tmp_path / "cache"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(WanImageToVideoPipeline, tiny_video / "wan22_i2v", run, tmp_path / "out",
                         predictor((3, 8, 8), (950.0, 920.0)))
    from diffpipe.sampling import load_generator

    gen = load_generator(run)
    made = [gen.generate(["a red square moving left"], [0], 2, 1.0, decode=False, controls=[clips / name])
            for name in (CLIP, "yellow_disc_down_11.mp4")]
    assert made[0].shape == (1, 4, 9, 8, 8)  # the longest frame bucket, 33 frames: 9 latent frames of 64 x 64
    assert (made[0] - made[1]).abs().mean() > 1e-3  # another first frame, another clip
    out = tmp_path / "continued.gif"
    assert main(["sample", str(run), "--prompt", "a red square", "--control", str(clips / "still_blue_disc.png"),
                 "--steps", "2", "--out", str(out)]) == 0 and out.is_file()


def test_the_folder_resolves_to_wan_i2v_and_a_text_to_video_architecture_refuses_it(tiny_video):
    data = {"dataset": "folder", "path": str(tiny_video / "clips"), "frame_buckets": [1, 17]}
    config = build_config({"model": {"path": str(tiny_video / "wan22_i2v"), "expert": "low"}, "data": data})
    assert config.model.architecture == "wan_i2v"
    assert build_config({"model": {"path": str(tiny_video / "wan")}, "data": data}).model.architecture == "wan"
    from diffpipe.build import build_backbone

    from diffpipe.sampling import grid_controls, grid_prompts

    assert grid_prompts(config, list) == [(tiny_video / "clips" / n).with_suffix(".txt").read_text().strip()
                                          for n in ("blue_disc_down_7", "blue_disc_right_1", "blue_square_left_4",
                                                    "blue_square_up_10")]  # the first clips, each continued
    assert [p.name for p in grid_controls(config)] == ["blue_disc_down_7.mp4", "blue_disc_right_1.mp4",
                                                       "blue_square_left_4.mp4", "blue_square_up_10.mp4"]
    config.sample.prompts = ["a", "b", "c", "d", "e"]  # prompts of one's own: a first clip for each
    assert [p.name for p in grid_controls(config)][3:] == ["blue_square_up_10.mp4", "red_disc_down_3.mp4"]
    wrong = build_config({"model": {"path": str(tiny_video / "wan22_i2v"), "expert": "low",
                                    "architecture": "wan_i2v"}, "data": data})
    wrong.model.architecture = "wan"  # as a hand-edited run folder would say
    with pytest.raises(ValueError, match='an image-to-video one .*model.architecture = "wan_i2v"'):
        build_backbone(wrong)

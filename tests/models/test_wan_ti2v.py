"""Wan 2.2 TI2V-5B's image-to-video (issue 30), from a folder WanPipeline's own `save_pretrained` wrote with
expand_timesteps (TI2V-5B's layout: one transformer, its 16x residual VAE): `WanImageToVideoPipeline.__call__` on that
folder feeds its transformer what the family's reference forward feeds it (the first latent frame replaced by the
picture's, a timestep per token, zero on that frame); the tiny example trains on 1 and 2 stages to the same losses;
the fixed frame adds nothing to the loss; samples end with the picture's latents in their first frame; a LoRA
exported for diffusers loads into WanImageToVideoPipeline with the trained output; the folder trains image-to-video
only where asked, and a Wan 2.1 folder is never taken for it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from diffpipe.config_files import build_config
from diffpipe.data.buckets import Bucket, place
from diffpipe.data.frames import first_frame_pixels
from diffpipe.data.folder import ImageItem
from diffpipe.errors import ConfigError
from diffpipe.models.family import Feed
from diffpipe.models.vae import encode_latents
from diffpipe.models.families.wan.i2v import WanI2VFamily
from diffpipe.models.families.wan.ti2v import ti2v_pipeline_input

from ..helpers import check_diffusers_lora, run_command
from .test_wan_i2v import predictor

ROOT = Path(__file__).parent.parent.parent
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0", "--set", "data.caption_dropout=0.0"]


@pytest.fixture(scope="module")
def clips(tiny_video, tmp_path_factory) -> Path:
    """A copy of the tiny clips (each run's cache is written beside them)."""
    return shutil.copytree(tiny_video / "clips", tmp_path_factory.mktemp("ti2v") / "clips")


def _picture(path: Path) -> Path:
    """A 64 x 64 picture (the bucket's size: neither the pipeline nor the data resizes it)."""
    ramp = torch.linspace(0, 255, 64)
    pixels = torch.stack((ramp.view(-1, 1).expand(64, 64), ramp.view(1, -1).expand(64, 64), torch.full((64, 64), 90.0)))
    Image.fromarray(pixels.permute(1, 2, 0).to(torch.uint8).numpy()).save(path)
    return path


def _train(tiny_video: Path, clips: Path, out: Path, *settings: str):
    return run_command(["train", str(ROOT / "examples" / "wan_ti2v_clips.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny_video / "wan22_ti2v"}"', "--set", f'data.path="{clips}"', *QUICK,
                        *[a for s in settings for a in ("--set", s)]])


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_transformer_is_fed_as_the_pipelines_own_call_feeds_it(tiny_video, tmp_path):
    """One step of WanImageToVideoPipeline on the TI2V folder (expand_timesteps), a hook on its transformer: its input's
    first latent frame is the picture's own encoding, which equals the first latent frame of the picture followed by
    grey frames (what data/first_frames.py caches: Wan's VAE is causal in time); the family's reference forward, given
    the same noisy latents, feeds the same input and the same per-token timesteps (zero on the first frame)."""
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_video / "wan22_ti2v")
    assert pipe.config.expand_timesteps
    path = _picture(tmp_path / "first.png")
    fed = {}
    pipe.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: fed.update(x=kwargs["hidden_states"], t=kwargs["timestep"]), with_kwargs=True)
    with torch.no_grad():
        made = pipe(image=Image.open(path), prompt_embeds=torch.randn(1, 512, 32), height=64, width=64, num_frames=17,
                    num_inference_steps=1, guidance_scale=1.0, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).frames
    pixels = first_frame_pixels(ImageItem(path, "", 64, 64), place(64, 64, [Bucket(64, 64)], frames=17))
    latents = encode_latents(pipe.vae, pixels[None])
    assert latents.shape == fed["x"].shape == (1, 4, 5, 4, 4)  # 17 frames: 5 latent frames of 4 x 4
    torch.testing.assert_close(fed["x"][:, :, 0], latents[:, :, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(made[:, :, 0], latents[:, :, 0], rtol=1e-5, atol=1e-6)  # put back at the end
    family = WanI2VFamily()
    conditions = Feed(family, pipe.transformer.config).conditions(torch.zeros(1, 8, 32), torch.zeros(1, 0),
                                                                  torch.zeros(1, 6), (5, 4, 4), control=latents)
    noisy = fed["x"].clone()
    noisy[:, :, 0] = torch.randn_like(noisy[:, :, 0])  # what the reference replaces
    joined, per_token, _ = ti2v_pipeline_input(noisy, conditions["first_frame"], torch.tensor([1000.0]), (2, 2))
    torch.testing.assert_close(joined, fed["x"], rtol=1e-5, atol=1e-6)
    assert torch.equal(per_token, fed["t"].float())  # (1, 5 x 2 x 2): zero on the first frame's four tokens
    assert per_token[0, :4].eq(0).all() and per_token[0, 4:].eq(1000).all()


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses(tiny_video, clips, tmp_path):
    runs = {}
    for name, stages in (("one", 1), ("two", 2)):
        runs[name] = tmp_path / name
        result = _train(tiny_video, clips, runs[name], "train.max_steps=4", f"pipeline.stages={stages}",
                        f'data.cache_dir="{tmp_path / "cache"}"')
        assert result.returncode == 0, result.stderr[-3000:]
    one = _losses(runs["one"])
    assert len(one) == 4 and all(loss == loss for loss in one)
    torch.testing.assert_close(torch.tensor(_losses(runs["two"])), torch.tensor(one), rtol=1e-5, atol=0)


def test_the_fixed_frame_adds_nothing_to_the_loss_and_a_prompt_alone_predicts_every_frame(tiny_video):
    """Its prediction and its target are zero, whatever the noise; without a first frame (text-to-video) every frame
    is predicted, at the step's timestep."""
    from diffpipe.data.batches import BatchMaker

    pipe = WanImageToVideoPipeline.from_pretrained(tiny_video / "wan22_ti2v")
    family, cfg = WanI2VFamily(), pipe.transformer.config
    feed = Feed(family, cfg)
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(2, 4, 3, 4, 4, generator=gen)
    conditions = feed.conditions(torch.randn(2, 512, 32, generator=gen), torch.zeros(2, 0), torch.zeros(2, 6),
                                 (3, 4, 4), control=first)
    maker = BatchMaker(None, None, build_config({"model": {"architecture": "wan_i2v"}}).train, 0.0, feed)
    batch = maker._batch(first, torch.randn(2, 4, 3, 4, 4, generator=gen), torch.tensor([0.3, 0.9]), conditions)
    frames = family.unpack_prediction(cfg, batch.target, (3, 4, 4))
    assert not frames[:, :, 0].any() and frames[:, :, 1:].abs().min() > 0
    with torch.no_grad():
        predicted = family.unpack_prediction(cfg, family.diffusers_forward(pipe.transformer, batch.noisy,
                                                                           batch.conditions), (3, 4, 4))
        alone = feed.conditions(conditions["encoder_hidden_states"], torch.zeros(2, 0), torch.zeros(2, 6), (3, 4, 4))
        unfixed = family.unpack_prediction(cfg, family.diffusers_forward(
            pipe.transformer, batch.noisy, dict(alone, timestep=batch.conditions["timestep"])), (3, 4, 4))
    assert not predicted[:, :, 0].any() and predicted[:, :, 1:].abs().min() > 0
    assert unfixed[:, :, 0].abs().min() > 0


def test_a_lora_loads_into_the_pipeline_and_samples_keep_their_first_frame(tiny_video, clips, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny_video, clips, run, "train.max_steps=4", "train.learning_rate=1e-2", "pipeline.stages=1",
                    'adapter.type="lora"', "adapter.rank=4", "adapter.alpha=8.0", f'data.cache_dir="{tmp_path / "cache"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(WanImageToVideoPipeline, tiny_video / "wan22_ti2v", run, tmp_path / "out",
                         predictor((3, 4, 4), (950.0, 420.0)))
    from diffpipe.sampling import load_generator

    gen = load_generator(run)
    picture = _picture(tmp_path / "first.png")
    made = gen.generate(["a red square moving left"], [0], 2, 3.0, decode=False, controls=[picture])
    assert made.shape == (1, 4, 9, 4, 4)  # the longest frame bucket, 33 frames: 9 latent frames of 64 x 64
    pixels = first_frame_pixels(ImageItem(picture, "", 64, 64), place(64, 64, [Bucket(64, 64)], frames=33))
    assert torch.equal(made[:, :, 0], encode_latents(gen.vae, pixels[None])[:, :, 0])
    alone = gen.generate(["a red square moving left"], [0], 2, 3.0, decode=False)  # text-to-video: its own frame
    assert (alone[:, :, 0] - made[:, :, 0]).abs().mean() > 1e-3


def test_the_folder_trains_image_to_video_only_where_asked(tiny_video):
    data = {"dataset": "folder", "path": str(tiny_video / "clips"), "frame_buckets": [1, 17], "bucket_step": 32}
    assert build_config({"model": {"path": str(tiny_video / "wan22_ti2v")}, "data": data}).model.architecture == "wan"
    asked = {"path": str(tiny_video / "wan22_ti2v"), "architecture": "wan_i2v"}
    assert build_config({"model": asked, "data": data}).model.architecture == "wan_i2v"
    with pytest.raises(ConfigError, match="WanPipeline folder .*set model.architecture = \"wan\""):
        build_config({"model": {"path": str(tiny_video / "wan"), "architecture": "wan_i2v"}, "data": data})


def test_a_one_frame_bucket_is_refused_before_anything_loads(tiny_video, clips, tmp_path, capfd):
    """Its clips are all first frame: nothing to train (their loss is 0). Refused naming the bucket to leave out."""
    result = _train(tiny_video, clips, tmp_path / "run", "data.frame_buckets=[1, 17]", "pipeline.stages=1")
    assert result.returncode == 2
    assert "leave [1] out (still images are then skipped)" in capfd.readouterr().err
    assert not (tmp_path / "run").exists()

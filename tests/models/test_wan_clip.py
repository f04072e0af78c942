"""Wan 2.1 image-to-video (issue 30) from a folder WanImageToVideoPipeline's own `save_pretrained` wrote with a CLIP
vision model (Wan2.1-I2V-14B's layout): the transformer is fed the picture's CLIP states, the text and the first
frame as the pipeline's own `__call__` feeds them; each clip's first frame is the picture its text is encoded and
cached with; the tiny example trains on 1 and 2 stages to the same losses, cached and not; a LoRA exported for
diffusers loads into WanImageToVideoPipeline with the trained output; samples differ with their picture."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanImageToVideoPipeline

from diffpipe.config_files import build_config
from diffpipe.data.buckets import Bucket, place, placed
from diffpipe.data.videos import read_clip
from diffpipe.models.family import Feed
from diffpipe.models.families.wan.clip import WAN_CLIP_TOKENS, WanImageText
from diffpipe.models.families.wan.i2v import WanI2VFamily

from ..helpers import check_diffusers_lora, losses_of, run_command

from .test_wan_i2v import CLIP, QUICK, clips  # noqa: F401 (clips: the fixture, a copy of the tiny clips)

ROOT = Path(__file__).parent.parent.parent


def _train(tiny_video: Path, clips: Path, out: Path, *settings: str):
    extra = [a for s in settings for a in ("--set", s)]
    return run_command(["train", str(ROOT / "examples" / "wan21_i2v_clips.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny_video / "wan21_i2v"}"', "--set", f'data.path="{clips}"',
                        *QUICK, *extra])


def _encoded(text: WanImageText, caption: str, picture) -> tuple[torch.Tensor, torch.Tensor]:
    text.show({"first": lambda: picture})
    return text.encode(text.texts([caption], ["first"]))


def test_the_transformer_is_fed_the_picture_text_and_first_frame_as_the_pipelines_own_call_feeds_them(tiny_video, clips):
    """The pipeline's `__call__` (one step, no guidance) with a hook on its transformer, given a clip's first frame:
    the CLIP states, the text and the first frame our text encoder and the family's conditions make of the same
    frame and caption are what it fed, and the family's reference forward feeds the transformer the same."""
    folder = tiny_video / "wan21_i2v"
    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    frame = read_clip(clips / CLIP, 1)[0]  # 48 x 64 pixels: the bucket below, so neither side resizes it
    fed = {}
    pipe.transformer.register_forward_pre_hook(lambda _, args, kwargs: fed.update(kwargs), with_kwargs=True)
    caption = "a red square moving left"
    text = WanI2VFamily().folder_text_encoder(folder)
    assert isinstance(text, WanImageText) and text.reads_pictures
    framed = placed(frame, place(48, 64, [Bucket(48, 64)], frames=17))
    hidden, pooled = _encoded(text, caption, framed)
    with torch.no_grad():  # (umT5's states as WanPipeline.encode_prompt's: tests/models/test_dit_pipeline_folder.py;
        # this pipeline's prompt cleaning needs ftfy, absent here)
        pipe(image=frame, prompt_embeds=hidden, height=64, width=48, num_frames=17, num_inference_steps=1,
             guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert pooled.shape == (1, WAN_CLIP_TOKENS * 16)
    conditions = Feed(WanI2VFamily(), pipe.transformer.config).conditions(
        hidden, pooled, torch.zeros(1, 6), (5, 8, 6), control=torch.zeros(1, 4, 5, 8, 6))
    torch.testing.assert_close(conditions["image_embeds"], fed["encoder_hidden_states_image"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conditions["encoder_hidden_states"], fed["encoder_hidden_states"], rtol=1e-5, atol=1e-6)
    assert fed["encoder_hidden_states_image"].abs().amax() > 0.1
    pipelines = dict(fed)
    conditions["first_frame"] = pipelines["hidden_states"][:, 4:]  # (the first frame's latents: test_wan_i2v.py)
    WanI2VFamily().diffusers_forward(pipe.transformer, pipelines["hidden_states"][:, :4],
                                     dict(conditions, timestep=pipelines["timestep"]))
    for name in ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_image"):
        torch.testing.assert_close(fed[name], pipelines[name], rtol=0, atol=0)
    other, _ = _encoded(text, "a blue disc", framed)  # ... and the caption is read with the picture, apart from it
    _, grey = _encoded(text, caption, framed.convert("L").convert("RGB"))
    assert (other - hidden).abs().amax() > 0 and (grey - pooled).abs().amax() > 0.01


def test_the_tiny_example_trains_on_one_and_two_stages_to_the_same_losses_cached_or_not(tiny_video, clips, tmp_path):
    runs = {}
    for name, extra in (("one", ["pipeline.stages=1"]), ("two", ["pipeline.stages=2"]),
                        ("uncached", ["pipeline.stages=1", "data.cache=false"])):
        runs[name] = tmp_path / name
        result = _train(tiny_video, clips, runs[name], "train.max_steps=4", *extra,
                        f'data.cache_dir="{tmp_path / "cache"}"')
        assert result.returncode == 0, result.stderr[-3000:]
    one = losses_of(runs["one"])
    assert len(one) == 4 and all(l == l for l in one)
    torch.testing.assert_close(torch.tensor(losses_of(runs["two"])), torch.tensor(one), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses_of(runs["uncached"])), torch.tensor(one), rtol=1e-5, atol=0)
    from diffpipe.data.cache import ShardStore

    texts = ShardStore(next((tmp_path / "cache").rglob("text-*")))
    entries, _ = texts.load(texts.known()[0])
    pooled = [entry["pooled"] for entry in entries.values()]  # a text per (caption or "", first frame)
    assert len(pooled) == 2 * 13 and all(p.shape == (WAN_CLIP_TOKENS * 16,) and p.abs().amax() > 0 for p in pooled)


def predictor(latent_size: tuple[int, int, int], timesteps: tuple[float, float]):
    """`predict(transformer)` for check_diffusers_lora: the family's reference forward on two seeded clips with
    a first frame and CLIP states each."""
    @torch.no_grad()
    def predicted(transformer) -> torch.Tensor:
        family, gen = WanI2VFamily(), torch.Generator().manual_seed(0)
        conditions = dict(Feed(family, transformer.config).conditions(
            torch.randn(2, 512, 32, generator=gen), torch.randn(2, WAN_CLIP_TOKENS * 16, generator=gen),
            torch.zeros(2, 6), latent_size, control=torch.randn(2, 4, *latent_size, generator=gen)),
            timestep=torch.tensor(timesteps))
        return family.diffusers_forward(transformer.eval(), torch.randn(2, 4, *latent_size, generator=gen), conditions)

    return predicted


def test_a_lora_loads_into_the_pipeline_and_samples_differ_with_their_picture(tiny_video, clips, tmp_path):
    run = tmp_path / "lora"
    result = _train(tiny_video, clips, run, "train.max_steps=4", "train.learning_rate=1e-2", "pipeline.stages=1",
                    'adapter.type="lora"', "adapter.rank=4", "adapter.alpha=8.0",
                    # the image cross-attention's own projections too: they load into the pipeline as any
                    'adapter.target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]',
                    f'data.cache_dir="{tmp_path / "cache"}"')
    assert result.returncode == 0, result.stderr[-3000:]
    check_diffusers_lora(WanImageToVideoPipeline, tiny_video / "wan21_i2v", run, tmp_path / "out",
                         predictor((3, 8, 8), (950.0, 420.0)))
    from diffpipe.sampling import load_generator

    gen = load_generator(run)
    made = [gen.generate(["a red square moving left"], [0], 2, 1.0, decode=False, controls=[clips / name])
            for name in (CLIP, "yellow_disc_down_11.mp4")]
    assert made[0].shape == (1, 4, 9, 8, 8)
    assert (made[0] - made[1]).abs().mean() > 1e-3  # another first frame (its latents and its CLIP states)


def test_the_folder_resolves_to_wan_i2v_and_a_first_last_frame_transformer_is_refused(tiny_video, tmp_path):
    data = {"dataset": "folder", "path": str(tiny_video / "clips"), "frame_buckets": [1, 17]}
    config = build_config({"model": {"path": str(tiny_video / "wan21_i2v")}, "data": data})
    assert config.model.architecture == "wan_i2v" and config.model.expert is None
    from diffpipe.build import build_backbone

    config.model.architecture = "wan"  # as a hand-edited run folder would say
    with pytest.raises(ValueError, match='reads a CLIP embedding of a picture .*model.architecture = "wan_i2v"'):
        build_backbone(config)
    folder = shutil.copytree(tiny_video / "wan21_i2v", tmp_path / "flf2v")
    index = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps(dict(index, pos_embed_seq_len=2 * WAN_CLIP_TOKENS)))
    with pytest.raises(ValueError, match="first-last-frame transformer .*pos_embed_seq_len"):
        build_backbone(build_config({"model": {"path": str(folder)}, "data": data}))

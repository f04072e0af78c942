"""LTX-2 (issue 57, video with its audio): the units compute the model's own forward as LTX2Pipeline calls it (both
streams, one timestep), the audio's length is the pipeline's, a sample's layout (the audio's tokens in latent frames
after the video's) packs and unpacks exactly, and a tiny LTX-2 trains on synthetic clips on 1 and 2 stages to the
same losses."""
from __future__ import annotations

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from diffpipe.models.families.ltx2.ltx2 import (LTX2_PRESETS, LTX2Family, audio_coords, audio_latent_frames,
                                                ltx2_backbone, sample_frames, video_coords, video_frames_of)
from diffpipe.models.family import TextBatch


TINY = LTX2_PRESETS["digits"]


def _run_units(backbone, named):
    named = dict(named)
    for unit in backbone.units:
        named.update(unit(named))
    return named[backbone.output]


def _config(**changes):
    return LTX2VideoTransformer3DModel(**dict(TINY, **changes)).config


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_the_units_compute_the_models_own_forward(version):
    """LTX-2.3's prompt modulation (cross_attn_mod, the connectors' own projections) as well as LTX-2.0's."""
    changes = {} if version == "2.0" else dict(cross_attn_mod=True, audio_cross_attn_mod=True,
                                               use_prompt_embeddings=False, gated_attn=True, audio_gated_attn=True)
    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**dict(TINY, **changes)).eval()
    cfg = model.config
    batch, frames, side, text = 3, 2, 4, 5
    audio_frames = audio_latent_frames(cfg, frames)
    sample = torch.randn(batch, frames * side * side + audio_frames, 8)
    hidden = torch.randn(batch, text, 32)
    t = torch.tensor([10.0, 500.0, 990.0])  # diffpipe's timesteps, 0..1000: LTX2Pipeline's scheduler timesteps too
    named = {"sample": sample, "timestep": t, "encoder_hidden_states": hidden,
             "video_coords": video_coords(cfg, batch, frames, side, side, "cpu"),
             "audio_coords": audio_coords(cfg, batch, audio_frames, "cpu")}
    with torch.no_grad():
        got = _run_units(ltx2_backbone(model), named)
        video, audio = model(hidden_states=sample[:, :frames * side * side],
                             audio_hidden_states=sample[:, frames * side * side:],
                             encoder_hidden_states=hidden[..., :16], audio_encoder_hidden_states=hidden[..., 16:],
                             timestep=t, sigma=t, num_frames=frames, height=side, width=side, fps=24.0,
                             audio_num_frames=audio_frames, use_cross_timestep=True, return_dict=False)
    assert got.shape == sample.shape
    assert torch.equal(got, torch.cat((video, audio), dim=1))


def test_the_audio_lasts_as_long_as_the_video_as_ltx2_pipeline_counts_it():
    """LTX2Pipeline: 121 frames at 24 a second -> 16 latent frames and round(121 / 24 * 25) = 126 audio latents."""
    release = _release_config()  # the class's defaults: the release's config
    assert audio_latent_frames(release, 16) == 126
    assert audio_latent_frames(release, 1) == 1  # one frame: 1 / 24 s
    assert sample_frames(release, 16, 16, 24) == 17  # 126 tokens fill one more frame of 16 x 24
    assert video_frames_of(release, 17, 16, 24) == 16


def _release_config():
    with torch.device("meta"):
        return LTX2VideoTransformer3DModel().config


def test_a_sample_packs_into_the_video_tokens_then_the_audio_tokens_and_back():
    cfg, family = _config(), LTX2Family()
    frames, side = sample_frames(_config(), 2, 4, 4), 4
    latents = torch.randn(2, 8, frames, side, side)
    tokens = family.pack(cfg, latents)
    audio = audio_latent_frames(cfg, 2)
    assert tokens.shape == (2, 2 * 16 + audio, 8)
    assert torch.equal(tokens[:, :32], latents[:, :, :2].permute(0, 2, 3, 4, 1).reshape(2, 32, 8))
    back = family.unpack_prediction(cfg, tokens, (frames, side, side))
    assert back.shape == latents.shape
    assert torch.equal(family.pack(cfg, back), tokens)
    text = TextBatch(hidden=torch.zeros(2, 5, 32), pooled=torch.zeros(2, 0), size_ids=torch.zeros(2, 6),
                     latent_size=(frames, side, side), guidance=1.0)
    named = family.conditions(cfg, text)
    assert named["video_coords"].shape == (2, 3, 32, 2) and named["audio_coords"].shape == (2, 1, audio, 2)


CAPTIONS = ["a red square moving left", "", "  a blue disc moving up with words unknown to the vocab  "]


@pytest.fixture(scope="module")
def pipe(tiny_video):
    from diffusers import LTX2Pipeline

    return LTX2Pipeline.from_pretrained(tiny_video / "ltx2")


def test_text_is_encoded_as_ltx2_pipeline_does(tiny_video, pipe):
    """Gemma 3's states of every layer through the pipeline's connectors, the video's then the audio's."""
    from diffpipe.models.families.ltx2.text import LTX2Text

    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False, device="cpu")
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert bool(connector_mask.all())  # the registers fill the padding: nothing is masked
    hidden, pooled = LTX2Text.from_folder(tiny_video / "ltx2").encode(CAPTIONS)
    assert hidden.shape == (3, 1024, 32) and pooled.shape == (3, 0)
    torch.testing.assert_close(hidden, torch.cat((video, audio), dim=-1), rtol=1e-5, atol=1e-6)
    family = LTX2Family()
    assert family.folder_text_widths(tiny_video / "ltx2") == family.text_widths(pipe.transformer.config) == (32, 0)

"""LTX-2 (issue 57, video with its audio): the units compute the model's own forward as LTX2Pipeline calls it (both
streams, one timestep), the audio's length is the pipeline's, a sample's layout (the audio's tokens in latent frames
after the video's) packs and unpacks exactly; captions are encoded and a clip with its sound made into latents as the
pipeline makes them; the tiny example trains on clips with their sound on 1 and 2 stages to the same losses, skipping
a clip at another frame rate and one without sound, and its LoRA loads into LTX2Pipeline with the trained output."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from diffpipe.models.families.ltx2.codec import AudioVideoCodec, log_mel, read_audio, with_audio
from diffpipe.models.families.ltx2.ltx2 import (LTX2_PRESETS, LTX2Family, audio_coords, audio_latent_frames,
                                                ltx2_backbone, sample_frames, video_coords, video_frames_of)
from diffpipe.models.families.ltx2.release_layout import ltx2_from_release, ltx2_to_release
from diffpipe.models.family import TextBatch

from ..helpers import check_comfyui_lora, check_diffusers_lora, run_command, trains_alike_on_one_and_two_stages

ROOT = Path(__file__).parent.parent.parent
QUICK = ["--set", "output.sample_every_end=false", "--set", "checkpoint.every=0", "--set", "observe.log_every=0",
         "--set", "train.warmup_steps=0"]


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


def test_a_tone_lands_in_its_mel_bins_on_its_channel():
    """The log-mel spectrogram the audio VAE reads: a 1 kHz tone on the left channel only peaks in the bin around
    1 kHz there and is silence (log 1e-5) on the right."""
    rate, bins = 16000, 16
    t = torch.arange(rate) / rate
    waveform = torch.stack((0.5 * torch.sin(2 * torch.pi * 1000 * t), torch.zeros(rate)))[None]
    mel = log_mel(waveform, rate, 160, bins)
    assert mel.shape == (1, 2, rate // 160 + 1, bins)
    left = mel[0, 0, 10:-10].mean(0)
    # slaney mels: linear to 15 at 1 kHz, then log; 8 kHz is 15 + ln 8 / (ln 6.4 / 27) = 45.2, so 16 bins centre at
    # 45.2 k / 17, and 1 kHz (15) is nearest the 6th centre (k = 5.6): bin 5. Mels spaced linearly in Hz would put
    # it in bin 1
    assert int(left.argmax()) == 5
    assert torch.allclose(mel[0, 1], torch.full_like(mel[0, 1], math.log(1e-5)))


def test_a_clip_with_its_sound_becomes_latents_as_ltx2_pipeline_makes_them(tiny_video, pipe):
    """The video's latents normalised as LTX2Pipeline._normalize_latents; the audio's as the pipeline packs and
    normalises audio latents (`_pack_audio_latents`, `_normalize_audio_latents`), cut to the pipeline's count for the
    clip's frames, laid after the video's; decoding shows the video."""
    codec = AudioVideoCodec.from_folder(tiny_video / "ltx2")
    clip = next(p for p in sorted((tiny_video / "av_clips").glob("*.mp4")) if not p.name.startswith(("slow", "silent")))
    torch.manual_seed(0)
    pixels = torch.rand(3, 17, 48, 64) * 2 - 1
    waveform = read_audio(clip, 17 / 24, 16000)
    with torch.no_grad():
        sample = codec.encode_sample(with_audio(pixels, waveform)[None])
        z = pipe.vae.encode(pixels[None]).latent_dist.mean
        video = pipe._normalize_latents(z, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor)
        mel = log_mel(waveform[None], 16000, 160, 16)
        audio = pipe._pack_audio_latents(pipe.audio_vae.encode(mel).latent_dist.mean)
        audio = pipe._normalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    count = round(17 / 24 * 16000 / 160 / 4)  # the pipeline's: 18 audio latents for 17 frames at 24 a second
    cfg = pipe.transformer.config
    assert audio_latent_frames(cfg, 5) == count and sample.shape == (1, 8, sample_frames(cfg, 5, 6, 8), 6, 8)
    torch.testing.assert_close(sample[:, :, :5], video, rtol=1e-5, atol=1e-5)
    tokens = LTX2Family().pack(cfg, sample)
    torch.testing.assert_close(tokens[:, 5 * 6 * 8:], audio[:, :count], rtol=1e-5, atol=1e-5)
    assert codec.decode_sample(sample).shape == (1, 3, 17, 48, 64)


def _train(tiny_video, out, *extra):
    return run_command(["train", str(ROOT / "examples" / "ltx2_tiny.toml"), "--output-dir", str(out),
                        "--set", f'model.path="{tiny_video / "ltx2"}"', "--set", f'data.path="{tiny_video / "av_clips"}"',
                        "--set", f'data.cache_dir="{Path(out).parent / "cache"}"', *QUICK, *extra])


def test_the_tiny_example_trains_alike_on_one_and_two_stages(tiny_video, tmp_path):
    trains_alike_on_one_and_two_stages(lambda out, *args: _train(tiny_video, out, *args), tmp_path, steps=4)


def test_clips_it_cannot_use_are_skipped_with_the_reason(tiny_video, tmp_path):
    """A clip without sound, and one at 30 frames a second whose 17 frames are 14 at 24 (the tiny example trains 17);
    the one at 8 frames a second trains (read at 24)."""
    ran = _train(tiny_video, tmp_path / "run", "--set", "train.max_steps=1", "--set", "pipeline.stages=1")
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "skipped 2" in ran.stdout
    assert "silent_blue_square.mp4: no audio track" in ran.stdout
    assert "quick_yellow_square.mp4: too short: 17 frames, 14 at the frame rate the model reads" in ran.stdout
    assert "slow_red_disc" not in ran.stdout


def test_a_clip_at_another_frame_rate_is_read_at_24_frames_a_second(tiny_video):
    """slow_red_disc.mp4 (8 frames at 8 a second): the k-th of its 17 frames at 24 is its own frame k // 3, the one on
    screen at k / 24 seconds; its sound is the same 17 / 24 seconds'; it offers 24 frames at 24 to the buckets."""
    from dataclasses import replace

    from diffpipe.data.buckets import Bucket, place
    from diffpipe.data.folder import ImageItem, Skipped, scan_folders
    from diffpipe.data.images import read_pixels

    codec = AudioVideoCodec.from_folder(tiny_video / "ltx2")
    item = ImageItem(tiny_video / "av_clips" / "slow_red_disc.mp4", "", 64, 48, frames=8)
    assert codec.frames_of(item) == 24
    # the folder scan reads each clip's rate with its frames: buckets are counted without opening the file again
    (scanned,) = [i for i in scan_folders([(tiny_video / "av_clips", 1)], 8, Skipped(), videos=True)
                  if i.path.name == item.path.name]
    assert (scanned.frames, scanned.frame_rate) == (8, 8.0)
    assert codec.frames_of(replace(scanned, path=tiny_video / "gone.mp4")) == 24
    placement = place(64, 48, [Bucket(64, 48)], frames=17)
    read = codec.read_item(item, placement, read_pixels)
    own = read_pixels(item, place(64, 48, [Bucket(64, 48)], frames=6))
    assert (own[:, 1:] - own[:, :-1]).abs().amax() > 0.1  # the disc moves from frame to frame
    torch.testing.assert_close(read[:, :17], own[:, [k // 3 for k in range(17)]], rtol=0, atol=0)
    torch.testing.assert_close(read, with_audio(read[:, :17], read_audio(item.path, 17 / 24, 16000)), rtol=0, atol=0)


def test_a_clip_whose_container_states_no_frame_rate_is_skipped_with_the_reason(tiny_video, monkeypatch):
    """A container stating no rate (PyAV's average and guessed rates both None: no file PyAV writes does that, so
    the reader is told 0.0, what it returns then) once failed with a TypeError from `float(None)`, or would divide
    by zero; the clip is now skipped, saying why and what to do."""
    from diffpipe.data.buckets import Bucket
    from diffpipe.data.folder import ImageItem, Skipped
    from diffpipe.data.preparation import _placed
    from diffpipe.models.families.ltx2 import codec as codec_module

    codec = AudioVideoCodec.from_folder(tiny_video / "ltx2")
    clip = tiny_video / "av_clips" / "slow_red_disc.mp4"
    assert codec_module.frame_rate(clip) == 8.0
    monkeypatch.setattr(codec_module, "frame_rate", lambda path: 0.0)
    skipped = Skipped()
    placed = _placed([ImageItem(clip, "", 64, 48, frames=8)], [Bucket(64, 48)], skipped, codec, [1, 17])
    assert placed.items == []
    ((path, reason),) = skipped.files
    assert path == clip and "states no frame rate" in reason and "ffmpeg -i IN -r 24" in reason


def test_a_lora_loads_into_ltx2_pipeline_and_comfyui_with_the_trained_output(tiny_video, tmp_path):
    from diffusers import LTX2Pipeline

    run = tmp_path / "lora"
    ran = _train(tiny_video, run, "--set", "train.max_steps=4", "--set", "train.learning_rate=1e-2",
                 "--set", "pipeline.stages=1", "--set", 'adapter.type="lora"', "--set", "adapter.rank=4",
                 "--set", "adapter.alpha=8.0")
    assert ran.returncode == 0, ran.stdout[-3000:]
    family, torch_gen = LTX2Family(), torch.Generator().manual_seed(1)

    def predict(transformer):
        cfg = transformer.config
        sample = torch.randn(2, 8, sample_frames(cfg, 3, 4, 4), 4, 4, generator=torch_gen.manual_seed(1))
        text = TextBatch(hidden=torch.randn(2, 7, 32, generator=torch_gen), pooled=torch.zeros(2, 0),
                         size_ids=torch.zeros(2, 6), latent_size=tuple(sample.shape[2:]), guidance=1.0)
        named = dict(family.conditions(cfg, text), timestep=torch.tensor([300.0, 800.0]))
        with torch.no_grad():
            return family.diffusers_forward(transformer, family.pack(cfg, sample), named)

    check_diffusers_lora(LTX2Pipeline, tiny_video / "ltx2", run, tmp_path / "out", predict)
    # ComfyUI's LTX-2 model has Lightricks' names: `diffusion_model.` and the release's layer names
    check_comfyui_lora(LTX2Pipeline, tiny_video / "ltx2", run, tmp_path / "comfy.safetensors", predict,
                       ltx2_to_release, ltx2_from_release)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_a_single_file_in_the_release_layout_reads_as_the_folders_weights(tiny_video, tmp_path, monkeypatch, prefix):
    """Lightricks' layout (`patchify_proj`, `adaln_single`, `q_norm`, ...), alone or as a whole release whose other
    weights (the VAEs', the connectors') sit beside the transformer's, with model.components naming the folder of the
    rest; and written back (`export --format original`'s map), diffusers' own reader gives every tensor back."""
    from safetensors.torch import load_file, save_file

    from diffpipe.build import build_backbone
    from diffpipe.config_files import build_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tiny_video / "ltx2"
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    release = ltx2_to_release(weights)
    assert "patchify_proj.weight" in release and "adaln_single.emb.timestep_embedder.linear_1.weight" in release
    assert "transformer_blocks.0.attn1.q_norm.weight" in release
    back = ltx2_from_release(dict(release))
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    whole = {prefix + k: v for k, v in release.items()}
    if prefix:  # a whole release: the other components' weights beside the transformer's
        whole.update({"vae.per_channel_statistics.mean-of-means": torch.zeros(8),
                      prefix + "video_embeddings_connector.learnable_registers": torch.zeros(8, 16)})
    single = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(whole, str(single))
    config = build_config({"model": {"architecture": "ltx2", "path": str(single), "components": str(folder)},
                           "data": {"dataset": "folder", "path": str(tiny_video / "av_clips"), "resolution": 64,
                                    "bucket_step": 16, "frame_buckets": [17]}})
    model = build_backbone(config).model
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())

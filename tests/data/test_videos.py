"""Video files as training data: read back as written (mp4 and webm through PyAV), clip lengths from frame buckets,
broken and short files skipped and counted, the video VAE's latents scaled as WanPipeline decodes them and cached,
umT5's outputs as WanPipeline encodes prompts; a folder of a video model's pipeline picks its family itself."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from diffpipe.data.folder import BadImage
from diffpipe.data.videos import clip_frames, probe_video, read_clip
from tests.conftest import load_tiny_pipeline_script


def test_videos_read_back_as_written(tmp_path):
    script = load_tiny_pipeline_script()
    frames = script._shape_frames("square", "red", "right", 12, (48, 64))
    for suffix in (".mp4", ".webm"):
        path = script.write_video(tmp_path / f"clip{suffix}", frames)
        assert probe_video(path) == (64, 48, 12, 8.0)  # written at 8 frames a second
        read = read_clip(path, 12)
        assert len(read) == 12 and read[0].size == (64, 48)
        for written, got in zip(frames, read):  # lossy codecs: close, and each frame in its place
            assert np.abs(np.asarray(got, dtype=float) - written).mean() < 6
        assert np.abs(np.asarray(read[0], dtype=float) - frames[6]).mean() > 10  # the square moved
        with pytest.raises(BadImage, match="only 12 of the 13 frames"):
            read_clip(path, 13)


def test_broken_video_files_are_refused_with_the_reason(tmp_path):
    script = load_tiny_pipeline_script()
    good = script.write_video(tmp_path / "good.mp4", script._shape_frames("disc", "blue", "up", 16, (48, 64)))
    (tmp_path / "noise.mp4").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(BadImage, match="not a readable video"):
        probe_video(tmp_path / "noise.mp4")
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # a download stopped half-way
    with pytest.raises(BadImage):
        read_clip(cut, 16)


def test_clip_lengths_come_from_the_frame_buckets():
    assert clip_frames(40, [1, 17, 33]) == 33
    assert clip_frames(32, [1, 17, 33]) == 17
    assert clip_frames(10, [1, 17, 33]) is None  # too short for any clip: skipped, not trained as one frame
    assert clip_frames(0, [1, 17, 33]) == 1  # a still image
    assert clip_frames(0, [17, 33]) is None
    assert clip_frames(10, [1]) == 1  # only stills wanted: each video's first frame


def test_wan_text_equals_wan_pipeline_encode_prompt(tiny_video):
    from diffusers import WanPipeline

    from diffpipe.models.families.wan.text import WanText

    captions = ["a red square moving right", "a  blue &amp; yellow disc", ""]
    text = WanText.from_folder(tiny_video / "wan")
    hidden, pooled = text.encode(captions)
    pipe = WanPipeline.from_pretrained(tiny_video / "wan", local_files_only=True)
    with torch.no_grad():  # as WanPipeline.__call__ runs it (with autograd on, SDPA's kernel differs by 1e-6)
        expected, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=512)
    assert hidden.shape == (3, 512, 32) and pooled.shape == (3, 0)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_wan_vae_latents_are_scaled_as_wan_pipeline_decodes_them(tiny_video):
    from diffpipe.models.vae import decode_latents, encode_latents, load_vae

    vae = load_vae(tiny_video / "wan")
    clip = torch.rand(2, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encode_latents(vae, clip)
    assert latents.shape == (2, 4, 3, 4, 6)  # 1 + 8 / 4 latent frames, 8x smaller sides
    # WanPipeline.__call__'s decode, as diffusers writes it: latents / (1 / latents_std) + latents_mean
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std_inverse = 1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        expected = vae.decode(latents / std_inverse + mean).sample.clamp(-1, 1)
    torch.testing.assert_close(decode_latents(vae, latents), expected)
    with torch.no_grad():  # and what is decoded is what was encoded: the posterior mean of the clip
        torch.testing.assert_close(latents / std_inverse + mean, vae.encode(clip).latent_dist.mean)


def test_an_image_vae_encodes_a_clip_frame_by_frame():
    from diffusers import AutoencoderKL

    from diffpipe.models.vae import encode_latents

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8).eval()
    clip = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    latents = encode_latents(vae, clip)
    assert latents.shape == (2, 4, 5, 8, 8)
    for f in range(5):
        torch.testing.assert_close(latents[:, :, f], encode_latents(vae, clip[:, :, f]))


def _dataset(tiny_video, clips, vae, **data):
    from diffpipe.config_files import build_config
    from diffpipe.data.preparation import prepare_folder_images
    from diffpipe.models.families.wan.text import WanText

    config = build_config({"model": {"path": str(tiny_video / "wan")},
                           "data": dict(dict(dataset="folder", path=str(clips), resolution=64, bucket_step=16,
                                             frame_buckets=[1, 17, 33]), **data)})
    text = WanText.from_folder(tiny_video / "wan")
    return prepare_folder_images(config.data, tiny_video / "wan", vae, text, show=False,
                                 frame_buckets=config.data.frame_buckets)


def test_a_video_folder_is_bucketed_cached_and_broken_files_counted(tiny_video, tmp_path, capsys):
    from diffpipe.data.images import read_pixels
    from diffpipe.models.vae import encode_latents, load_vae

    script = load_tiny_pipeline_script()
    clips = tmp_path / "clips"
    shutil.copytree(tiny_video / "clips", clips)
    script.write_video(clips / "short.mp4", script._shape_frames("disc", "red", "up", 10, (48, 64)))
    (clips / "noise.webm").write_bytes(bytes(range(256)) * 8)
    (clips / "empty.mp4").write_bytes(b"")
    good = clips / "red_square_left_0.mp4"  # 24 frames
    (clips / "cut.mp4").write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    vae = load_vae(tiny_video / "wan")
    data = _dataset(tiny_video, clips, vae)
    reasons = {path.name: why for path, why in data.skipped.files}
    assert set(reasons) == {"short.mp4", "noise.webm", "empty.mp4", "cut.mp4"}, reasons
    assert "too short: 10 frames" in reasons["short.mp4"] and "17" in reasons["short.mp4"]
    assert "skipped 4 image or video file(s)" in capsys.readouterr().out
    assert len(data.items) == 13  # twelve clips and the still image
    counts = data.bucket_counts()
    assert counts == {"48x80x17f": 2, "48x80x33f": 2, "80x48x17f": 6, "80x48x33f": 2, "80x48x1f": 1}, counts
    for indices in data.groups():  # one bucket and one clip length per batch: the latents stack
        assert len({tuple(data.latents[i].shape) for i in indices}) == 1
    i = next(i for i, p in enumerate(data.placements) if p.frames == 33)
    assert data.latents[i].shape == (4, 9, 48 // 8, 80 // 8) or data.latents[i].shape == (4, 9, 80 // 8, 48 // 8)
    fresh = encode_latents(vae, read_pixels(data.items[i], data.placements[i])[None])[0]
    torch.testing.assert_close(data.latents[i], fresh)
    again = _dataset(tiny_video, clips, None)  # a second run finds every entry: the VAE (None here) is never called
    assert len(again.items) == 13 and all(torch.equal(a, b) for a, b in zip(data.latents, again.latents))


def test_a_pipeline_folder_names_its_family_and_a_wrong_one_is_refused(tiny_video):
    from diffpipe.config import ConfigError
    from diffpipe.config_files import build_config

    assert build_config({"model": {"path": str(tiny_video / "wan")}}).model.architecture == "wan"
    with pytest.raises(ConfigError, match="WanTransformer3DModel .architecture 'wan'."):
        build_config({"model": {"path": str(tiny_video / "wan"), "architecture": "unet2d"}})

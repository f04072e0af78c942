"""An LTX-2 sample's layout: the video's latent frames, then its audio's tokens laid into latent frames after them
(zero-padded to whole frames), and the audio's length as LTX2Pipeline counts it: (8 (F - 1) + 1) frames at
`FRAME_RATE` frames a second last that many seconds, and the audio VAE gives sampling_rate / hop_length / 4 latent
frames a second (25 in the release). `cfg` is the transformer's config (its VAE scale factors and audio timing).
"""
from __future__ import annotations

import math

__all__ = ["FRAME_RATE", "audio_latent_frames", "sample_frames", "video_frames_of"]

FRAME_RATE = 24.0  # LTX2Pipeline's default frame_rate: what the audio's length and the video's time positions assume


def audio_latent_frames(cfg, video_frames: int) -> int:
    """The audio latent frames LTX2Pipeline makes for `video_frames` latent frames of video (at FRAME_RATE)."""
    seconds = ((video_frames - 1) * cfg.vae_scale_factors[0] + 1) / FRAME_RATE
    return round(seconds * cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor)


def _audio_rows(cfg, video_frames: int, height: int, width: int) -> int:
    """Latent frames the audio's tokens fill after `video_frames` of video (height x width tokens a frame)."""
    return math.ceil(audio_latent_frames(cfg, video_frames) / (height * width))


def video_frames_of(cfg, frames: int, height: int, width: int) -> int:
    """The video's latent frames in a sample of `frames` latent frames (the video's and the audio's after them)."""
    for video in range(1, frames):
        if video + _audio_rows(cfg, video, height, width) == frames:
            return video
    raise ValueError(f"no LTX-2 clip fills {frames} latent frames of {height} x {width} with its video and audio")


def sample_frames(cfg, video_frames: int, height: int, width: int) -> int:
    """Latent frames of a sample whose video has `video_frames`: the video's and its audio's."""
    return video_frames + _audio_rows(cfg, video_frames, height, width)

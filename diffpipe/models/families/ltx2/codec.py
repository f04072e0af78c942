"""LTX-2's two frozen VAEs as one codec: a clip's pixels and its audio in, a sample's latents out (the layout of
ltx2.py: the video's latent frames, then the audio's tokens in latent frames after them).

A clip is read at 24 frames a second (`FRAME_RATE`, what the model is told) with its audio track: the first F frames
and the audio of those F / 24 seconds, resampled to the audio VAE's rate (16 kHz) in stereo by PyAV. A clip at another
frame rate is read at 24 too: the k-th frame is the one on screen at k / 24 seconds (a 30 fps clip loses every fifth
frame, an 8 fps one shows each three times), and its length in frames is counted at 24 (`frames_of`) when it is
bucketed. A clip without an audio track or with less audio than video is not used (skipped and counted, with the
reason).
Until it is encoded the audio rides with the pixels in one tensor, the waveform's samples laid into extra pixel
frames after the clip's (`with_audio`), so the data path stacks, buckets and caches it as it does any clip.

Video: LTX-2's video VAE, each latent channel less the VAE's `latents_mean`, times `scaling_factor`, over
`latents_std` (LTX2Pipeline's `_normalize_latents`). Audio: the log-mel spectrogram the audio VAE was trained on
(magnitude STFT of 1024 points, a Hann window, hop `mel_hop_length`, slaney mel bins from 0 to half the rate,
log of at least 1e-5; the recipe of LTX-2's audio processor), the audio VAE's posterior mean, cut to the latents the
pipeline makes for F frames, packed as LTX2Pipeline packs them (each latent frame's channels x mel bins a token) and
normalised by the audio VAE's `latents_mean` and `latents_std` (its `_normalize_audio_latents`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ....errors import BadImage
from .layout import FRAME_RATE, audio_latent_frames, sample_frames, video_frames_of

__all__ = ["AudioVideoCodec", "read_audio", "frame_rate", "log_mel", "with_audio", "MEL_FFT"]

MEL_FFT = 1024  # LTX-2's audio processor: n_fft = win_length = 1024 at 16 kHz


def _mel_filters(bins: int, n_fft: int, rate: int) -> torch.Tensor:
    """(n_fft // 2 + 1, bins) slaney-scale, slaney-normalised triangular filters from 0 Hz to rate / 2 (torchaudio's
    `melscale_fbanks(..., norm="slaney", mel_scale="slaney")`, librosa's default)."""
    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        linear = f / (200.0 / 3)
        log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, linear)

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))

    freqs = np.linspace(0, rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(rate / 2), bins + 2))
    slopes = edges[None, :] - freqs[:, None]  # (freqs, bins + 2)
    down = -slopes[:, :-2] / np.diff(edges)[:-1]
    up = slopes[:, 2:] / np.diff(edges)[1:]
    filters = np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:bins + 2] - edges[:bins]))[None, :]
    return torch.from_numpy(filters).float()


def log_mel(waveform: torch.Tensor, rate: int, hop: int, bins: int) -> torch.Tensor:
    """(B, channels, samples) -> (B, channels, frames, bins): the log-mel spectrogram the audio VAE reads."""
    b, c, n = waveform.shape
    window = torch.hann_window(MEL_FFT, device=waveform.device)
    spectrum = torch.stft(waveform.reshape(b * c, n).float(), MEL_FFT, hop_length=hop, win_length=MEL_FFT,
                          window=window, center=True, pad_mode="reflect", return_complex=True).abs()
    mel = torch.einsum("bft,fm->btm", spectrum, _mel_filters(bins, MEL_FFT, rate).to(spectrum.device))
    return torch.log(mel.clamp(min=1e-5)).reshape(b, c, -1, bins)


def read_audio(path: Path, seconds: float, rate: int, channels: int = 2) -> torch.Tensor:
    """(channels, round(seconds * rate)) float samples of the file's first audio track from its start, resampled by
    PyAV; `BadImage` where there is none or it is shorter than `seconds`."""
    import av

    want = round(seconds * rate)
    layout = {1: "mono", 2: "stereo"}[channels]
    chunks, have = [], 0
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise BadImage("no audio track: LTX-2 trains a clip's video together with its audio")
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
                    have += chunks[-1].shape[1]
                if have >= want:
                    break
            for out in resampler.resample(None) if have < want else ():
                chunks.append(out.to_ndarray())
                have += chunks[-1].shape[1]
    except BadImage:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise BadImage(f"its audio cannot be decoded ({type(exc).__name__})") from None
    if have < want:
        raise BadImage(f"its audio lasts {have / rate:.2f} s, less than the {seconds:.2f} s of video trained")
    return torch.from_numpy(np.concatenate(chunks, axis=1)[:, :want].copy())


def frame_rate(path: Path) -> float:
    """Frames a second of the file's first video stream, as its container states it; 0.0 where it states none."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            return float(stream.average_rate or stream.guessed_rate or 0.0)
    except (av.FFmpegError, OSError, ValueError, IndexError) as exc:
        raise BadImage(f"not a readable video ({type(exc).__name__})") from None


def _rate_of(item) -> float:
    """A clip's frames a second: as the folder scan read it with its frames, else from the file's container;
    `BadImage` where neither states one (its frames could not be placed in time beside its sound)."""
    rate = item.frame_rate or frame_rate(item.path)
    if rate <= 0:
        raise BadImage("its container states no frame rate, which LTX-2 needs to place its frames beside its "
                       "sound; re-encode it with one (ffmpeg -i IN -r 24 OUT.mp4)")
    return rate


def _is_24(rate: float) -> bool:
    return abs(rate - FRAME_RATE) <= 0.01


def _audio_samples(pixel_frames: int, rate: int) -> int:
    return round(pixel_frames / FRAME_RATE * rate)


def with_audio(pixels: torch.Tensor, waveform: torch.Tensor) -> torch.Tensor:
    """A clip's pixels (3, F, H, W) with its waveform (channels, samples) laid into extra frames after them."""
    c, f, h, w = pixels.shape
    flat = waveform.reshape(-1)
    frames = math.ceil(flat.numel() / (c * h * w))
    padded = torch.cat((flat, flat.new_zeros(frames * c * h * w - flat.numel())))
    return torch.cat((pixels, padded.view(c, frames, h, w).to(pixels.dtype)), dim=1)


class AudioVideoCodec(nn.Module):
    """LTX-2's video VAE and audio VAE, encoding a clip with its audio to one sample's latents (module docstring)."""

    def __init__(self, video: nn.Module, audio: nn.Module, transformer_config):
        super().__init__()
        self.video, self.audio = video, audio
        self.config = video.config  # what the data path reads of a VAE: the video's (channels, scale, frames)
        self.channels = audio.config.in_channels
        self.timing = transformer_config  # the audio's length and the sample's layout (ltx2.py) read it

    @classmethod
    def from_folder(cls, folder: Path) -> "AudioVideoCodec":
        """An LTX2Pipeline folder's vae/ and audio_vae/, frozen (safetensors only)."""
        from types import SimpleNamespace

        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel

        from ...folder import component_weights

        parts = []
        for name, model_class in (("vae", AutoencoderKLLTX2Video), ("audio_vae", AutoencoderKLLTX2Audio)):
            component_weights(folder, name)  # refuses pickles before from_pretrained could read one
            parts.append(model_class.from_pretrained(folder, subfolder=name, use_safetensors=True,
                                                     local_files_only=True, low_cpu_mem_usage=False)
                         .eval().requires_grad_(False))
        config = LTX2VideoTransformer3DModel.load_config(folder, subfolder="transformer", local_files_only=True)
        return cls(*parts, SimpleNamespace(**config))

    def _video_statistics(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The video VAE's per-channel latent mean and spread, shaped to broadcast over `like` (B, C, F, H, W)."""
        channel = (1, -1, 1, 1, 1)
        return self.video.latents_mean.view(channel).to(like), self.video.latents_std.view(channel).to(like)

    def _pixel_frames(self, frames: int, height: int, width: int) -> int:
        """The clip's frames in a (3, frames, H, W) tensor of pixels with its audio after them."""
        for pixel_frames in range(1, frames + 1):
            samples = self.channels * _audio_samples(pixel_frames, self.audio.config.sample_rate)
            if pixel_frames + math.ceil(samples / (3 * height * width)) == frames:
                return pixel_frames
        raise ValueError(f"no clip with its audio fills {frames} frames of {height} x {width} pixels")

    def frames_of(self, item) -> int:
        """The frames a clip offers at 24 a second (the data path buckets clips by it): its own count at 24, else
        the most whose times k / 24 fall within its length; 0 for a still image."""
        if item.frames == 0:
            return 0
        rate = _rate_of(item)
        return item.frames if _is_24(rate) else math.ceil(item.frames * FRAME_RATE / rate - 1e-9)

    def read_item(self, item, placement, read_pixels) -> torch.Tensor:
        """The item's clip (its pixels as `read_pixels` reads them, at 24 frames a second) with its audio
        (`with_audio`); `BadImage` where it cannot be used (a still image, no or too little audio)."""
        if not placement.frames or item.frames == 0:
            raise BadImage("a still image: LTX-2 trains clips with their audio")
        rate = _rate_of(item)
        if _is_24(rate):
            pixels = read_pixels(item, placement)
        else:  # the frame on screen at each k / 24 seconds, of as many of the clip's own as that reaches
            shown = [math.floor(k * rate / FRAME_RATE + 1e-9) for k in range(placement.frames)]
            pixels = read_pixels(item, replace(placement, frames=shown[-1] + 1))[:, shown]
        sample_rate = self.audio.config.sample_rate
        waveform = read_audio(item.path, placement.frames / FRAME_RATE, sample_rate, self.channels)
        return with_audio(pixels, waveform)

    @torch.no_grad()
    def encode_sample(self, clips: torch.Tensor) -> torch.Tensor:
        """(B, 3, F + k, H, W) clips with their audio (`with_audio`) -> (B, C, f + a, h, w) a sample's latents."""
        b, _, total, height, width = clips.shape
        frames = self._pixel_frames(total, height, width)
        weights = next(self.video.parameters())
        z = self.video.encode(clips[:, :, :frames].to(weights.device, weights.dtype)).latent_dist.mean.float()
        mean, std = self._video_statistics(z)
        video = (z - mean) * self.video.config.scaling_factor / std
        rate, cfg = self.audio.config.sample_rate, self.audio.config
        samples = _audio_samples(frames, rate)
        waveform = clips[:, :, frames:].reshape(b, -1)[:, :self.channels * samples].reshape(b, self.channels, samples)
        mel = log_mel(waveform.to(weights.device), rate, cfg.mel_hop_length, cfg.mel_bins)
        audio_weights = next(self.audio.parameters())
        z = self.audio.encode(mel.to(audio_weights.dtype)).latent_dist.mean.float()  # (B, C, L', M')
        count = audio_latent_frames(self.timing, video.shape[2])
        if z.shape[2] < count:
            raise ValueError(f"the audio VAE made {z.shape[2]} latent frames of {samples} samples, fewer than the "
                             f"{count} the pipeline makes for {frames} frames")
        tokens = z[:, :, :count].transpose(1, 2).flatten(2, 3)  # (B, L, C * M'): LTX2Pipeline._pack_audio_latents
        tokens = (tokens - self.audio.latents_mean.to(tokens)) / self.audio.latents_std.to(tokens)
        latents_h, latents_w = video.shape[3:]
        rows = sample_frames(self.timing, video.shape[2], latents_h, latents_w) - video.shape[2]
        flat = torch.cat((tokens, tokens.new_zeros(b, rows * latents_h * latents_w - count, tokens.shape[2])), dim=1)
        audio = flat.view(b, rows, latents_h, latents_w, -1).permute(0, 4, 1, 2, 3)
        return torch.cat((video, audio), dim=2)

    @torch.no_grad()
    def decode_sample(self, latents: torch.Tensor) -> torch.Tensor:
        """RGB in [-1, 1] on the CPU of a sample's video (samples during training are shown without their audio)."""
        weights = next(self.video.parameters())
        video_frames = video_frames_of(self.timing, *latents.shape[2:])
        z = latents[:, :, :video_frames].to(weights.device, torch.float32)
        mean, std = self._video_statistics(z)
        z = z * std / self.video.config.scaling_factor + mean
        return self.video.decode(z.to(weights.dtype)).sample.float().clamp(-1, 1).cpu()

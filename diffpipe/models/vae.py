"""The frozen VAE of a pipeline folder, and latents scaled as training sees them: images through an image VAE
(`AutoencoderKL`: SD, SDXL, Flux, SD3, and the spatio-temporal UNet's text-to-video pipelines, frame by frame) and
clips through Wan's video VAE (`AutoencoderKLWan`: 8x smaller sides, 1 + (F - 1) / 4 latent frames of F frames).
Qwen-Image's VAE (`AutoencoderKLQwenImage`, Wan's kind) encodes an image as a clip of one frame. HunyuanVideo 1.5's
(`AutoencoderKLHunyuanVideo15`: 16x smaller sides, a latent frame per 4 video frames) encodes clips too. FLUX.2's
(`AutoencoderKLFlux2`) makes 32 channels at 8x smaller sides.

Scaling follows diffusers' own training scripts and pipelines: (z - shift_factor) x scaling_factor for image VAEs;
per channel (z - latents_mean) / latents_std for Wan's and Qwen's (their pipelines decode with the inverse);
z x scaling_factor for HunyuanVideo 1.5's (as its pipelines encode a first frame and decode); for FLUX.2's, each 2x2
patch's channels less its batch norm's running mean over its running spread (Flux2Pipeline normalises its patchified
latents so), the latents kept unpatchified: the family packs 2x2 patches into tokens as Flux.1's does. A family may
bring a codec of its own instead (`ModelFamily.folder_vae`: LTX-2's two VAEs, video and audio, reading and encoding
a clip with its sound, families/ltx2/codec.py); `encode_latents` and `decode_latents` hand such a codec's latents to
its `encode_sample` and `decode_sample`. Weights are read from safetensors files only.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLHunyuanVideo15, AutoencoderKLQwenImage,
                       AutoencoderKLWan)

from .folder import component_weights

__all__ = ["load_vae", "vae_scale_factor", "vae_frame_factor", "trains_images", "vae_latent_channels", "latent_frames", "encode_latents",
           "decode_latents"]

_VIDEO_VAES = {"AutoencoderKLWan": AutoencoderKLWan, "AutoencoderKLQwenImage": AutoencoderKLQwenImage,
               "AutoencoderKLHunyuanVideo15": AutoencoderKLHunyuanVideo15}


def _vae_config(folder: Path) -> dict:
    return json.loads((folder / "vae" / "config.json").read_text())


def load_vae(folder: Path) -> AutoencoderKL | AutoencoderKLWan | AutoencoderKLQwenImage:
    component_weights(folder, "vae")  # refuses pickles before from_pretrained could read one
    vae_class = {**_VIDEO_VAES, "AutoencoderKLFlux2": AutoencoderKLFlux2}.get(_vae_config(folder).get("_class_name"),
                                                                            AutoencoderKL)
    vae = vae_class.from_pretrained(folder, subfolder="vae", use_safetensors=True, local_files_only=True,
                                    low_cpu_mem_usage=False)  # (True would need accelerate)
    return vae.eval().requires_grad_(False)


def vae_scale_factor(source: Path | torch.nn.Module) -> int:
    """Pixels per latent along a side, of a pipeline folder's VAE or a loaded one: the factor a Wan VAE states (8 for
    Wan 2.1's; 16 for Wan 2.2's, whose 2x2 patching comes before its levels), else 2 per VAE level after the first
    (8 for SD's)."""
    cfg = _vae_config(source) if isinstance(source, Path) else source.config
    stated = cfg.get("scale_factor_spatial") or cfg.get("spatial_compression_ratio")  # Wan's name; HunyuanVideo 1.5's
    if stated:
        return int(stated)
    if "downsample_type" in cfg:  # LTX-2's: its patch, then each level that halves the sides
        return cfg["patch_size"] * 2 ** sum("spatial" in kind for kind in cfg["downsample_type"])
    return 2 ** (len(cfg.get("block_out_channels") or cfg.get("dim_mult")) - 1)


def vae_latent_channels(folder: Path) -> int | None:
    """Channels of the latents a pipeline folder's VAE makes (an image VAE's latent_channels, Wan's z_dim)."""
    cfg = _vae_config(folder)
    return cfg.get("latent_channels", cfg.get("z_dim"))


def vae_frame_factor(source: Path | torch.nn.Module) -> int:
    """Video frames per latent frame after the first, of a pipeline folder's VAE or a loaded one: 4 for Wan's VAEs
    (as they state it, else from their temporal levels); 1 for an image VAE (every frame encoded)."""
    cfg = _vae_config(source) if isinstance(source, Path) else source.config
    stated = cfg.get("scale_factor_temporal") or cfg.get("temporal_compression_ratio")
    if stated:
        return int(stated)
    if "downsample_type" in cfg:  # LTX-2's: each level that halves the frames ("temporal", "spatiotemporal")
        return cfg["patch_size_t"] * 2 ** sum("temporal" in kind for kind in cfg["downsample_type"])
    return 2 ** sum(cfg.get("temperal_downsample", []))


def trains_images(folder: Path) -> bool:
    """Whether a folder's VAE is one an image model trains through: an image VAE, or Qwen's (a video VAE whose
    pipelines encode each image as a clip of one frame). Wan's and HunyuanVideo 1.5's make latents of clips for video
    models."""
    return _vae_config(folder).get("_class_name") not in ("AutoencoderKLWan", "AutoencoderKLHunyuanVideo15",
                                                          "AutoencoderKLLTX2Video")


def latent_frames(video_frames: int, frame_factor: int) -> int:
    """Latent frames of a clip: the first frame alone, then one per `frame_factor` frames."""
    return 1 + (video_frames - 1) // frame_factor


def _wan_statistics(vae, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's (and Qwen's) per-channel latent mean and spread, shaped to broadcast over (N, C, F, H, W)."""
    channel = (1, -1, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean, device=device).view(channel),
            torch.tensor(vae.config.latents_std, device=device).view(channel))


def _flux2_normalised(vae, z: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """FLUX.2's latents (N, 32, H, W) with each 2x2 patch's 128 channels normalised by the VAE's batch norm statistics
    (`inverse`: restored), as Flux2Pipeline normalises its patchified latents; the patch layout is Flux2Pipeline's
    `_patchify_latents` (channel, row, column), which is the family's packing too (tokens.pack_latents)."""
    (n, c, h, w), (p, q) = z.shape, vae.config.patch_size
    patched = z.view(n, c, h // p, p, w // q, q).permute(0, 1, 3, 5, 2, 4).reshape(n, c * p * q, h // p, w // q)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).to(z.device, z.dtype) + vae.config.batch_norm_eps)
    patched = patched * std + mean if inverse else (patched - mean) / std
    return patched.reshape(n, c, p, q, h // p, w // q).permute(0, 1, 4, 2, 5, 3).reshape(n, c, h, w)


def _clip_by_clip(fn, clips: torch.Tensor) -> torch.Tensor:
    """`fn` of one clip (1, C, F, H, W) applied to each of clips (N, C, F, H, W). HunyuanVideo 1.5's VAE needs it:
    it attends with a (B, S, S) mask that torch broadcasts against (B, 1, S, S) queries as (1, B, S, S), so diffusers
    0.42's encode and decode fail for more than one clip (huggingface/diffusers PR #13133, open)."""
    return torch.cat([fn(clip[None]) for clip in clips])


def _frame_by_frame(fn, clips: torch.Tensor) -> torch.Tensor:
    """`fn` of images (N, C, H, W) applied to every frame of clips (N, C, F, H, W), frames folded into the batch."""
    n, c, f, h, w = clips.shape
    folded = fn(clips.transpose(1, 2).reshape(n * f, c, h, w))
    return folded.reshape(n, f, *folded.shape[1:]).transpose(1, 2)


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Scaled latents of pixels in [-1, 1]: images (N, 3, H, W) or clips (N, 3, F, H, W); the mean of the VAE's
    posterior. An image VAE encodes a clip frame by frame."""
    if hasattr(vae, "encode_sample"):  # a codec of its own (LTX-2's two VAEs)
        return vae.encode_sample(pixels)
    weights = next(vae.parameters())
    pixels = pixels.to(weights.device, weights.dtype)
    if isinstance(vae, AutoencoderKLHunyuanVideo15) and len(pixels) > 1:
        return _clip_by_clip(lambda clip: encode_latents(vae, clip), pixels)
    if isinstance(vae, tuple(_VIDEO_VAES.values())):
        if pixels.dim() == 4:  # images as clips of one frame
            return encode_latents(vae, pixels.unsqueeze(2))[:, :, 0]
        z = vae.encode(pixels).latent_dist.mean.float()
        if isinstance(vae, AutoencoderKLHunyuanVideo15):
            return z * vae.config.scaling_factor
        mean, std = _wan_statistics(vae, weights.device)
        return (z - mean) / std
    if pixels.dim() == 5:
        return _frame_by_frame(lambda images: encode_latents(vae, images), pixels)
    if isinstance(vae, AutoencoderKLFlux2):
        return _flux2_normalised(vae, vae.encode(pixels).latent_dist.mean.float())
    cfg = vae.config
    return (vae.encode(pixels).latent_dist.mean.float() - (cfg.shift_factor or 0.0)) * cfg.scaling_factor


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """RGB in [-1, 1] on the CPU of latents scaled as `encode_latents` scales them (images or clips)."""
    if hasattr(vae, "decode_sample"):
        return vae.decode_sample(latents)
    weights = next(vae.parameters())
    latents = latents.to(weights.device, torch.float32)
    if isinstance(vae, AutoencoderKLHunyuanVideo15) and len(latents) > 1:
        return _clip_by_clip(lambda clip: decode_latents(vae, clip), latents)
    if isinstance(vae, tuple(_VIDEO_VAES.values())):
        if latents.dim() == 4:
            return decode_latents(vae, latents.unsqueeze(2))[:, :, 0]
        if isinstance(vae, AutoencoderKLHunyuanVideo15):
            z = latents / vae.config.scaling_factor
        else:
            mean, std = _wan_statistics(vae, weights.device)
            z = latents * std + mean
    elif latents.dim() == 5:
        return _frame_by_frame(lambda images: decode_latents(vae, images), latents)
    elif isinstance(vae, AutoencoderKLFlux2):
        z = _flux2_normalised(vae, latents, inverse=True)
    else:
        z = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    return vae.decode(z.to(weights.dtype)).sample.float().clamp(-1, 1).cpu()

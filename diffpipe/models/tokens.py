"""Tokens of the DiT families, shared: latents packed 2x2 into tokens and back (Flux's packing, which Qwen-Image and
Kontext use too), a batch's text cut to one of a few lengths with its mask (Qwen-Image, Chroma, HunyuanVideo 1.5),
and diffusers' RMSNorm drawn as diffusers builds it.

A pipelined step needs a fixed set of shapes (its receive buffers are built per shape), so a batch's text is cut to
the smallest of a family's lengths that holds its longest caption: at most a few text shapes a bucket, and at most
2x a batch's longest caption, masked.
"""
from __future__ import annotations

import torch
from diffusers.models.normalization import RMSNorm
from torch import nn

from .text import filled_lengths_of

__all__ = ["pack_latents", "unpack_latents", "TEXT_LENGTHS", "text_mask", "mask_or_none", "reset_rms_norm"]

TEXT_LENGTHS = (32, 64, 128, 256, 512)  # a batch's text is cut to the smallest that holds it (Qwen-Image, Chroma)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), as FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
    """The inverse of `pack_latents`, as FluxPipeline._unpack_latents."""
    (b, _, channels), (h, w) = tokens.shape, latent_size
    tokens = tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(b, channels // 4, h, w)


def text_mask(hidden: torch.Tensor, filled: list[int] | None = None,
              lengths: tuple[int, ...] = TEXT_LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's text cut (or zero-padded) to the smallest of `lengths` holding its longest caption, and its mask
    (True where a caption's encoder filled the position; empty (B, 0) where every position is filled). `filled`: each caption's
    positions up to its last filled one, known on the host (CaptionEncoder.filled_lengths), so the cut needs no
    wait for the device; read off `hidden` where not given. Text with no filled position at all (the zeros a plan
    traces; never a caption's: Qwen's template leaves tokens even of an empty one) keeps its length, the longest a
    caption may be, unmasked: a plan counts attention as the fused kernel runs it, masked or not, and not the
    probability matrix the unfused one would keep for a mask."""
    if filled is None:
        filled = filled_lengths_of(hidden)
    if not any(filled):
        filled = [hidden.shape[1]] * len(filled)
    longest = max(filled)
    length = next((n for n in lengths if n >= longest), max(longest, hidden.shape[1]))
    if length > hidden.shape[1]:  # texts kept as long as they are (an edit model's: models/families/qwen_image/edit.py)
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, length - hidden.shape[1]))
    if all(n == length for n in filled):
        return hidden[:, :length], torch.zeros(len(filled), 0, dtype=torch.bool, device=hidden.device)
    mask = torch.arange(length)[None, :] < torch.tensor(filled)[:, None]
    return hidden[:, :length], mask.to(hidden.device, non_blocking=True)


def reset_rms_norm(module: nn.Module) -> bool:
    """diffusers' RMSNorm (no `reset_parameters`) drawn as diffusers builds it: weight 1, bias 0; False for another
    module."""
    if not isinstance(module, RMSNorm):
        return False
    for name, p in module.named_parameters(recurse=False):
        p.fill_(1.0 if name == "weight" else 0.0)
    return True


def mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
    """A mask, or None for an empty (B, 0) one (nothing masked: attention may take its unmasked kernels)."""
    return mask if mask.shape[1] else None

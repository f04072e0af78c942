"""Wan 2.2 TI2V-5B's image-to-video, as diffusers' `WanImageToVideoPipeline` runs it with `expand_timesteps`: the
transformer reads as many channels as it predicts (48), and the picture is not joined along the channels; its
latents replace the first latent frame of the noisy clip, and the tokens of that frame are given timestep 0 while the
others are at the step's timestep. The pipeline predicts every frame and then puts the picture's latents back in the
first, so that frame's prediction is never used: here it is zero, and its target too, so it adds nothing to the loss
(a mean over every element, the first frame's counted as zeros, as data.mask_path's masked loss counts them).

The pipeline gives the transformer a timestep per token (B, tokens), which diffusers turns into six modulations per
token in every block, (B, tokens, 6, width): 2 GiB a block in fp32 at 121 frames of 704x1280, and kept for the
backward. Within a latent frame every token has the same timestep, so the units here embed one timestep per latent
frame: `temb` (B, frames, width) and `tproj` (B, frames, 6, width) cross a boundary, and each block modulates its
tokens frame by frame (the same numbers, tested against the model's own forward with per-token timesteps).

`first_frame` (a condition every stage gets) is (B, 1 + C, 1, h, w): a channel that is 1 where a sample's first
frame is fixed (0 for a prompt alone: text-to-video, every frame at the step's timestep), then that frame's latents.
"""
from __future__ import annotations

import torch
from torch import nn

from ...units import Backbone, Unit

__all__ = ["wan_ti2v_backbone", "ti2v_first_frame", "ti2v_pipeline_input", "ti2v_clean_latents"]


def ti2v_first_frame(clip_latents: torch.Tensor | None, batch: int, latent_size: tuple[int, int, int],
                     channels: int, device=None) -> torch.Tensor:
    """The `first_frame` condition from each clip's first frame encoded (B, C, F, h, w: the frame, then grey frames,
    as data/first_frames.py caches it; Wan's VAE is causal in time, so the first latent frame is the frame's own
    encoding, which the pipeline makes of the picture alone), or None: nothing fixed."""
    if clip_latents is None:
        return torch.zeros(batch, 1 + channels, 1, *latent_size[1:], device=device)
    first = clip_latents[:, :, :1].float()
    return torch.cat((torch.ones_like(first[:, :1]), first), dim=1)


def _fixed(first_frame: torch.Tensor) -> torch.Tensor:
    """(B,) booleans: whether each sample's first frame is fixed."""
    return first_frame[:, 0, 0, 0, 0] > 0


def ti2v_pipeline_input(sample: torch.Tensor, first_frame: torch.Tensor, timestep: torch.Tensor,
                        patch: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What WanImageToVideoPipeline (expand_timesteps) gives its transformer for noisy latents `sample` (B, C, F, h, w):
    (1 - mask) x condition + mask x latents, and the timestep per token, mask x t (mask: 0 on a fixed first frame,
    1 elsewhere); and that mask, which keeps the prediction (the reference of the tests)."""
    mask = torch.ones_like(sample[:, :1])
    mask[_fixed(first_frame), :, 0] = 0
    joined = (1 - mask) * first_frame[:, 1:].to(sample.dtype) + mask * sample
    per_token = mask[:, 0, :, ::patch[0], ::patch[1]] * timestep.view(-1, 1, 1, 1)
    return joined, per_token.flatten(1), mask


def ti2v_clean_latents(first_frame: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, latents) broadcasting over a clip's latents (B, C, F, h, w): (B, 1, F, 1, 1), 1 on a fixed first frame;
    and that frame's latents (B, C, 1, h, w), the condition's own (the mask decides where they count)."""
    mask = torch.zeros(len(first_frame), 1, frames, 1, 1, device=first_frame.device)
    mask[:, 0, 0] = _fixed(first_frame).float().view(-1, 1, 1)
    return mask, first_frame[:, 1:]


def _by_frame(h: torch.Tensor, frames: int) -> torch.Tensor:
    """Tokens (B, frames x rows x columns, D) as (B, frames, rows x columns, D)."""
    return h.unflatten(1, (frames, -1))


class _FrameEmbed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = model.rope, model.patch_embedding, model.condition_embedder

    def forward(self, sample, first_frame, timestep, encoder_hidden_states):
        fixed = _fixed(first_frame)
        first = torch.where(fixed.view(-1, 1, 1, 1, 1), first_frame[:, 1:].to(sample.dtype), sample[:, :, :1])
        sample = torch.cat((first, sample[:, :, 1:]), dim=2)
        frames = sample.shape[2]
        per_frame = timestep.view(-1, 1).expand(-1, frames).clone()
        per_frame[:, 0] = torch.where(fixed, torch.zeros_like(timestep), timestep)
        cos, sin = self.rope(sample)
        h = self.patch_embedding(sample).flatten(2).transpose(1, 2).contiguous()
        temb, tproj, context, _ = self.condition_embedder(per_frame.flatten(), encoder_hidden_states, None,
                                                          timestep_seq_len=frames)
        return {"h": h, "context": context, "temb": temb, "tproj": tproj.unflatten(2, (6, -1)),
                "rope": torch.stack((cos, sin))}


class _FrameBlock(nn.Module):
    """diffusers' WanTransformerBlock.forward with its modulations per latent frame (the per-token branch's
    arithmetic, each frame's six rows broadcast over its tokens)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, context, tproj, rope):
        block, frames = self.block, tproj.shape[1]
        mods = (block.scale_shift_table.unsqueeze(0) + tproj.float()).unsqueeze(2)  # (B, frames, 1, 6, D)
        shift, scale, gate, c_shift, c_scale, c_gate = mods.unbind(3)

        def modulated(norm, x, shift, scale):
            return (_by_frame(norm(x.float()), frames) * (1 + scale) + shift).flatten(1, 2).type_as(x)

        attn = block.attn1(modulated(block.norm1, h, shift, scale), None, None, (rope[0], rope[1]))
        h = (h.float() + (_by_frame(attn, frames) * gate).flatten(1, 2)).type_as(h)
        h = h + block.attn2(block.norm2(h.float()).type_as(h), context, None, None)
        ff = block.ffn(modulated(block.norm3, h, c_shift, c_scale))
        return {"h": (h.float() + (_by_frame(ff.float(), frames) * c_gate).flatten(1, 2)).type_as(h)}


class _FrameOut(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.norm_out, self.proj_out, self.scale_shift_table = model.norm_out, model.proj_out, model.scale_shift_table

    def forward(self, h, temb, first_frame):
        frames = temb.shape[1]
        shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unsqueeze(2).unbind(3)
        h = (_by_frame(self.norm_out(h.float()), frames) * (1 + scale) + shift).flatten(1, 2).type_as(h)
        prediction = _by_frame(self.proj_out(h), frames)
        keep = torch.ones(len(prediction), frames, 1, 1, dtype=prediction.dtype, device=prediction.device)
        keep[_fixed(first_frame), 0] = 0  # the fixed frame is put back, never predicted
        return {"prediction": (prediction * keep).flatten(1, 2)}


def wan_ti2v_backbone(model) -> Backbone:
    """Wan's units with timesteps per latent frame and the first frame's latents put in place by `embed`."""
    conditions = ("timestep", "encoder_hidden_states", "first_frame")
    streams = ("h", "context", "temb", "tproj", "rope")
    units = [Unit("embed", _FrameEmbed(model), ("sample", "first_frame", "timestep", "encoder_hidden_states"), streams)]
    units += [Unit(f"block.{i}", _FrameBlock(b), ("h", "context", "tproj", "rope"), ("h",))
              for i, b in enumerate(model.blocks)]
    units.append(Unit("out", _FrameOut(model), ("h", "temb", "first_frame"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model,
                    tables=("rope",))

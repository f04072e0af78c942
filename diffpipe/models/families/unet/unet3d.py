"""Adapter for diffusers' `UNet3DConditionModel` (the spatio-temporal UNet of text-to-video models such as
ModelScope / Zeroscope): skips and temporal layers cross stage boundaries exactly like the 2-D UNet's.

The model folds frames into the batch: inside it every tensor is (batch x frames, channels, height, width), and
each block is told the frame count. Units: `time` (time embedding and text, repeated per frame: `temb`,
`context`), `conv_in` (frames folded, conv_in and the input temporal transformer: `skip.0`), each down block, the
mid block, each up block and `out` (frames unfolded: the prediction is (B, C, F, H, W), as diffusers returns it).
A unit recovers the frame count from its tensor's rows over the timestep's (one per sample), so nothing but
tensors crosses a boundary. Blocks stay whole (the "blocks" granularity).
"""
from __future__ import annotations

from diffusers import UNet3DConditionModel
from torch import nn

from ...family import ModelFamily, TextBatch
from .unet2d import UNet2DFamily
from ...units import Backbone, Unit

__all__ = ["UNet3DFamily", "unet3d_backbone", "UNET3D_PRESETS"]

UNET3D_PRESETS = {
    "zeroscope": dict(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
                      block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=1024, attention_head_dim=64,
                      down_block_types=("CrossAttnDownBlock3D",) * 3 + ("DownBlock3D",),
                      up_block_types=("UpBlock3D",) + ("CrossAttnUpBlock3D",) * 3),
    "digits": dict(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(32, 64),
                   down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                   up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), norm_num_groups=8, cross_attention_dim=32,
                   attention_head_dim=8),
}


def _frames(h, timestep) -> int:
    return h.shape[0] // timestep.shape[0]


class _Time(nn.Module):
    def __init__(self, unet: UNet3DConditionModel):
        super().__init__()
        self.time_proj, self.time_embedding = unet.time_proj, unet.time_embedding

    def forward(self, sample, timestep, encoder_hidden_states):
        frames = sample.shape[2]
        emb = self.time_embedding(self.time_proj(timestep).to(encoder_hidden_states.dtype), None)
        return {"temb": emb.repeat_interleave(frames, dim=0),
                "context": encoder_hidden_states.repeat_interleave(frames, dim=0)}


class _ConvIn(nn.Module):
    def __init__(self, unet: UNet3DConditionModel):
        super().__init__()
        self.conv_in, self.transformer_in = unet.conv_in, unet.transformer_in

    def forward(self, sample):
        b, c, f, height, width = sample.shape
        h = self.conv_in(sample.permute(0, 2, 1, 3, 4).reshape(b * f, c, height, width))
        return {"skip.0": self.transformer_in(h, num_frames=f, return_dict=False)[0]}


class _Down(nn.Module):
    def __init__(self, block: nn.Module, h_name: str, skip_names: list[str]):
        super().__init__()
        self.block, self.h_name, self.skip_names = block, h_name, skip_names

    def forward(self, timestep, temb, context, **named):
        h = named[self.h_name]
        kwargs = dict(hidden_states=h, temb=temb, num_frames=_frames(h, timestep))
        if getattr(self.block, "has_cross_attention", False):
            kwargs["encoder_hidden_states"] = context
        _, skips = self.block(**kwargs)
        return dict(zip(self.skip_names, skips, strict=True))


class _Mid(nn.Module):
    def __init__(self, block: nn.Module, h_name: str):
        super().__init__()
        self.block, self.h_name = block, h_name

    def forward(self, timestep, temb, context, **named):
        h = named[self.h_name]
        return {"h": self.block(h, temb, encoder_hidden_states=context, num_frames=_frames(h, timestep))}


class _Up(nn.Module):
    def __init__(self, block: nn.Module, h_name: str, skip_names: list[str], next_skip: str | None):
        super().__init__()
        self.block, self.h_name, self.skip_names, self.next_skip = block, h_name, skip_names, next_skip

    def forward(self, timestep, temb, context, **named):
        h = named[self.h_name]
        kwargs = dict(hidden_states=h, temb=temb, res_hidden_states_tuple=tuple(named[n] for n in self.skip_names),
                      num_frames=_frames(h, timestep))
        if self.next_skip is not None and self.block.upsamplers is not None:  # odd sizes: as diffusers' forward
            kwargs["upsample_size"] = named[self.next_skip].shape[2:]
        if getattr(self.block, "has_cross_attention", False):
            kwargs["encoder_hidden_states"] = context
        return {"h": self.block(**kwargs)}


class _Out(nn.Module):
    def __init__(self, unet: UNet3DConditionModel):
        super().__init__()
        self.norm, self.act, self.conv = unet.conv_norm_out, unet.conv_act, unet.conv_out

    def forward(self, h, timestep):
        if self.norm is not None:
            h = self.act(self.norm(h))
        h = self.conv(h)
        frames = _frames(h, timestep)
        return {"prediction": h[None, :].reshape((-1, frames) + h.shape[1:]).permute(0, 2, 1, 3, 4)}


def unet3d_backbone(unet: UNet3DConditionModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states")
    cross = ("timestep", "temb", "context")
    units = [Unit("time", _Time(unet), ("sample",) + conditions, ("temb", "context")),
             Unit("conv_in", _ConvIn(unet), ("sample",), ("skip.0",))]
    skips = ["skip.0"]
    for i, block in enumerate(unet.down_blocks):
        count = len(block.resnets) + (1 if block.downsamplers is not None else 0)
        new = [f"skip.{len(skips) + k}" for k in range(count)]
        units.append(Unit(f"down.{i}", _Down(block, skips[-1], new), cross + (skips[-1],), tuple(new)))
        skips += new
    h_name = skips[-1]
    if unet.mid_block is not None:
        units.append(Unit("mid", _Mid(unet.mid_block, h_name), cross + (h_name,), ("h",)))
        h_name = "h"
    for i, block in enumerate(unet.up_blocks):
        taken, skips = skips[-len(block.resnets):], skips[:-len(block.resnets)]
        next_skip = skips[-1] if skips else None
        sized = (next_skip,) if next_skip is not None and block.upsamplers is not None else ()
        reads = cross + tuple(dict.fromkeys((h_name,) + tuple(taken) + sized))
        units.append(Unit(f"up.{i}", _Up(block, h_name, taken, next_skip), reads, ("h",)))
        h_name = "h"
    units.append(Unit("out", _Out(unet), ("h", "timestep"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=unet)


class UNet3DFamily(ModelFamily):
    """The spatio-temporal UNet: one text encoder's hidden states, latents (B, C, F, H, W)."""

    name = "unet3d"
    model_class = UNet3DConditionModel
    component = "unet"
    backbone_name = "UNet"
    presets = UNET3D_PRESETS

    # a text-to-video pipeline folder (TextToVideoSDPipeline: ModelScope, Zeroscope) holds SD's text encoder, image
    # VAE (frames encoded one by one) and scheduler
    folder_text_encoder = UNet2DFamily.folder_text_encoder
    folder_text_widths = UNet2DFamily.folder_text_widths
    objective_of_folder = UNet2DFamily.objective_of_folder

    def check_supported(self, model):
        if model.config.time_cond_proj_dim is not None:
            raise ValueError("UNet3D config time_cond_proj_dim is not supported by the unet3d adapter yet; remove it")

    def describe(self, model, granularity):
        return unet3d_backbone(model)

    def latent_channels(self, cfg):
        return cfg.in_channels

    def default_latent_size(self, cfg):
        return cfg.sample_size

    def latent_frames(self, cfg):
        return 4 if cfg.in_channels == 1 else 16

    def text_widths(self, cfg):
        return cfg.cross_attention_dim, 0

    def conditions(self, cfg, text: TextBatch):
        return {"encoder_hidden_states": text.hidden}

    def diffusers_forward(self, model, sample, conditions):
        return model(sample, conditions["timestep"], encoder_hidden_states=conditions["encoder_hidden_states"]).sample

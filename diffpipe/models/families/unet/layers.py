"""Layer-level units for the standard diffusers UNet blocks: one unit per resnet (+ its transformer), per
downsampler and per upsampler, so the planner can cut inside a block (SDXL's first up block alone holds
47 % of the weights). Each unit does what the block's own forward does for that layer (FreeU and the
blocks' gradient checkpointing off); tests compare the whole model with diffusers' forward.
"""
from __future__ import annotations

import torch
from torch import nn

from ...units import Unit

__all__ = ["LAYERED_BLOCKS", "down_layers", "mid_layers", "up_layers"]

LAYERED_BLOCKS = {"CrossAttnDownBlock2D", "DownBlock2D", "UNetMidBlock2DCrossAttn", "CrossAttnUpBlock2D", "UpBlock2D"}
_CROSS = ("temb", "encoder_hidden_states")


class _Layer(nn.Module):
    """Resnet, transformer and resampler parts in block order, after concatenating a skip (up blocks)."""

    def __init__(self, parts: list[tuple[str, nn.Module]], h_name: str, out_name: str, skip_name: str | None = None,
                 size_name: str | None = None):
        super().__init__()
        self.kinds = [kind for kind, _ in parts]
        self.parts = nn.ModuleList(module for _, module in parts)
        self.h_name, self.out_name, self.skip_name, self.size_name = h_name, out_name, skip_name, size_name

    def forward(self, temb, encoder_hidden_states, **named):
        h = named[self.h_name]
        if self.skip_name is not None:
            h = torch.cat([h, named[self.skip_name]], dim=1)
        for kind, module in zip(self.kinds, self.parts):
            if kind == "resnet":
                h = module(h, temb)
            elif kind == "attention":
                h = module(h, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]
            elif self.size_name is not None:  # upsampler: to the size of the skip concatenated next (odd sizes)
                h = module(h, named[self.size_name].shape[2:])
            else:  # downsampler
                h = module(h)
        return {self.out_name: h}


def _unit(name: str, layer: _Layer) -> Unit:
    names = (layer.h_name, layer.skip_name, layer.size_name)
    reads = _CROSS + tuple(dict.fromkeys(n for n in names if n is not None))
    return Unit(name, layer, reads, (layer.out_name,))


def down_layers(index: int, block: nn.Module, h_name: str, new_skips: list[str]) -> list[Unit]:
    attentions = list(getattr(block, "attentions", [])) or [None] * len(block.resnets)
    units, names = [], iter(new_skips)
    for j, (resnet, attention) in enumerate(zip(block.resnets, attentions)):
        parts = [("resnet", resnet)] + ([("attention", attention)] if attention is not None else [])
        out = next(names)
        units.append(_unit(f"down.{index}.{j}", _Layer(parts, h_name, out)))
        h_name = out
    if block.downsamplers is not None:
        units.append(_unit(f"down.{index}.down", _Layer([("resample", block.downsamplers[0])], h_name, next(names))))
    return units


def mid_layers(block: nn.Module, h_name: str) -> list[Unit]:
    units = [_unit("mid.0", _Layer([("resnet", block.resnets[0])], h_name, "h"))]
    for j, (attention, resnet) in enumerate(zip(block.attentions, block.resnets[1:]), start=1):
        units.append(_unit(f"mid.{j}", _Layer([("attention", attention), ("resnet", resnet)], "h", "h")))
    return units


def up_layers(index: int, block: nn.Module, h_name: str, taken: list[str], next_skip: str | None) -> list[Unit]:
    """`next_skip`: the skip the next up block concatenates first; the upsampler takes its size, as diffusers'
    forward does, so latents of odd size (downsampled to ceil(n / 2)) come back to it."""
    attentions = list(getattr(block, "attentions", [])) or [None] * len(block.resnets)
    units = []
    for j, (resnet, attention) in enumerate(zip(block.resnets, attentions)):
        parts = [("resnet", resnet)] + ([("attention", attention)] if attention is not None else [])
        units.append(_unit(f"up.{index}.{j}", _Layer(parts, h_name, "h", skip_name=taken[-1 - j])))
        h_name = "h"
    if block.upsamplers is not None:
        units.append(_unit(f"up.{index}.up", _Layer([("resample", block.upsamplers[0])], "h", "h", size_name=next_skip)))
    return units

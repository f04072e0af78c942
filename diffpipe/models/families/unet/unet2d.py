"""Adapter for diffusers' `UNet2DConditionModel` (SD 1.x/2.x style, and SDXL style with text_time conditioning).

Units: time embedding, conv_in, each down block, the mid block, each up block, output (or, at "layers"
granularity, each layer of the standard blocks: see layers.py). Skip tensors are
named `skip.0 .. skip.N`: conv_in writes skip.0, each down block writes one skip per resnet (and one for its
downsampler); the main hidden state entering a down block is the last skip written before it, exactly as
in `UNet2DConditionModel.forward`. Up blocks read the skips they concatenate, last first.
"""
from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel
from torch import nn

from ...family import ModelFamily, TextBatch
from ...single_file import SGM, kohya_lora_names
from .presets import UNET_PRESETS
from .layers import LAYERED_BLOCKS, down_layers, mid_layers, up_layers
from ...units import Backbone, Unit

__all__ = ["unet_backbone", "UNET_CONDITIONS", "check_unet_supported", "UNet2DFamily"]

UNET_CONDITIONS = ("timestep", "encoder_hidden_states", "text_embeds", "time_ids")


def check_unet_supported(unet: UNet2DConditionModel) -> None:
    """Refuse configs whose extra inputs the adapter does not pipe yet, naming the key."""
    cfg = unet.config
    unsupported = {
        "class_embed_type": cfg.class_embed_type, "num_class_embeds": cfg.num_class_embeds,
        "encoder_hid_dim_type": cfg.encoder_hid_dim_type, "time_cond_proj_dim": cfg.time_cond_proj_dim,
    }
    for key, value in unsupported.items():
        if value is not None:
            raise ValueError(f"UNet config {key}={value!r} is not supported by the unet2d adapter yet; remove it")
    if cfg.addition_embed_type not in (None, "text_time"):
        raise ValueError(f"UNet config addition_embed_type={cfg.addition_embed_type!r} is not supported; "
                         "use None (SD style) or 'text_time' (SDXL style)")
    if cfg.center_input_sample:
        raise ValueError("UNet config center_input_sample=True is not supported; scale inputs in the data instead")
    if any(getattr(block, "s1", None) for block in unet.up_blocks):
        raise ValueError("FreeU is enabled on this UNet; call unet.disable_freeu() before training")


class _TimeEmbedding(nn.Module):
    def __init__(self, unet: UNet2DConditionModel):
        super().__init__()
        self.time_proj = unet.time_proj
        self.time_embedding = unet.time_embedding
        self.add_time_proj = getattr(unet, "add_time_proj", None)
        self.add_embedding = getattr(unet, "add_embedding", None)
        self.time_embed_act = unet.time_embed_act
        self.text_time = unet.config.addition_embed_type == "text_time"

    def forward(self, timestep, encoder_hidden_states, text_embeds=None, time_ids=None):
        t_emb = self.time_proj(timestep).to(dtype=encoder_hidden_states.dtype)
        emb = self.time_embedding(t_emb, None)
        if self.text_time:
            time_embeds = self.add_time_proj(time_ids.flatten()).reshape(text_embeds.shape[0], -1)
            add_embeds = torch.concat([text_embeds, time_embeds], dim=-1).to(emb.dtype)
            emb = emb + self.add_embedding(add_embeds)
        if self.time_embed_act is not None:
            emb = self.time_embed_act(emb)
        return {"temb": emb}


class _ConvIn(nn.Module):
    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, sample):
        return {"skip.0": self.conv(sample)}


class _Down(nn.Module):
    def __init__(self, block: nn.Module, h_name: str, skip_names: list[str]):
        super().__init__()
        self.block, self.h_name, self.skip_names = block, h_name, skip_names

    def forward(self, temb, encoder_hidden_states, **named):
        h = named[self.h_name]
        if getattr(self.block, "has_cross_attention", False):
            _, skips = self.block(hidden_states=h, temb=temb, encoder_hidden_states=encoder_hidden_states)
        else:
            _, skips = self.block(hidden_states=h, temb=temb)
        return dict(zip(self.skip_names, skips, strict=True))


class _Mid(nn.Module):
    def __init__(self, block: nn.Module, h_name: str):
        super().__init__()
        self.block, self.h_name = block, h_name

    def forward(self, temb, encoder_hidden_states, **named):
        h = named[self.h_name]
        if getattr(self.block, "has_cross_attention", False):
            return {"h": self.block(h, temb, encoder_hidden_states=encoder_hidden_states)}
        return {"h": self.block(h, temb)}


class _Up(nn.Module):
    def __init__(self, block: nn.Module, h_name: str, skip_names: list[str], next_skip: str | None):
        super().__init__()
        self.block, self.h_name, self.skip_names, self.next_skip = block, h_name, skip_names, next_skip

    def forward(self, temb, encoder_hidden_states, **named):
        skips = tuple(named[n] for n in self.skip_names)
        kwargs = dict(hidden_states=named[self.h_name], temb=temb, res_hidden_states_tuple=skips)
        if self.next_skip is not None and self.block.upsamplers is not None:  # odd sizes: as diffusers' forward
            kwargs["upsample_size"] = named[self.next_skip].shape[2:]
        if getattr(self.block, "has_cross_attention", False):
            kwargs["encoder_hidden_states"] = encoder_hidden_states
        return {"h": self.block(**kwargs)}


class _Out(nn.Module):
    def __init__(self, unet: UNet2DConditionModel):
        super().__init__()
        self.norm, self.act, self.conv = unet.conv_norm_out, unet.conv_act, unet.conv_out

    def forward(self, h):
        if self.norm is not None:
            h = self.act(self.norm(h))
        return {"prediction": self.conv(h)}


def _layered(block: nn.Module, granularity: str) -> bool:
    return granularity == "layers" and type(block).__name__ in LAYERED_BLOCKS


def unet_backbone(unet: UNet2DConditionModel, granularity: str = "layers") -> Backbone:
    """Describe `unet` as units sharing its modules (and weights).

    granularity: "blocks" (one unit per down/mid/up block) or "layers" (one per resnet + transformer,
    downsampler and upsampler, for the standard block types; other blocks stay whole).
    """
    check_unet_supported(unet)
    conditions = ("timestep", "encoder_hidden_states")
    if unet.config.addition_embed_type == "text_time":
        conditions += ("text_embeds", "time_ids")
    units = [Unit("time_embedding", _TimeEmbedding(unet), conditions, ("temb",)),
             Unit("conv_in", _ConvIn(unet.conv_in), ("sample",), ("skip.0",))]
    cross = ("temb", "encoder_hidden_states")
    skips = ["skip.0"]
    for i, block in enumerate(unet.down_blocks):
        count = len(block.resnets) + (1 if block.downsamplers is not None else 0)
        new = [f"skip.{len(skips) + k}" for k in range(count)]
        if _layered(block, granularity):
            units += down_layers(i, block, skips[-1], new)
        else:
            units.append(Unit(f"down.{i}", _Down(block, skips[-1], new), cross + (skips[-1],), tuple(new)))
        skips += new
    h_name = skips[-1]
    if unet.mid_block is not None:
        if _layered(unet.mid_block, granularity):
            units += mid_layers(unet.mid_block, h_name)
        else:
            units.append(Unit("mid", _Mid(unet.mid_block, h_name), cross + (h_name,), ("h",)))
        h_name = "h"
    for i, block in enumerate(unet.up_blocks):
        taken, skips = skips[-len(block.resnets):], skips[:-len(block.resnets)]
        next_skip = skips[-1] if skips else None
        if _layered(block, granularity):
            units += up_layers(i, block, h_name, taken, next_skip)
        else:
            sized = (next_skip,) if next_skip is not None and block.upsamplers is not None else ()
            reads = cross + tuple(dict.fromkeys((h_name,) + tuple(taken) + sized))
            units.append(Unit(f"up.{i}", _Up(block, h_name, taken, next_skip), reads, ("h",)))
        h_name = "h"
    units.append(Unit("out", _Out(unet), ("h",), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=unet)


def _pooled_width(cfg) -> int:
    """Width of SDXL-style pooled text embeddings: the added embedding's input less the six time ids; 0 if unused."""
    if cfg.addition_embed_type != "text_time":
        return 0
    return cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim


class UNet2DFamily(ModelFamily):
    """SD 1.x/2.x (one CLIP, cross-attention to its hidden states) and SDXL (two CLIPs, pooled text and size ids
    through the added time embedding). The objective of a pipeline folder comes from its scheduler."""

    name = "unet2d"
    model_class = UNet2DConditionModel
    component = "unet"
    backbone_name = "UNet"
    presets = UNET_PRESETS
    release_layout = SGM  # its own releases' single-file layout

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        sdxl = cfg.get("addition_embed_type") == "text_time"
        return diffusers.StableDiffusionXLPipeline if sdxl else diffusers.StableDiffusionPipeline

    def comfyui_lora_names(self, cfg, modules):
        """kohya's names (ComfyUI reads kohya's UNet LoRAs: `lora_unet_` and the original or diffusers path)."""
        return kohya_lora_names(modules, dict(cfg))

    def check_supported(self, model):
        check_unet_supported(model)

    def describe(self, model, granularity):
        return unet_backbone(model, granularity)

    def latent_channels(self, cfg):
        return cfg.in_channels

    def default_latent_size(self, cfg):
        return cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]

    def text_widths(self, cfg):
        return cfg.cross_attention_dim, _pooled_width(cfg)

    def conditions(self, cfg, text: TextBatch):
        named = {"encoder_hidden_states": text.hidden}
        if cfg.addition_embed_type == "text_time":  # SDXL: pooled text and (original size, crop, target size)
            named["text_embeds"] = text.pooled
            named["time_ids"] = text.size_ids
        return named

    def diffusers_forward(self, model, sample, conditions):
        added = {k: conditions[k] for k in ("text_embeds", "time_ids") if k in conditions} or None
        return model(sample, conditions["timestep"], encoder_hidden_states=conditions["encoder_hidden_states"],
                     added_cond_kwargs=added).sample

    def folder_text_encoder(self, folder):
        from .text import PipelineText

        return PipelineText.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        configs = text_encoder_configs(folder)
        pooled = configs[-1]["projection_dim"] if len(configs) > 1 else 0  # SDXL: the second's projection
        return sum(c["hidden_size"] for c in configs), pooled

    def objective_of_folder(self, folder):
        from ...folder import scheduler_objective

        return scheduler_objective(folder)

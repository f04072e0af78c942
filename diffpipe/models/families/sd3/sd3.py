"""Adapter for diffusers' `SD3Transformer2DModel` (Stable Diffusion 3 and 3.5).

Units: `embed` (patch embedding with its positional table, the time and pooled-text embedding, the context
projection), each joint block `joint.i`, and `out` (the adaptive output norm and projection). Named tensors: `h`
(image tokens), `context` (text tokens; the last joint block updates only `h`), `temb`.

The backbone reads latents (B, C, H, W) and predicts in its token layout, unpatchified outside the pipeline
(`pack_prediction` / `unpack_prediction`), so no stage after the first needs the image's height and width.
Timesteps reach the model as diffusers' SD3 pipelines give them, t x 1000.
"""
from __future__ import annotations

import re

import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.embeddings import PatchEmbed
from torch import nn

from ...family import ModelFamily, TextBatch
from .release_layout import SAI
from ...units import Backbone, Unit

__all__ = ["SD3Family", "sd3_backbone", "SD3_PRESETS"]

SD3_PRESETS = {
    "medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,  # SD3 medium
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192),
    "large35": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,  # SD3.5 large
                    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"),
    "digits": dict(sample_size=8, patch_size=2, in_channels=1, num_layers=6, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                   pooled_projection_dim=32, out_channels=1, pos_embed_max_size=8),
}


class _Embed(nn.Module):
    def __init__(self, model: SD3Transformer2DModel):
        super().__init__()
        self.pos_embed, self.time_text_embed, self.context_embedder = (model.pos_embed, model.time_text_embed,
                                                                       model.context_embedder)

    def forward(self, sample, timestep, pooled_projections, encoder_hidden_states):
        return {"h": self.pos_embed(sample).contiguous(), "temb": self.time_text_embed(timestep, pooled_projections),
                "context": self.context_embedder(encoder_hidden_states)}


class _Joint(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.last = block.context_pre_only  # the last block updates only the image tokens

    def forward(self, h, context, temb):
        context, h = self.block(hidden_states=h, encoder_hidden_states=context, temb=temb)
        return {"h": h} if self.last else {"h": h, "context": context}


class _Out(nn.Module):
    def __init__(self, model: SD3Transformer2DModel):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, h, temb):
        return {"prediction": self.proj_out(self.norm_out(h, temb))}


def sd3_backbone(model: SD3Transformer2DModel) -> Backbone:
    conditions = ("timestep", "pooled_projections", "encoder_hidden_states")
    units = [Unit("embed", _Embed(model), ("sample",) + conditions, ("h", "temb", "context"))]
    for i, block in enumerate(model.transformer_blocks):
        writes = ("h",) if block.context_pre_only else ("h", "context")
        units.append(Unit(f"joint.{i}", _Joint(block), ("h", "context", "temb"), writes))
    units.append(Unit("out", _Out(model), ("h", "temb"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


# the layers comfy/utils.py `mmdit_to_diffusers` names (its MMDIT_MAP_BLOCK, MMDIT_MAP_BASIC and the fused qkv rows)
_COMFYUI_SD3 = re.compile(
    r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|norm1(_context)?\.linear"
    r"|ff(_context)?\.net\.(0\.proj|2))"
    r"|context_embedder|time_text_embed\.(timestep|text)_embedder\.linear_[12]|pos_embed\.proj|norm_out\.linear|proj_out")


class SD3Family(ModelFamily):
    """SD3 / SD3.5: two CLIPs' penultimate states and T5's along one sequence, both CLIPs' pooled projections;
    flow matching."""

    name = "sd3"
    model_class = SD3Transformer2DModel
    component = "transformer"
    presets = SD3_PRESETS
    release_layout = SAI  # its own releases' single-file layout

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.StableDiffusion3Pipeline

    def comfyui_lora_names(self, cfg, modules):
        """diffusers' names under `transformer.`, for the layers ComfyUI maps onto SAI's layout (comfy/utils.py
        `mmdit_to_diffusers`); SD3.5's second attention (`attn2`) and the query/key norms are not among them."""
        unmapped = [m for m in modules if not _COMFYUI_SD3.fullmatch(m)]
        if unmapped:
            raise ValueError(f"ComfyUI's SD3 LoRA loader maps no layer named {unmapped[0]!r} (of {len(unmapped)}): "
                             "train adapter.target_modules among to_q/to_k/to_v/to_out.0, add_q_proj/add_k_proj/"
                             "add_v_proj/to_add_out, ff, ff_context, norm1, norm1_context, the embedders")
        return {m: f"transformer.{m}" for m in modules}

    def describe(self, model, granularity):
        return sd3_backbone(model)

    def latent_channels(self, cfg):
        return cfg.in_channels

    def default_latent_size(self, cfg):
        return cfg.sample_size

    def latent_multiple(self, cfg):
        return cfg.patch_size

    def text_widths(self, cfg):
        return cfg.joint_attention_dim, cfg.pooled_projection_dim

    def conditions(self, cfg, text: TextBatch):
        return {"pooled_projections": text.pooled, "encoder_hidden_states": text.hidden}

    def pack_prediction(self, cfg, latents):
        """(B, C, H, W) -> (B, H/p * W/p, p * p * C): the token layout of the model's output, before diffusers'
        forward unpatchifies it ("nhwpqc")."""
        b, c, h, w = latents.shape
        p = cfg.patch_size
        tokens = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return tokens.reshape(b, (h // p) * (w // p), p * p * c)

    def unpack_prediction(self, cfg, prediction, latent_size):
        """As the end of SD3Transformer2DModel.forward."""
        p, (h, w) = cfg.patch_size, latent_size
        out = prediction.reshape(prediction.shape[0], h // p, w // p, p, p, cfg.out_channels)
        out = torch.einsum("nhwpqc->nchpwq", out)
        return out.reshape(prediction.shape[0], cfg.out_channels, h, w)

    def diffusers_forward(self, model, sample, conditions):
        out = model(hidden_states=sample, timestep=conditions["timestep"],
                    pooled_projections=conditions["pooled_projections"],
                    encoder_hidden_states=conditions["encoder_hidden_states"], return_dict=False)[0]
        return self.pack_prediction(model.config, out)  # diffusers unpatchified it; back to the tokens (a reshape)

    def constructor_buffers(self, model):
        """The positional table PatchEmbed's constructor computes (a sine-cosine grid), built again on the CPU."""
        cfg = model.config
        with torch.device("cpu"):
            table = PatchEmbed(height=cfg.sample_size, width=cfg.sample_size, patch_size=cfg.patch_size,
                               in_channels=cfg.in_channels, embed_dim=cfg.num_attention_heads * cfg.attention_head_dim,
                               pos_embed_max_size=cfg.pos_embed_max_size).pos_embed
        return {"pos_embed.pos_embed": table}

    def folder_text_encoder(self, folder):
        from .text import SD3Text

        return SD3Text.from_folder(folder)

    def folder_text_widths(self, folder):
        from .text import sd3_text_widths

        return sd3_text_widths(folder)

    def folder_text_length(self, folder):
        from .text import SD3Text

        return SD3Text.max_length

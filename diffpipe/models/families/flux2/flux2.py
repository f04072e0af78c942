"""Adapter for diffusers' `Flux2Transformer2DModel` (FLUX.2 dev and klein): issue 57's second family.

Units: `embed` (image and text tokens embedded, the time and guidance embedding `temb`, the three modulations every
block of a kind shares: `mod_img` and `mod_txt` for the double-stream blocks, `mod_single` for the single-stream
ones, computed once as diffusers' forward computes them, and `rope`, the rotary table of the text's then the image's
positions, cosines and sines stacked), each double-stream block `double.i`, each single-stream block `single.i`
(which joins the text and image tokens, attends, and splits them again: the streams stay `h` and `context` between
units, as the Flux.1 adapter keeps them), and `out` (the adaptive output norm and projection).

The backbone reads latents as Flux2Pipeline gives its transformer: the VAE's 32 channels patchified 2x2 into 128
(each patch normalised by the VAE's batch norm statistics: models/vae.py) and flattened into tokens, which is
Flux.1's packing (`pack_latents`); position ids of four axes (time, row, column, layer), one row per sample (the
same for all samples of a bucket). Timesteps are t in [0, 1000] as diffpipe samples them; the model takes t / 1000
(and multiplies by 1000 itself). Klein's text: Qwen3's states of three layers side by side, 512 positions with the
pads (text.py); the transformer attends to all of them, unmasked, as Flux2KleinPipeline calls it. Dev's text:
Mistral 3's states of three layers after FLUX.2's system message (text.py), and the guidance embedding dev has.
"""
from __future__ import annotations

import torch
from diffusers import Flux2Transformer2DModel
from torch import nn

from ...family import TextBatch
from ...tokens import reset_rms_norm
from ...packed import PackedFamily
from ...units import Backbone, Unit
from .release_layout import FLUX2_BFL, comfyui_names

__all__ = ["Flux2Family", "flux2_backbone", "FLUX2_PRESETS", "image_ids", "text_ids"]

FLUX2_PRESETS = {
    # FLUX.2 dev (32 B): diffusers' defaults for the class, which are the dev release's config
    "dev": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True),
    # FLUX.2 klein 4 B and 9 B (timestep-distilled, no guidance embedding), as diffusers' conversion script and the
    # released transformer configs give them; their text: Qwen3-4B's (3 x 2560) and Qwen3-8B's (3 x 4096) states
    "klein-4b": dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                     axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False),
    "klein-9b": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=24, attention_head_dim=128,
                     num_attention_heads=32, joint_attention_dim=12288, timestep_guidance_channels=256, mlp_ratio=3.0,
                     axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False),
    # 1-channel 8x8 latents (scikit-learn's digits), patchified 2x2 into 16 tokens of 4 channels
    "digits": dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32, mlp_ratio=3.0,
                   axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=False),
}


def image_ids(tokens_size: tuple[int, int], device=None) -> torch.Tensor:
    """(H * W, 4) position ids of a picture's tokens (after the 2x2 patchify): (time 0, row, column, layer 0), as
    Flux2Pipeline._prepare_latent_ids."""
    h, w = tokens_size
    ids = torch.zeros(h, w, 4, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 4)


def text_ids(length: int, device=None) -> torch.Tensor:
    """(length, 4) position ids of a caption's tokens: (0, 0, 0, position), as Flux2Pipeline._prepare_text_ids."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


class Flux2Embed(nn.Module):
    def __init__(self, model: Flux2Transformer2DModel):
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_guidance_embed, self.pos_embed = model.time_guidance_embed, model.pos_embed
        self.modulation_img = model.double_stream_modulation_img
        self.modulation_txt = model.double_stream_modulation_txt
        self.modulation_single = model.single_stream_modulation
        self.guided = model.config.guidance_embeds

    def forward(self, sample, timestep, encoder_hidden_states, img_ids, txt_ids, guidance=None):
        h = self.x_embedder(sample)
        timestep = (timestep / 1000).to(sample.dtype) * 1000  # what Flux2Pipeline gives (t / 1000), scaled as the model
        guidance = guidance.to(sample.dtype) * 1000 if self.guided else None
        temb = self.time_guidance_embed(timestep, guidance)
        text_cos, text_sin = self.pos_embed(txt_ids[0])
        image_cos, image_sin = self.pos_embed(img_ids[0])
        rope = torch.stack((torch.cat((text_cos, image_cos)), torch.cat((text_sin, image_sin))))
        return {"h": h, "context": self.context_embedder(encoder_hidden_states), "temb": temb,
                "mod_img": self.modulation_img(temb), "mod_txt": self.modulation_txt(temb),
                "mod_single": self.modulation_single(temb), "rope": rope}


class _Double(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, context, mod_img, mod_txt, rope):
        context, h = self.block(hidden_states=h, encoder_hidden_states=context, temb_mod_img=mod_img,
                                temb_mod_txt=mod_txt, image_rotary_emb=(rope[0], rope[1]))
        return {"h": h, "context": context}


class _Single(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, context, mod_single, rope):
        context, h = self.block(hidden_states=h, encoder_hidden_states=context, temb_mod=mod_single,
                                image_rotary_emb=(rope[0], rope[1]), split_hidden_states=True)
        return {"h": h, "context": context}


class Flux2Out(nn.Module):
    def __init__(self, model: Flux2Transformer2DModel):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, h, temb):
        return {"prediction": self.proj_out(self.norm_out(h, temb))}


def flux2_backbone(model: Flux2Transformer2DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states", "img_ids", "txt_ids")
    if model.config.guidance_embeds:
        conditions += ("guidance",)
    streams = ("h", "context", "temb", "mod_img", "mod_txt", "mod_single", "rope")
    units = [Unit("embed", Flux2Embed(model), ("sample",) + conditions, streams)]
    units += [Unit(f"double.{i}", _Double(b), ("h", "context", "mod_img", "mod_txt", "rope"), ("h", "context"))
              for i, b in enumerate(model.transformer_blocks)]
    units += [Unit(f"single.{i}", _Single(b), ("h", "context", "mod_single", "rope"), ("h", "context"))
              for i, b in enumerate(model.single_transformer_blocks)]
    units.append(Unit("out", Flux2Out(model), ("h", "temb"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class Flux2Family(PackedFamily):
    """FLUX.2: an LLM's states of three layers side by side (klein: Qwen3; dev: Mistral 3 after FLUX.2's system
    message), no pooled text; its own VAE (32 channels, 8x smaller sides, patches normalised); flow matching."""

    name = "flux2"
    model_class = Flux2Transformer2DModel
    component = "transformer"
    presets = FLUX2_PRESETS
    pipelines = ("Flux2KleinPipeline", "Flux2Pipeline")
    # the double blocks' attention and the single blocks' fused input (q, k, v and the MLP's in): every block adapted,
    # as a stage of single blocks alone has something to train. Not the single blocks' fused output `attn.to_out`:
    # peft matches `to_out` on the double blocks' (a ModuleList) too and refuses it
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj")
    sequence_refusal = "pipeline.sequence_parallel is not built for FLUX.2 yet: set pipeline.sequence_parallel = 1"
    release_layout = FLUX2_BFL  # BFL's single files (flux2-dev.safetensors): release_layout.py

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.Flux2Pipeline if cfg["guidance_embeds"] else diffusers.Flux2KleinPipeline

    def comfyui_lora_names(self, cfg, modules):
        """`diffusion_model.` and BFL's names (release_layout.py): ComfyUI's FLUX.2 is BFL's model."""
        return comfyui_names(cfg, modules)

    def describe(self, model, granularity):
        return flux2_backbone(model)

    def text_widths(self, cfg):
        return cfg.joint_attention_dim, 0

    def conditions(self, cfg, text: TextBatch):
        batch, device = text.hidden.shape[0], text.hidden.device
        tokens_size = (text.latent_size[0] // 2, text.latent_size[1] // 2)
        named = {"encoder_hidden_states": text.hidden,
                 "img_ids": image_ids(tokens_size, device).expand(batch, -1, -1),
                 "txt_ids": text_ids(text.hidden.shape[1], device).expand(batch, -1, -1)}
        if cfg.guidance_embeds:
            named["guidance"] = torch.full((batch,), text.guidance, device=device)
        return named

    def diffusers_forward(self, model, sample, conditions):
        return model(hidden_states=sample, timestep=conditions["timestep"] / 1000, guidance=conditions.get("guidance"),
                     encoder_hidden_states=conditions["encoder_hidden_states"], img_ids=conditions["img_ids"][0],
                     txt_ids=conditions["txt_ids"][0], return_dict=False)[0]

    def reset_own_parameters(self, module):
        return reset_rms_norm(module)

    def folder_text_encoder(self, folder):
        from .text import Flux2DevText, Flux2KleinText

        return (Flux2DevText if _is_dev(folder) else Flux2KleinText).from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        config = text_encoder_configs(folder)[0]
        return 3 * (config["text_config"] if _is_dev(folder) else config)["hidden_size"], 0

    def folder_text_length(self, folder):
        from .text import FLUX2_TEXT_TOKENS

        return FLUX2_TEXT_TOKENS


def _is_dev(folder) -> bool:
    """FLUX.2 dev's folders (Flux2Pipeline) caption through Mistral 3, klein's (Flux2KleinPipeline) through Qwen3."""
    from ...folder import pipeline_index

    return pipeline_index(folder).get("_class_name") == "Flux2Pipeline"

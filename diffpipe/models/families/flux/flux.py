"""Adapter for diffusers' `FluxTransformer2DModel` (Flux.1 dev and schnell).

Units: `embed` (image, text, time, guidance and pooled-text embeddings, and the rotary embedding of every image and
text position), each double-stream block `double.i`, each single-stream block `single.i`, and `out` (the adaptive
output norm and projection). Named tensors: `h` (image tokens), `context` (text tokens), `temb`, and `rope`, the
rotary embedding's cosines and sines stacked (2, positions, head dim): computed once by `embed` and sent on, as
diffusers' forward computes it once (recomputing it in every block would cost 57 small kernels a micro-batch;
sending it costs 2 x positions x head dim floats a boundary; figures in docs/benchmarks.md).

The backbone reads latents packed 2x2 into tokens, as FluxPipeline packs them (`pack`), and predicts in that layout;
the image and text position ids go to every stage as conditions, one row per sample (the same for all samples of a
bucket), since the pipeline splits conditions along the batch. Timesteps reach the model as diffusers' Flux
pipelines give them, t in [0, 1] (the model multiplies by 1000); flow matching with SD3's shifted density is
`train.timestep_sampling = "shift"`.
"""
from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel
from torch import nn

from ...family import TextBatch
from ...packed import PackedFamily
from .release_layout import BFL
from ...units import Backbone, Unit

__all__ = ["ContiguousGradient", "FluxFamily", "flux_backbone", "FLUX_PRESETS", "image_ids",
           "hand_back_contiguous_gradient"]

_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
FLUX_PRESETS = {
    "dev": _DEV,  # 11.9 B parameters
    "schnell": dict(_DEV, guidance_embeds=False),
    # 1-channel 8x8 latents (scikit-learn's digits), packed 2x2 into 16 tokens of 4 channels
    "digits": dict(patch_size=1, in_channels=4, num_layers=3, num_single_layers=3, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
                   axes_dims_rope=(4, 6, 6)),
}


def image_ids(latent_size: tuple[int, int], device=None) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of the packed tokens: (0, row, column), as FluxPipeline._prepare_latent_image_ids."""
    h, w = latent_size[0] // 2, latent_size[1] // 2
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 3)


class FluxEmbed(nn.Module):
    def __init__(self, model: FluxTransformer2DModel):
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.pos_embed = model.time_text_embed, model.pos_embed
        self.guided = model.config.guidance_embeds

    def forward(self, sample, timestep, pooled_projections, encoder_hidden_states, img_ids, txt_ids, guidance=None):
        h = self.x_embedder(sample)
        timestep = (timestep / 1000).to(h.dtype) * 1000  # what FluxPipeline gives (t / 1000), scaled as the model does
        if self.guided:
            temb = self.time_text_embed(timestep, guidance.to(h.dtype) * 1000, pooled_projections)
        else:
            temb = self.time_text_embed(timestep, pooled_projections)
        cos, sin = self.pos_embed(torch.cat((txt_ids[0], img_ids[0]), dim=0))
        return {"h": h, "context": self.context_embedder(encoder_hidden_states), "temb": temb,
                "rope": torch.stack((cos, sin))}


class ContiguousGradient(torch.autograd.Function):
    """The identity forward; the gradient made contiguous on its way back."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_gradient(module, inputs, output):
    return ContiguousGradient.apply(output)


def hand_back_contiguous_gradient(single_block: nn.Module) -> None:
    """Make the gradient reaching a single-stream block's attention output contiguous (see `_Block`): a forward
    hook on its `attn`, registered once a block (a model described twice keeps one)."""
    if not getattr(single_block.attn, "_diffpipe_contiguous_gradient", False):
        single_block.attn.register_forward_hook(_contiguous_gradient)
        single_block.attn._diffpipe_contiguous_gradient = True


class _Block(nn.Module):
    """A double- or single-stream block: both take and return (text tokens, image tokens) in diffusers 0.42.

    A single block joins its attention's output with its MLP's along the channels, so the gradient reaching the
    attention is a strided slice, where a double block's comes back contiguous: cuDNN's attention kernels reuse a
    graph across the two and fail in the backward (bench/flux_cudnn_probe.py: each kind alone trains, one of each
    fails; docs/benchmarks.md). The single block's attention hands back a contiguous gradient instead (a forward hook
    on its `attn`), which makes every backward of the model alike; a copy of one (tokens x width) tensor a block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        if hasattr(block, "proj_mlp"):  # a single-stream block
            hand_back_contiguous_gradient(block)

    def forward(self, h, context, temb, rope):
        context, h = self.block(hidden_states=h, encoder_hidden_states=context, temb=temb,
                                image_rotary_emb=(rope[0], rope[1]))
        return {"h": h, "context": context}


class FluxOut(nn.Module):
    def __init__(self, model: FluxTransformer2DModel):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, h, temb):
        return {"prediction": self.proj_out(self.norm_out(h, temb))}


def flux_backbone(model: FluxTransformer2DModel) -> Backbone:
    conditions = ("timestep", "pooled_projections", "encoder_hidden_states", "img_ids", "txt_ids")
    if model.config.guidance_embeds:
        conditions += ("guidance",)
    streams = ("h", "context", "temb", "rope")
    units = [Unit("embed", FluxEmbed(model), ("sample",) + conditions, streams)]
    units += [Unit(f"double.{i}", _Block(b), streams, ("h", "context")) for i, b in enumerate(model.transformer_blocks)]
    units += [Unit(f"single.{i}", _Block(b), streams, ("h", "context"))
              for i, b in enumerate(model.single_transformer_blocks)]
    units.append(Unit("out", FluxOut(model), ("h", "temb"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class FluxFamily(PackedFamily):
    """Flux.1: a CLIP text model's pooled output and T5's hidden states; flow matching."""

    name = "flux"
    model_class = FluxTransformer2DModel
    component = "transformer"
    presets = FLUX_PRESETS
    release_layout = BFL  # its own releases' single-file layout
    pipelines = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")
    # cuDNN's attention backward failed inside Flux ("mha_graph.execute(...).is_good()", H100 and H200, torch 2.11)
    # until the single blocks' attention handed back a contiguous gradient (`_Block`); with it Flux.1-dev trains on
    # cuDNN's kernels, eager and compiled, and its LoRA step is 1.27x faster compiled than on flash attention (an
    # H100, docs/benchmarks.md): `cudnn_attention` stays the default, True
    # the image tokens, the text tokens (every attention joins them) and the rotary table of both (the text's
    # positions, then the image's) split over a sample's processes: each attends with [its text share, its image
    # share], and Ulysses gathers every share's keys
    sequence_streams = {"h": 1, "context": 1, "rope": (1, ("context", "h"))}
    sequence_pads = True

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.FluxPipeline

    def comfyui_lora_names(self, cfg, modules):
        """diffusers' names under `transformer.`: ComfyUI maps every linear layer of diffusers' Flux onto its fused
        layout (comfy/utils.py `flux_to_diffusers`: to_q/to_k/to_v as rows of `qkv`, `proj_mlp` of `linear1`)."""
        return {m: f"transformer.{m}" for m in modules}

    def describe(self, model, granularity):
        return flux_backbone(model)

    def text_widths(self, cfg):
        return cfg.joint_attention_dim, cfg.pooled_projection_dim

    def conditions(self, cfg, text: TextBatch):
        batch, device = text.hidden.shape[0], text.hidden.device
        named = {"pooled_projections": text.pooled, "encoder_hidden_states": text.hidden,
                 "img_ids": image_ids(text.latent_size, device).expand(batch, -1, -1),
                 "txt_ids": torch.zeros(batch, text.hidden.shape[1], 3, device=device)}
        if cfg.guidance_embeds:
            named["guidance"] = torch.full((batch,), text.guidance, device=device)
        return named

    def diffusers_forward(self, model, sample, conditions):
        return model(hidden_states=sample, timestep=conditions["timestep"] / 1000,
                     guidance=conditions.get("guidance"), pooled_projections=conditions["pooled_projections"],
                     encoder_hidden_states=conditions["encoder_hidden_states"], img_ids=conditions["img_ids"][0],
                     txt_ids=conditions["txt_ids"][0], return_dict=False)[0]

    def folder_text_encoder(self, folder):
        from .text import FluxText

        return FluxText.from_folder(folder)

    def folder_text_widths(self, folder):
        from .text import flux_text_widths

        return flux_text_widths(folder)

    def folder_text_length(self, folder):
        from .text import FluxText

        return FluxText.max_length

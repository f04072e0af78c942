"""Adapter for diffusers' `ChromaTransformer2DModel` (Chroma1-HD, Chroma1-Base and the Chroma "unlocked" releases:
Flux.1-schnell's layout, 8.9 B parameters, with its modulation layers pruned and replaced by one small network, the
`distilled_guidance_layer`, that makes every block's shifts, scales and gates from the timestep alone).

Units: `embed` (image and text projections, the timestep's modulation vectors for every block, made once by the
distilled guidance layer, and the rotary embedding of every position), each double-stream block `double.i`, each
single-stream block `single.i`, and `out`. Named tensors: `h` (image tokens; from `single.0` on, the text's and the
image's tokens joined, as Chroma's forward joins them once before its single blocks), `context` (text tokens, until
`single.0`), `temb` (the modulation vectors: (B, 3 x singles + 12 x doubles + 2, width); each block reads its own rows
of it, as the model's forward slices them), and `rope` (as Flux's). The attention mask is a condition every stage gets.

Text: T5's states of the caption (ChromaPipeline reads T5 with its attention mask, and masks in the transformer all of
T5's padding but its first position). A batch's text is cut to the smallest of `TEXT_LENGTHS` (models/tokens.py) that
holds its longest caption (and that first pad); attention is masked where a caption is shorter. The text's position
ids are all zero, so a cut moves no position: attention over the cut text is the pipeline's over its 512 positions
with the padding masked (a test checks it). The mask is boolean, as the model was trained with it: the ChromaPipeline
of diffusers 0.42 hands the transformer a floating-point mask of ones and zeros, which attention adds to its scores
instead of masking (huggingface/diffusers#12116); its own forward given a boolean mask computes what this adapter does.

Latents are packed 2x2 as Flux's (the pipeline's `_pack_latents`); timesteps reach the model as the pipeline gives
them, t in [0, 1], scaled by 1000 inside.
"""
from __future__ import annotations

import torch
from diffusers import ChromaTransformer2DModel
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn

from ...family import TextBatch
from .flux import FluxFamily, hand_back_contiguous_gradient, image_ids
from .release_layout import CHROMA
from ...tokens import mask_or_none, text_mask
from ...units import Backbone, Unit

__all__ = ["ChromaFamily", "chroma_backbone", "CHROMA_PRESETS", "modulation_rows"]

_HD = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
           num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
           approximator_hidden_dim=5120, approximator_layers=5)
CHROMA_PRESETS = {
    "hd": _HD,  # lodestones/Chroma1-HD's transformer/config.json: 8.9 B parameters
    # 1-channel 8x8 latents (scikit-learn's digits), packed 2x2 into 16 tokens of 4 channels
    "digits": dict(patch_size=1, in_channels=4, num_layers=3, num_single_layers=3, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
                   approximator_hidden_dim=32, approximator_layers=2),
}


def modulation_rows(cfg) -> int:
    """Rows of the modulation the distilled guidance layer makes: 3 per single block, 6 + 6 per double block (image
    and text), and 2 for the output norm (ChromaTransformer2DModel's `time_text_embed` out_dim)."""
    return 3 * cfg.num_single_layers + 12 * cfg.num_layers + 2


class _Embed(nn.Module):
    def __init__(self, model: ChromaTransformer2DModel):
        super().__init__()
        self.x_embedder, self.context_embedder = model.x_embedder, model.context_embedder
        self.time_text_embed, self.distilled_guidance_layer = model.time_text_embed, model.distilled_guidance_layer
        self.pos_embed = model.pos_embed

    def forward(self, sample, timestep, encoder_hidden_states, img_ids, txt_ids):
        h = self.x_embedder(sample)
        timestep = (timestep / 1000).to(h.dtype) * 1000  # what ChromaPipeline gives (t / 1000), scaled as the model does
        temb = self.distilled_guidance_layer(self.time_text_embed(timestep))
        cos, sin = self.pos_embed(torch.cat((txt_ids[0], img_ids[0]), dim=0))
        return {"h": h, "context": self.context_embedder(encoder_hidden_states), "temb": temb,
                "rope": torch.stack((cos, sin))}


class _Double(nn.Module):
    """Double block i: its image rows of the modulation, then its text rows, as the model's forward joins them."""

    TWIN_FREE = ("image_rows", "text_rows")  # which rows it reads: every double block is a twin (models/units.py)

    def __init__(self, block: nn.Module, image_rows: int, text_rows: int):
        super().__init__()
        self.block, self.image_rows, self.text_rows = block, image_rows, text_rows

    def forward(self, h, context, temb, rope, attention_mask):
        rows = torch.cat((temb[:, self.image_rows:self.image_rows + 6], temb[:, self.text_rows:self.text_rows + 6]), 1)
        context, h = self.block(hidden_states=h, encoder_hidden_states=context, temb=rows,
                                image_rotary_emb=(rope[0], rope[1]), attention_mask=mask_or_none(attention_mask))
        return {"h": h, "context": context}


class _Single(nn.Module):
    """Single block i on the joined tokens; the first joins the text's before the image's. Its attention hands back
    a contiguous gradient, as Flux's single blocks' (flux.py `_Block`: cuDNN's attention fails on the strided one)."""

    TWIN_FREE = ("rows",)  # which rows of the modulation it reads

    def __init__(self, block: nn.Module, index: int):
        super().__init__()
        self.block, self.rows = block, 3 * index
        hand_back_contiguous_gradient(block)

    def run(self, h, temb, rope, attention_mask):
        h = self.block(hidden_states=h, temb=temb[:, self.rows:self.rows + 3], image_rotary_emb=(rope[0], rope[1]),
                       attention_mask=mask_or_none(attention_mask))
        return {"h": h}

    def forward(self, h, temb, rope, attention_mask):
        return self.run(h, temb, rope, attention_mask)


class _FirstSingle(_Single):
    def forward(self, h, context, temb, rope, attention_mask):
        return self.run(torch.cat((context, h), dim=1), temb, rope, attention_mask)


class _Out(nn.Module):
    """The output norm on the image's tokens (after the single blocks, the text's are cut off first)."""

    def __init__(self, model: ChromaTransformer2DModel):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out
        self.joined = len(model.single_transformer_blocks) > 0

    def forward(self, h, temb, encoder_hidden_states):
        if self.joined:
            h = h[:, encoder_hidden_states.shape[1]:]
        return {"prediction": self.proj_out(self.norm_out(h, temb[:, -2:]))}


def chroma_backbone(model: ChromaTransformer2DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states", "img_ids", "txt_ids", "attention_mask")
    singles, doubles = len(model.single_transformer_blocks), len(model.transformer_blocks)
    units = [Unit("embed", _Embed(model), ("sample",) + conditions[:4], ("h", "context", "temb", "rope"))]
    streams = ("h", "context", "temb", "rope", "attention_mask")
    units += [Unit(f"double.{i}", _Double(b, 3 * singles + 6 * i, 3 * singles + 6 * doubles + 6 * i), streams,
                   ("h", "context")) for i, b in enumerate(model.transformer_blocks)]
    for i, block in enumerate(model.single_transformer_blocks):
        unit = _FirstSingle(block, i) if i == 0 else _Single(block, i)
        units.append(Unit(f"single.{i}", unit, streams if i == 0 else ("h",) + streams[2:], ("h",)))
    units.append(Unit("out", _Out(model), ("h", "temb", "encoder_hidden_states"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class ChromaFamily(FluxFamily):
    """Chroma: T5's states only (no pooled text, no guidance embedding: real classifier-free guidance), Flux's VAE,
    latents and packing; flow matching."""

    sequence_streams = {}
    sequence_refusal = "its attention masks the captions' padding, which the token shares do not carry yet"

    name = "chroma"
    model_class = ChromaTransformer2DModel
    presets = CHROMA_PRESETS
    pipelines = ("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline")
    release_layout = CHROMA  # its releases' single files: BFL's names, the modulation pruned (release_layout.py)
    reads_text_lengths = True  # a batch's text is cut to its captions (qwen_image.text_mask)
    # its single blocks join attention and MLP outputs as Flux's do; its units hand the attention a contiguous
    # gradient as Flux's do (`_Single`), so cuDNN's kernels serve it too (an H200, docs/benchmarks.md)

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.ChromaPipeline

    def describe(self, model, granularity):
        return chroma_backbone(model)

    def text_widths(self, cfg):
        return cfg.joint_attention_dim, 0

    def conditions(self, cfg, text: TextBatch):
        hidden, mask = text_mask(text.hidden, text.filled)
        batch, device = hidden.shape[0], hidden.device
        tokens = (text.latent_size[0] // 2) * (text.latent_size[1] // 2)
        if mask.shape[1]:  # the image's tokens are never masked (ChromaPipeline._prepare_attention_mask)
            mask = torch.cat((mask, torch.ones(batch, tokens, dtype=torch.bool, device=device)), dim=1)
        return {"encoder_hidden_states": hidden, "attention_mask": mask,
                "img_ids": image_ids(text.latent_size, device).expand(batch, -1, -1),
                "txt_ids": torch.zeros(batch, hidden.shape[1], 3, device=device)}

    def diffusers_forward(self, model, sample, conditions):
        return model(hidden_states=sample, timestep=conditions["timestep"] / 1000,
                     encoder_hidden_states=conditions["encoder_hidden_states"], img_ids=conditions["img_ids"][0],
                     txt_ids=conditions["txt_ids"][0], attention_mask=mask_or_none(conditions["attention_mask"]),
                     return_dict=False)[0]

    def constructor_buffers(self, model):
        """`time_text_embed.mod_proj`, the fixed sinusoids of each modulation row's index (not saved with weights)."""
        cfg = model.config
        rows = torch.arange(modulation_rows(cfg), dtype=torch.float32, device="cpu") * 1000
        table = get_timestep_embedding(rows, 2 * (cfg.approximator_num_channels // 4), flip_sin_to_cos=True,
                                       downscale_freq_shift=0)
        return {"time_text_embed.mod_proj": table}

    def folder_text_encoder(self, folder):
        from .text import ChromaText

        return ChromaText.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        return text_encoder_configs(folder)[0]["d_model"], 0

    def folder_text_length(self, folder):
        from .text import ChromaText

        return ChromaText.max_length

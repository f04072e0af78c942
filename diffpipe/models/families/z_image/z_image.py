"""Adapter for diffusers' `ZImageTransformer2DModel` (Z-Image Turbo and Base, text-to-image: a 6 B single-stream DiT
of 30 blocks over a Qwen3 text encoder's states; issue 57).

Units: `embed` (the time embedding, the picture's patches and the caption's projections), the picture's two noise
refiners `noise_refiner.i`, the caption's two context refiners `context_refiner.i`, the main blocks `layers.i` over
the picture's tokens and the caption's joined (`[picture; caption]`, as the model joins them), and `out` (the
adaptive final layer). Named tensors: `h` (picture tokens), `context` (caption tokens), `temb` (the time embedding);
the main blocks carry the joined tokens as `h` (their first reads `h` and `context` and joins them).

Z-Image's own conventions, followed here:
- time runs the other way: the model takes t = 1 - sigma (ZImagePipeline gives (1000 - timestep) / 1000), and
  predicts clean minus noise, the negative of flow matching's velocity (the pipeline negates it): `out` negates it,
  so the prediction is the velocity diffpipe's flow-matching loss compares;
- a caption is its encoder's real tokens only (ZImagePipeline keeps the states where the tokenizer's mask is set),
  padded with the model's `cap_pad_token` to a multiple of 32; the picture's positions start after that padded
  length (its rotary table depends on the caption's length); the picture's tokens padded alike with
  `x_pad_token`.
A pipelined step needs a fixed set of shapes, so a batch's text is cut to the smallest of `TEXT_LENGTHS` holding its
longest caption (all multiples of 32), each caption's positions past its padded length masked out of attention:
the model's own forward pads a batch to its longest joined sequence instead, which gives the same tokens where they
are not masked (tests/models/test_z_image.py).

The rotary tables (complex, per sample: they depend on each caption's length) and the masks are conditions,
computed once per batch beside the data and given to every stage: nothing of them crosses a boundary.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from diffusers import ZImageTransformer2DModel
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF, RopeEmbedder
from torch import nn

from ...family import ModelFamily, TextBatch
from ...text import filled_lengths_of
from ...tokens import mask_or_none, reset_rms_norm, text_mask
from ...units import Backbone, Unit
from .release_layout import TONGYI

__all__ = ["ZImageFamily", "z_image_backbone", "Z_IMAGE_PRESETS", "Z_IMAGE_TEXT_TOKENS", "pack_patches",
           "unpack_patches"]

Z_IMAGE_TEXT_TOKENS = 512  # ZImagePipeline.__call__'s max_sequence_length

Z_IMAGE_PRESETS = {
    # Tongyi-MAI/Z-Image-Turbo's transformer/config.json: 6.17 B parameters as diffpipe counts them
    "6b": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
               n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
               t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512]),
    # 1-channel 8x8 latents (scikit-learn's digits): 16 picture tokens of 4 channels
    "digits": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=1, dim=32, n_layers=3, n_refiner_layers=1,
                   n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0,
                   t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[1536, 64, 64]),
}


def pack_patches(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), each patch's values in the model's order (`_patchify_image` of a
    one-frame picture: rows of the patch, its columns, then channels)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_patches(tokens: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
    """The inverse of `pack_patches`."""
    (b, _, channels), (h, w) = tokens.shape, latent_size
    c = channels // 4
    return tokens.view(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)


def padded(length: int) -> int:
    """A sequence's length padded to the model's multiple (SEQ_MULTI_OF, 32)."""
    return length + (-length) % SEQ_MULTI_OF


@lru_cache(maxsize=4)
def rope_table(theta: float, axes_dims: tuple[int, ...], axes_lens: tuple[int, ...]) -> RopeEmbedder:
    """The model's rotary embedder (fixed by its config; it computes its tables on first use)."""
    return RopeEmbedder(theta=theta, axes_dims=list(axes_dims), axes_lens=list(axes_lens))


def rotary_embedding(cfg, grid: tuple[int, int], caption_lengths: list[int], text_length: int,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    """(picture (B, rows, columns, head dim / 2), caption (B, text_length, head dim / 2)) complex rotations, as the
    model's `patchify_and_embed` numbers the tokens: caption position j at (1 + j, 0, 0) up to its length padded to
    32, past that (0, 0, 0),
    the picture's (row, column) at (padded caption + 1, row, column); the picture's padding (`picture_rotary`) at
    (0, 0, 0)."""
    rope = rope_table(cfg.rope_theta, tuple(cfg.axes_dims), tuple(cfg.axes_lens))
    rows, columns = grid
    grid_ids = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij"), -1).flatten(0, 1)
    pictures, captions = [], []
    for n in caption_lengths:
        ids = torch.zeros(rows * columns, 3, dtype=torch.int32)
        ids[:, 0], ids[:, 1:] = padded(n) + 1, grid_ids
        pictures.append(rope(ids).view(rows, columns, -1))
        ids = torch.zeros(text_length, 3, dtype=torch.int32)
        ids[:padded(n), 0] = torch.arange(1, padded(n) + 1)  # its pad tokens numbered on, as the model numbers them
        captions.append(rope(ids))
    return torch.stack(pictures).to(device), torch.stack(captions).to(device)


def picture_rotary(image_rotary: torch.Tensor) -> torch.Tensor:
    """The picture's rotations by token, its padding to a multiple of 32 at position (0, 0, 0): no rotation."""
    flat = image_rotary.flatten(1, 2)
    short = (-flat.shape[1]) % SEQ_MULTI_OF
    return torch.cat([flat, flat.new_ones(flat.shape[0], short, flat.shape[2])], dim=1) if short else flat


class ZImageEmbed(nn.Module):
    def __init__(self, model: ZImageTransformer2DModel):
        super().__init__()
        self.t_embedder, self.cap_embedder = model.t_embedder, model.cap_embedder
        self.x_embedder = model.all_x_embedder["2-1"]
        self.x_pad_token, self.cap_pad_token = model.x_pad_token, model.cap_pad_token
        self.t_scale = model.config.t_scale

    def forward(self, sample, timestep, encoder_hidden_states, text_pad):
        h = self.x_embedder(sample)
        temb = self.t_embedder((1 - timestep / 1000) * self.t_scale).type_as(h)  # t = 1 - sigma, as the pipeline
        short = (-h.shape[1]) % SEQ_MULTI_OF
        if short:  # the picture's tokens to a multiple of 32, the model's pad token in the rest
            h = torch.cat([h, self.x_pad_token.to(h.dtype).expand(h.shape[0], short, -1)], dim=1)
        context = self.cap_embedder(encoder_hidden_states)
        context = torch.where(text_pad[..., None], self.cap_pad_token.to(context.dtype), context)
        return {"h": h, "context": context, "temb": temb}


class ZImagePictureRefiner(nn.Module):
    """A noise refiner: the picture's tokens alone, modulated by time."""

    TWIN_FREE = ("block.layer_id",)  # diffusers' block keeps its index; its forward does not read it

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, temb, image_rotary):
        return {"h": self.block(h, None, picture_rotary(image_rotary), temb)}


class ZImageContextRefiner(nn.Module):
    """A context refiner: the caption's tokens alone."""

    TWIN_FREE = ("block.layer_id",)  # diffusers' block keeps its index; its forward does not read it

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, context, text_rotary, text_mask):
        return {"context": self.block(context, mask_or_none(text_mask), text_rotary)}


class ZImageLayer(nn.Module):
    """A main block over the joined tokens; the first joins the picture's and the caption's (`joins`)."""

    TWIN_FREE = ("block.layer_id",)  # diffusers' block keeps its index; its forward does not read it

    def __init__(self, block: nn.Module, joins: bool):
        super().__init__()
        self.block, self.joins = block, joins

    def forward(self, h, temb, image_rotary, text_rotary, text_mask, context=None):
        if self.joins:
            h = torch.cat([h, context], dim=1)
        rotary = torch.cat([picture_rotary(image_rotary), text_rotary], dim=1)
        kept = None if text_mask.shape[1] == 0 else torch.cat(  # the picture's tokens all kept
            [text_mask.new_ones(text_mask.shape[0], h.shape[1] - text_mask.shape[1]), text_mask], dim=1)
        return {"h": self.block(h, kept, rotary, temb)}


class ZImageOut(nn.Module):
    def __init__(self, model: ZImageTransformer2DModel):
        super().__init__()
        self.final = model.all_final_layer["2-1"]

    def forward(self, h, temb, image_rotary):
        tokens = image_rotary.shape[1] * image_rotary.shape[2]  # the picture's, unpadded
        return {"prediction": -self.final(h[:, :tokens], c=temb)}  # the velocity: the model's, negated


def z_image_backbone(model: ZImageTransformer2DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states", "text_pad", "text_mask", "image_rotary", "text_rotary")
    units = [Unit("embed", ZImageEmbed(model), ("sample", "timestep", "encoder_hidden_states", "text_pad"),
                  ("h", "context", "temb"))]
    units += [Unit(f"noise_refiner.{i}", ZImagePictureRefiner(b), ("h", "temb", "image_rotary"), ("h",))
              for i, b in enumerate(model.noise_refiner)]
    units += [Unit(f"context_refiner.{i}", ZImageContextRefiner(b),
                   ("context", "text_rotary", "text_mask"), ("context",)) for i, b in enumerate(model.context_refiner)]
    reads = ("h", "temb", "image_rotary", "text_rotary", "text_mask")
    units += [Unit(f"layers.{i}", ZImageLayer(b, joins=i == 0), reads + (("context",) if i == 0 else ()), ("h",))
              for i, b in enumerate(model.layers)]
    units.append(Unit("out", ZImageOut(model), ("h", "temb", "image_rotary"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class ZImageFamily(ModelFamily):
    """Z-Image: a Qwen3 text encoder's second-to-last hidden states of the caption's real tokens (no pooled text),
    Flux's VAE (16 channels, 8x smaller sides); flow matching, time and prediction reversed in the model."""

    name = "z_image"
    model_class = ZImageTransformer2DModel
    component = "transformer"
    presets = Z_IMAGE_PRESETS
    pipelines = ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")
    release_layout = TONGYI
    reads_text_lengths = True  # a batch's text is cut to its captions (text_mask), each caption's length counted
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    sequence_refusal = ("pipeline.sequence_parallel is not built for Z-Image yet (its rotary tables depend on each "
                        "caption's length): set pipeline.sequence_parallel = 1")

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.ZImagePipeline

    def comfyui_lora_names(self, cfg, modules):
        """`diffusion_model.` and diffusers' own names: ComfyUI's Z-Image (its Lumina2 model) maps those onto its
        fused `qkv` and renamed layers (comfy/utils.py `z_image_to_diffusers`, read by its LoRA loader)."""
        return {m: f"diffusion_model.{m}" for m in modules}

    def check_supported(self, model):
        cfg = model.config
        if tuple(cfg.all_patch_size) != (2,) or tuple(cfg.all_f_patch_size) != (1,):
            raise ValueError(f"Z-Image configs with patch sizes {cfg.all_patch_size} x {cfg.all_f_patch_size} are "
                             "not supported: ZImagePipeline runs 2 x 1")
        if cfg.get("siglip_feat_dim") is not None:
            raise ValueError("Z-Image Omni (siglip_feat_dim set: pictures as conditions) is not supported yet")

    def describe(self, model, granularity):
        return z_image_backbone(model)

    def latent_channels(self, cfg):
        return cfg.in_channels

    def default_latent_size(self, cfg):
        return 8 if cfg.in_channels == 1 else 128  # digits; else 1024 pixels through Flux's 8x VAE

    def latent_multiple(self, cfg):
        return 2

    def text_widths(self, cfg):
        return cfg.cap_feat_dim, 0

    def conditions(self, cfg, text: TextBatch):
        filled = text.filled if text.filled is not None else filled_lengths_of(text.hidden)
        hidden, _ = text_mask(text.hidden, filled)
        # each caption's tokens; none filled anywhere (the zeros a plan traces): the longest a caption may be
        lengths = filled if any(filled) else [hidden.shape[1]] * len(hidden)
        length = hidden.shape[1]
        grid = (text.latent_size[0] // 2, text.latent_size[1] // 2)
        image, words = rotary_embedding(cfg, grid, lengths, length, hidden.device)
        positions = torch.arange(length)[None, :]
        kept = positions < torch.tensor([padded(n) for n in lengths])[:, None]  # the caption padded to 32
        pad = kept & (positions >= torch.tensor(lengths)[:, None])  # the model's pad token there
        if bool(kept.all()):  # decided on the host: no mask, as the model passes none when nothing is padded
            kept = kept[:, :0]
        return {"encoder_hidden_states": hidden, "text_pad": pad.to(hidden.device),
                "text_mask": kept.to(hidden.device), "image_rotary": image, "text_rotary": words}

    def pack(self, cfg, latents):
        return pack_patches(latents)

    def unpack_prediction(self, cfg, prediction, latent_size):
        return unpack_patches(prediction, latent_size)

    def diffusers_forward(self, model, sample, conditions):
        """The model's own forward as ZImagePipeline calls it (a list of one-frame latents, t = 1 - sigma, each
        caption's real tokens), its output negated and packed as the backbone's prediction."""
        hidden, pad, kept = conditions["encoder_hidden_states"], conditions["text_pad"], conditions["text_mask"]
        padded_lengths = kept.sum(1) if kept.shape[1] else torch.full((len(hidden),), hidden.shape[1])
        captions = [row[:int(n - p.sum())] for row, n, p in zip(hidden, padded_lengths, pad)]
        rows, columns = conditions["image_rotary"].shape[1:3]
        latents = unpack_patches(sample, (2 * rows, 2 * columns))
        out = model(list(latents.unsqueeze(2).unbind(0)), 1 - conditions["timestep"] / 1000, captions,
                    return_dict=False)[0]
        return pack_patches(-torch.stack(out).squeeze(2))

    def reset_own_parameters(self, module):
        """diffusers' RMSNorm, drawn as diffusers builds it; the model's own pad tokens, zero as its constructor
        makes them."""
        if isinstance(module, ZImageTransformer2DModel):
            for p in module.parameters(recurse=False):
                p.zero_()
            return True
        return reset_rms_norm(module)

    def folder_text_encoder(self, folder):
        from .text import ZImageText

        return ZImageText.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        return text_encoder_configs(folder)[0]["hidden_size"], 0

    def folder_text_length(self, folder):
        return Z_IMAGE_TEXT_TOKENS

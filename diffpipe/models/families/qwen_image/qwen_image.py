"""Adapter for diffusers' `QwenImageTransformer2DModel` (Qwen-Image, text-to-image: a 20 B MMDiT of 60 double-stream
blocks over a Qwen2.5-VL text encoder's states).

Units: `embed` (image and text projections, the text's RMS norm and the time embedding), each block `block.i`, and
`out` (the adaptive output norm and projection). Named tensors: `h` (image tokens), `context` (text tokens) and
`temb`. The rotary embedding (complex, as diffusers computes it) and the text mask are conditions, computed once per
batch beside the data and given to every stage: nothing of them crosses a boundary.

Latents are packed 2x2 into tokens as QwenImagePipeline packs them (Flux's packing), and the prediction stays in
that layout. Timesteps reach the model as the pipeline gives them (t in [0, 1]; the model scales by 1000).

Text: captions padded with zeros past their tokens (as the pipeline pads a batch), so each caption's mask is the
positions its encoder filled. The pipeline pads a batch to its longest caption; a pipelined step needs a fixed set
of shapes (its receive buffers are built per shape), so a batch's text is cut to the smallest of `TEXT_LENGTHS`
that holds its longest caption: at most five text shapes a bucket, and at most 2x a batch's longest caption, masked.
A batch whose captions all fill that length gets no mask (an empty one), as the pipeline passes none when nothing
is padded, so attention may take its unmasked kernels.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
from torch import nn

from ...family import ModelFamily, ReleaseLayout, TextBatch, unprefixed
from ...tokens import mask_or_none, pack_latents, reset_rms_norm, text_mask, unpack_latents
from ...units import Backbone, Unit

__all__ = ["QwenImageFamily", "qwen_image_backbone", "QWEN_IMAGE_PRESETS", "QWEN_TEXT_TOKENS"]

QWEN_TEXT_TOKENS = 512  # QwenImagePipeline.__call__'s max_sequence_length

QWEN_IMAGE_PRESETS = {
    # Qwen/Qwen-Image's transformer/config.json: 20.4 B parameters
    "20b": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
    # 1-channel 8x8 latents (scikit-learn's digits), packed 2x2 into 16 tokens of 4 channels
    "digits": dict(patch_size=2, in_channels=4, out_channels=1, num_layers=3, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)),
}


# Qwen's releases (Qwen/Qwen-Image, ComfyUI's split qwen_image_*.safetensors) name the weights as diffusers does; a
# checkpoint ComfyUI saves whole puts `model.diffusion_model.` before them
QWEN = ReleaseLayout(
    name="Qwen-Image",
    recognises=lambda keys: any(unprefixed(k) != k for k in keys),
    to_diffusers=lambda weights, config: {unprefixed(k): v for k, v in weights.items()},
    from_diffusers=lambda weights, config: dict(weights))


@lru_cache(maxsize=4)
def rope_table(axes_dims: tuple[int, ...]) -> QwenEmbedRope:
    """The model's rotary table (fixed by its config; its constructor computes it, so a meta-built model has none)."""
    with torch.device("cpu"):
        return QwenEmbedRope(theta=10000, axes_dim=list(axes_dims), scale_rope=True)


def rotary_embedding(cfg, grid: tuple[int, int], text_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(image (rows, columns, head dim / 2), text (length, head dim / 2)) complex rotations, as the model's
    `pos_embed([(1, rows, columns)], max_txt_seq_len=length)` gives them, the image's laid out on its grid."""
    image, text = rope_table(tuple(cfg.axes_dims_rope))([(1, *grid)], device=device, max_txt_seq_len=text_length)
    return image.reshape(*grid, -1), text


class QwenEmbed(nn.Module):
    def __init__(self, model: QwenImageTransformer2DModel):
        super().__init__()
        self.img_in, self.txt_norm, self.txt_in = model.img_in, model.txt_norm, model.txt_in
        self.time_text_embed = model.time_text_embed

    def forward(self, sample, timestep, encoder_hidden_states):
        h = self.img_in(sample)
        temb = self.time_text_embed((timestep / 1000).to(h.dtype), h)  # what the pipeline gives; the model scales it
        return {"h": h, "context": self.txt_in(self.txt_norm(encoder_hidden_states)), "temb": temb}


class QwenBlock(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, context, temb, encoder_hidden_states_mask, image_rotary, text_rotary):
        rope = (image_rotary[0].flatten(0, 1), text_rotary[0])  # every sample of a bucket shares them
        mask = mask_or_none(encoder_hidden_states_mask)
        context, h = self.block(hidden_states=h, encoder_hidden_states=context, encoder_hidden_states_mask=mask,
                                temb=temb, image_rotary_emb=rope)
        return {"h": h, "context": context}


class QwenOut(nn.Module):
    def __init__(self, model: QwenImageTransformer2DModel):
        super().__init__()
        self.norm_out, self.proj_out = model.norm_out, model.proj_out

    def forward(self, h, temb):
        return {"prediction": self.proj_out(self.norm_out(h, temb))}


def qwen_image_backbone(model: QwenImageTransformer2DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "image_rotary", "text_rotary")
    block_reads = ("h", "context", "temb") + conditions[2:]
    units = [Unit("embed", QwenEmbed(model), ("sample",) + conditions[:2], ("h", "context", "temb"))]
    units += [Unit(f"block.{i}", QwenBlock(b), block_reads, ("h", "context")) for i, b in enumerate(model.transformer_blocks)]
    units.append(Unit("out", QwenOut(model), ("h", "temb"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class QwenImageFamily(ModelFamily):
    """Qwen-Image: a Qwen2.5-VL text encoder's last hidden states (no pooled text), Qwen's video-shaped VAE on single
    frames (16 channels, 8x smaller sides); flow matching."""

    name = "qwen_image"
    model_class = QwenImageTransformer2DModel
    component = "transformer"
    presets = QWEN_IMAGE_PRESETS
    pipelines = ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")
    release_layout = QWEN
    reads_text_lengths = True  # a batch's text is cut to its captions (text_mask)
    # pipeline.sequence_parallel: the picture's tokens and the text's (attention joins them) split; the rotary tables
    # and the text mask cut to match where blocks read them, the picture's table by rows of its grid
    sequence_streams = {"h": 1, "context": 1}
    sequence_conditions = {"image_rotary": 1, "text_rotary": 1, "encoder_hidden_states_mask": 1}
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    def split_token_counts(self, cfg, shape):
        """The picture's rows of tokens: its rotary table is cut by rows of its grid, which is its tokens' share
        only where the rows divide."""
        return {"rows of picture tokens": shape[-2] // cfg.patch_size}

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.QwenImagePipeline

    def comfyui_lora_names(self, cfg, modules):
        """`diffusion_model.` and diffusers' own names: ComfyUI's Qwen-Image model (comfy/ldm/qwen_image) keeps
        diffusers' layer names, and its LoRA loader maps `diffusion_model.` + each weight's name onto it."""
        return {m: f"diffusion_model.{m}" for m in modules}

    def check_supported(self, model):
        cfg = model.config
        if cfg.patch_size != 2:
            raise ValueError(f"Qwen-Image config patch_size={cfg.patch_size} is not supported: QwenImagePipeline packs "
                             "latents 2x2 outside the model")
        unsupported = [k for k in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
                       if cfg.get(k)]
        if unsupported:
            raise ValueError(f"Qwen-Image configs with {', '.join(unsupported)} (the edit-2511 and layered variants) "
                             "are not text-to-image models: train Qwen-Image-Edit-2511 with model.architecture = "
                             "\"qwen_image_edit\" (the layered variant is not supported yet)")

    def unreached(self, model):
        """The last block's text side after attention: the prediction reads image tokens only."""
        last = f"transformer_blocks.{len(model.transformer_blocks) - 1}"
        return [f"{last}.attn.to_add_out", f"{last}.txt_mlp"]

    def describe(self, model, granularity):
        return qwen_image_backbone(model)

    def latent_channels(self, cfg):
        return cfg.in_channels // 4

    def default_latent_size(self, cfg):
        return 8 if cfg.in_channels == 4 else 128  # digits; else 1024 pixels through Qwen's 8x VAE

    def latent_multiple(self, cfg):
        return 2

    def text_widths(self, cfg):
        return cfg.joint_attention_dim, 0

    def conditions(self, cfg, text: TextBatch):
        hidden, mask = text_mask(text.hidden, text.filled)
        batch, grid = hidden.shape[0], (text.latent_size[0] // 2, text.latent_size[1] // 2)
        image, words = rotary_embedding(cfg, grid, hidden.shape[1], hidden.device)
        return {"encoder_hidden_states": hidden, "encoder_hidden_states_mask": mask,
                "image_rotary": image.expand(batch, *image.shape), "text_rotary": words.expand(batch, *words.shape)}

    def pack(self, cfg, latents):
        return pack_latents(latents)

    def unpack_prediction(self, cfg, prediction, latent_size):
        return unpack_latents(prediction, latent_size)

    def diffusers_forward(self, model, sample, conditions):
        rows, columns = conditions["image_rotary"].shape[1:3]
        return model(hidden_states=sample, timestep=conditions["timestep"] / 1000,
                     encoder_hidden_states=conditions["encoder_hidden_states"],
                     encoder_hidden_states_mask=mask_or_none(conditions["encoder_hidden_states_mask"]),
                     img_shapes=[[(1, rows, columns)]] * sample.shape[0], return_dict=False)[0]

    def reset_own_parameters(self, module):
        """diffusers' RMSNorm (the text's input norm), drawn as diffusers builds it."""
        return reset_rms_norm(module)

    def folder_text_encoder(self, folder):
        from .text import QwenImageText

        return QwenImageText.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        cfg = text_encoder_configs(folder)[0]
        return cfg.get("text_config", cfg)["hidden_size"], 0

    def folder_text_length(self, folder):
        return QWEN_TEXT_TOKENS

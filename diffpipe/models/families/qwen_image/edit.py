"""Adapter for Qwen-Image-Edit (diffusers' `QwenImageEditPipeline`; -2509 and -2511 through
`QwenImageEditPlusPipeline`): Qwen-Image's `QwenImageTransformer2DModel`, trained to edit a control picture
(data.control_path: the picture each training picture was made from).

The control picture enters twice, as the pipeline feeds it. Its latents, packed 2x2 as the picture's, are appended
after the picture's tokens, their rotary positions in the model's second frame (`img_shapes` of two entries), and
the prediction is the picture's tokens only (`noise_pred[:, : latents.size(1)]`). And the text encoder, Qwen2.5-VL,
reads the picture with the instruction (text.py's QwenImageEditText): a caption's states hold the picture's
vision tokens, so a text is encoded and cached per (caption, control picture). The control's tokens (`reference`)
and rotary table (`reference_rotary`) are conditions every stage is given: `embed` joins them to the picture's and
`out` cuts them back off, so only Qwen-Image's `h`, `context` and `temb` cross a boundary. 2511's transformer
(`zero_cond_t`) modulates the control's tokens by time zero's embedding: `temb` then holds the timestep's and zero's
(twice the batch) and `modulate_index` (a condition) marks the control's tokens, as the model's own forward does.

The text is as long as the control's vision tokens and the caption (a 1024^2 control: about 1,400 positions); a
batch's text is cut (or zero-padded) to the smallest of `EDIT_TEXT_LENGTHS` that holds its longest, masked, as
Qwen-Image's is to TEXT_LENGTHS. Without a control (the sample grid's text-only prompts) the model is fed no
reference tokens and the encoder reads the caption alone.
"""
from __future__ import annotations

import torch
from torch import nn

from .text import EDIT_PICTURE_AREA, EDIT_PLUS_PICTURE_AREA, reads_pictures_as_plus
from ...family import TextBatch
from ...tokens import mask_or_none, pack_latents, text_mask
from .qwen_image import QWEN_TEXT_TOKENS, QwenBlock, QwenEmbed, QwenImageFamily, QwenOut, rope_table
from ...units import Backbone, Unit

__all__ = ["QwenImageEditFamily", "EDIT_TEXT_LENGTHS", "picture_tokens"]

# a batch's text (the control's vision tokens and the caption) is cut or padded to the smallest that holds it: at most
# 1.5x its longest caption's positions, and a handful of text shapes a bucket
EDIT_TEXT_LENGTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
_EDIT_MAX_PIXELS = 12845056  # Qwen-Image-Edit's processor/preprocessor_config.json max_pixels (Qwen2.5-VL's)


def picture_tokens(height: int, width: int, area: int = EDIT_PICTURE_AREA) -> int:
    """Vision tokens Qwen2.5-VL makes of a control of height x width pixels: sized to about `area` pixels as the
    pipeline sizes its input (text.py's as_the_pipeline_sizes), then resized by its processor
    (transformers' smart_resize, Qwen-Image-Edit's pixel limits) into 14-pixel patches merged 2x2."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # (needs no torchvision)

    width, height, _ = calculate_dimensions(area, width / height)
    rows, columns = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=_EDIT_MAX_PIXELS)
    return rows * columns // 28**2


def rotary_embedding(cfg, grid: tuple[int, int], reference_grid: tuple[int, int] | None, text_length: int,
                     device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picture (rows, columns, head dim / 2), control (rows, columns, ...), text (length, ...)) complex rotations,
    as the model's `pos_embed([(1, rows, columns), (1, control rows, control columns)], max_txt_seq_len=length)`
    gives them; without a control, no control rows."""
    shapes = [(1, *grid)] + ([(1, *reference_grid)] if reference_grid else [])
    images, text = rope_table(tuple(cfg.axes_dims_rope))([shapes], device=device, max_txt_seq_len=text_length)
    picture = images[:grid[0] * grid[1]].reshape(*grid, -1)
    reference = (images[grid[0] * grid[1]:].reshape(*reference_grid, -1) if reference_grid
                 else images.new_zeros(0, 0, images.shape[-1]))
    return picture, reference, text


class _EditEmbed(QwenEmbed):
    """With zero_cond_t (Qwen-Image-Edit-2511) `temb` is the timestep's embedding and, after it along the batch, time
    zero's, which the control's tokens are modulated by (the model's own `torch.cat([timestep, timestep * 0])`)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.zero_cond_t = bool(model.config.get("zero_cond_t"))

    def forward(self, sample, reference, timestep, encoder_hidden_states):
        joined = torch.cat((sample, reference), dim=1)
        if not self.zero_cond_t:
            return super().forward(joined, timestep, encoder_hidden_states)
        h = self.img_in(joined)
        t = (timestep / 1000).to(h.dtype)
        return {"h": h, "context": self.txt_in(self.txt_norm(encoder_hidden_states)),
                "temb": self.time_text_embed(torch.cat((t, t * 0)), h)}


class _EditBlock(QwenBlock):
    def forward(self, h, context, temb, encoder_hidden_states_mask, image_rotary, reference_rotary, text_rotary,
                modulate_index):
        images = torch.cat((image_rotary[0].flatten(0, 1), reference_rotary[0].flatten(0, 1)))
        context, h = self.block(hidden_states=h, encoder_hidden_states=context,
                                encoder_hidden_states_mask=mask_or_none(encoder_hidden_states_mask), temb=temb,
                                image_rotary_emb=(images, text_rotary[0]), modulate_index=mask_or_none(modulate_index))
        return {"h": h, "context": context}


class _EditOut(QwenOut):
    def forward(self, h, temb, reference):
        if h.shape[0] != temb.shape[0]:  # zero_cond_t: the timestep's embedding, then time zero's
            temb = temb.chunk(2)[0]
        return super().forward(h[:, :h.shape[1] - reference.shape[1]], temb)


def qwen_image_edit_backbone(model: nn.Module) -> Backbone:
    conditions = ("reference", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "image_rotary",
                  "reference_rotary", "text_rotary", "modulate_index")
    block_reads = ("h", "context", "temb") + conditions[3:]
    units = [Unit("embed", _EditEmbed(model), ("sample",) + conditions[:3], ("h", "context", "temb"))]
    units += [Unit(f"block.{i}", _EditBlock(b), block_reads, ("h", "context"))
              for i, b in enumerate(model.transformer_blocks)]
    units.append(Unit("out", _EditOut(model), ("h", "temb", "reference"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit: Qwen-Image's latents and objective; the control picture's tokens beside the picture's, and
    read by the text encoder with the caption."""

    name = "qwen_image_edit"
    reads_control = True
    sequence_streams = {}
    sequence_refusal = ("the control picture's tokens join the picture's with their own rotary table and "
                        "modulation, which the token shares do not carry yet")
    pipelines = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")

    def check_supported(self, model):
        cfg = model.config
        if cfg.patch_size != 2:
            raise ValueError(f"Qwen-Image-Edit config patch_size={cfg.patch_size} is not supported: the pipeline "
                             "packs latents 2x2 outside the model")
        unsupported = [k for k in ("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope") if cfg.get(k)]
        if unsupported:
            raise ValueError(f"Qwen-Image configs with {', '.join(unsupported)} (the layered variant) are not supported "
                             "yet: the qwen_image_edit adapter trains edits of one control picture")

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.QwenImageEditPipeline

    def describe(self, model, granularity):
        return qwen_image_edit_backbone(model)

    def example_text_length(self, cfg, length: int, latent_size: tuple[int, ...], control: bool, folder) -> int:
        """A caption's positions (`length`) and, beside a control, the vision tokens of a control of the items' size
        (the VAE's 8x sides) as the folder's pipeline sizes it, padded to the next of EDIT_TEXT_LENGTHS: every
        position filled, so a plan traces the unmasked attention (the fused kernels keep no probability matrix for a
        mask either)."""
        area = EDIT_PLUS_PICTURE_AREA if folder is not None and reads_pictures_as_plus(folder) else EDIT_PICTURE_AREA
        filled = length + (picture_tokens(latent_size[-2] * 8, latent_size[-1] * 8, area) if control else 0)
        return next((n for n in EDIT_TEXT_LENGTHS if n >= filled), filled)

    def conditions(self, cfg, text: TextBatch):
        hidden, mask = text_mask(text.hidden, text.filled, EDIT_TEXT_LENGTHS)
        batch, grid = hidden.shape[0], (text.latent_size[0] // 2, text.latent_size[1] // 2)
        control = text.control
        reference_grid = (control.shape[2] // 2, control.shape[3] // 2) if control is not None else None
        picture, reference, words = rotary_embedding(cfg, grid, reference_grid, hidden.shape[1], hidden.device)
        # zero_cond_t: which image tokens are modulated by time zero's embedding (1: the control's), as the model's
        # own modulate_index; else none
        tokens = (grid[0] * grid[1], reference.shape[0] * reference.shape[1]) if cfg.get("zero_cond_t") else (0, 0)
        index = torch.cat((torch.zeros(tokens[0], dtype=torch.int), torch.ones(tokens[1], dtype=torch.int)))
        return {"encoder_hidden_states": hidden, "encoder_hidden_states_mask": mask,
                "modulate_index": index.to(hidden.device).expand(batch, -1),
                "reference": (pack_latents(control) if control is not None
                              else hidden.new_zeros(batch, 0, cfg.in_channels)),
                "image_rotary": picture.expand(batch, *picture.shape),
                "reference_rotary": reference.expand(batch, *reference.shape),
                "text_rotary": words.expand(batch, *words.shape)}

    def diffusers_forward(self, model, sample, conditions):
        rows, columns = conditions["image_rotary"].shape[1:3]
        shapes = [(1, rows, columns)]
        if conditions["reference"].shape[1]:
            shapes.append((1, *conditions["reference_rotary"].shape[1:3]))
        out = model(hidden_states=torch.cat((sample, conditions["reference"]), dim=1),
                    timestep=conditions["timestep"] / 1000, encoder_hidden_states=conditions["encoder_hidden_states"],
                    encoder_hidden_states_mask=mask_or_none(conditions["encoder_hidden_states_mask"]),
                    img_shapes=[shapes] * sample.shape[0], return_dict=False)[0]
        return out[:, :sample.shape[1]]

    def folder_text_encoder(self, folder):
        from .text import QwenImageEditText

        return QwenImageEditText.from_folder(folder)

    def folder_text_length(self, folder):
        return QWEN_TEXT_TOKENS

"""Wan 2.1 image-to-video (Wan2.1-I2V-14B-480P / -720P: diffusers' `WanImageToVideoPipeline` with an
`image_encoder/`): beside the first frame's latents (as I2V-A14B's experts read them: models/families/wan/i2v.py), the
transformer reads a CLIP vision model's embedding of the picture.

The pipeline's `encode_image`: its CLIPImageProcessor (shortest side to 224 pixels, centre crop, CLIP's
normalisation), then CLIPVisionModel's penultimate hidden states: 257 tokens (ViT-H/14's 16 x 16 patches and its
class token) of 1280. The transformer embeds them (`image_dim`: LayerNorm, MLP, LayerNorm) and puts them before the
text along the sequence; each block's cross-attention reads them through its own key and value projections
(`added_kv_proj_dim`) and takes the text as the sequence's last 512 positions (diffusers' WanAttnProcessor: the text
must be 512 long, as WanPipeline pads it).

diffpipe gives the picture to the text encoder with the caption, as Qwen-Image-Edit's text encoder reads its control
picture (`CaptionEncoder.reads_pictures`): `WanImageText` is umT5 with the CLIP vision model, its pooled output the
CLIP states flattened (B, 257 x 1280), so a text is encoded and cached per (caption, first frame) and nothing else
of the data path changes. `embed` joins the embedded picture before the text: `context` crosses a boundary 769
positions long (was 512). A prompt alone (no picture) gets zero CLIP states: the pipeline always has a picture.
Without a pipeline folder (the presets) the stand-in text encoder's pooled output takes the CLIP states' place.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .text import WAN_T5_TOKENS, WanText
from ....errors import CheckpointError
from ...folder import component_weights, fingerprint_files, pipeline_index
from ...text import caption_and_picture
from .wan import WanEmbed

__all__ = ["WanImageText", "WAN_CLIP_TOKENS", "has_image_encoder", "image_encoder_widths", "image_embeds",
           "ClipEmbed"]

WAN_CLIP_TOKENS = 257  # open-clip ViT-H/14 at 224 x 224 pixels: 16 x 16 patches and the class token


def has_image_encoder(folder: Path) -> bool:
    """Whether a pipeline folder has a CLIP vision model (Wan 2.1 I2V's; Wan 2.2's I2V folders have none)."""
    entry = pipeline_index(folder).get("image_encoder")
    return isinstance(entry, list) and entry[0] is not None and (folder / "image_encoder").is_dir()


def _clip_tokens(config: dict) -> int:
    return (config["image_size"] // config["patch_size"]) ** 2 + 1


def image_encoder_widths(folder: Path) -> int:
    """Width of the flattened CLIP states the folder's image encoder gives a picture: tokens x hidden size."""
    config = json.loads((folder / "image_encoder" / "config.json").read_text())
    return _clip_tokens(config) * config["hidden_size"]


def image_embeds(cfg, text_hidden: torch.Tensor, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
    """The conditions a Wan 2.1 I2V transformer reads of a batch's text: umT5's states zero-padded to the 512 the
    model's cross-attention takes as text, and the picture's CLIP states (B, 257, image_dim)."""
    short = WAN_T5_TOKENS - text_hidden.shape[1]
    if short < 0:
        raise ValueError(f"a Wan 2.1 image-to-video transformer reads at most {WAN_T5_TOKENS} text positions (its "
                         f"cross-attention takes the last {WAN_T5_TOKENS} as text); got {text_hidden.shape[1]}: set "
                         f"model.text_max_length <= {WAN_T5_TOKENS}")
    return {"encoder_hidden_states": F.pad(text_hidden, (0, 0, 0, short)),
            "image_embeds": pooled.unflatten(1, (-1, cfg.image_dim))}


class ClipEmbed(WanEmbed):
    """Wan's `embed` reading the first frame beside the noisy latents and the picture's CLIP states, embedded and
    put before the text as the model's forward does."""

    def forward(self, sample, first_frame, image_embeds, timestep, encoder_hidden_states):
        sample = torch.cat((sample, first_frame.to(sample.dtype)), dim=1)
        cos, sin = self.rope(sample)
        h = self.patch_embedding(sample).flatten(2).transpose(1, 2).contiguous()
        temb, tproj, context, picture = self.condition_embedder(timestep, encoder_hidden_states, image_embeds)
        return {"h": h, "context": torch.cat((picture, context), dim=1), "temb": temb,
                "tproj": tproj.unflatten(1, (6, -1)), "rope": torch.stack((cos, sin))}


class WanImageText(WanText):
    """umT5 (text_encoder/) and the CLIP vision model (image_encoder/, image_processor/) of a Wan 2.1 I2V folder:
    each caption's states as WanPipeline's, and as the pooled output its picture's penultimate CLIP states
    flattened, as WanImageToVideoPipeline.encode_image gives them (zeros for a caption without a picture)."""

    reads_pictures = True

    def __init__(self, tokenizers: list, models: list[torch.nn.Module], folder: Path, pictures):
        super().__init__(tokenizers, models, folder)
        self.image_processor = pictures

    @classmethod
    def from_folder(cls, folder: Path) -> "WanImageText":
        from transformers import AutoImageProcessor, CLIPVisionModel

        text = WanText.from_folder(folder)
        if not (folder / "image_processor").is_dir():
            raise CheckpointError(f"model.path={folder}: the image encoder's image_processor/ subfolder is missing; "
                                  "copy it from the release (WanImageToVideoPipeline's CLIPImageProcessor)")
        component_weights(folder, "image_encoder")  # refuses pickles before from_pretrained could read one
        clip = CLIPVisionModel.from_pretrained(folder, subfolder="image_encoder", use_safetensors=True,
                                               local_files_only=True).eval().requires_grad_(False)
        pictures = AutoImageProcessor.from_pretrained(folder, subfolder="image_processor", local_files_only=True)
        return cls(text.tokenizers, text.models + [clip], folder, pictures)

    @property
    def pooled_size(self) -> int:
        clip = self.models[1].config
        return _clip_tokens(clip.to_dict()) * clip.hidden_size

    def fingerprint(self) -> str:
        files = component_weights(self.folder, "text_encoder") + component_weights(self.folder, "image_encoder")
        files += sorted(f for name in ("tokenizer", "image_processor") for f in (self.folder / name).iterdir()
                        if f.is_file())
        return fingerprint_files(files, extra=type(self).__name__)

    @torch.no_grad()
    def _encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        captions, keys = zip(*(caption_and_picture(t) for t in texts))
        hidden, _ = super()._encode(list(captions))
        clip = self.models[1]
        pooled = hidden.new_zeros(len(texts), self.pooled_size)
        shown = [i for i, key in enumerate(keys) if key is not None]
        if shown:
            pixels = self.image_processor(images=[self.picture(keys[i]) for i in shown], return_tensors="pt")
            states = clip(pixel_values=pixels["pixel_values"].to(self.device, clip.dtype),
                          output_hidden_states=True).hidden_states[-2]
            pooled[shown] = states.flatten(1).to(pooled.dtype)
        return hidden, pooled

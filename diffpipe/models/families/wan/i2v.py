"""Adapter for Wan image-to-video (diffusers' `WanImageToVideoPipeline`, as Wan 2.2 I2V-A14B lays it out: either of
its two experts): Wan's `WanTransformer3DModel`, trained to continue a clip from its first frame.

The pipeline encodes the first frame followed by grey frames (zeros in the VAE's [-1, 1] range) for the clip's
length, normalises those latents as the clip's, and feeds the transformer, along the channels, the noisy latents, a
mask of 4 channels (ones on the first latent frame: the one the picture fixes, zeros after) and that encoding:
2 x latent channels + 4 in all (36 for Wan). Training does the same with each clip's own first frame
(data/first_frames.py encodes and caches it, as a control image is). The mask and the encoding (`first_frame`) are a
condition every stage is given; `embed` joins them to the noisy latents, so only Wan's `h`, `context`, `temb`,
`tproj` and `rope` cross a boundary. The loss is over every frame, as the pipeline predicts them all.

Wan 2.2 TI2V-5B's transformer (as many channels read as predicted) is continued as its pipeline does with
`expand_timesteps`: the first latent frame replaced by the picture's, its timestep zero (models/families/wan/ti2v.py). Its
WanPipeline folder trains image-to-video with `model.architecture = "wan_i2v"` set (text-to-video without).

Wan 2.1's I2V transformers (`image_dim`, the pipeline's `image_encoder/`) also read a CLIP vision model's embedding
of the picture (models/families/wan/clip.py). Wan 2.1's first-last-frame model (`pos_embed_seq_len`) is refused.
"""
from __future__ import annotations

import torch

from ...family import TextBatch
from ...two_experts import TwoExperts
from ...units import Backbone, Unit
from .wan import WAN_PRESETS, WanFamily, WanEmbed, wan_backbone
from .clip import ClipEmbed, WAN_CLIP_TOKENS, has_image_encoder, image_embeds, image_encoder_widths
from .ti2v import ti2v_clean_latents, ti2v_first_frame, ti2v_pipeline_input, wan_ti2v_backbone

__all__ = ["WanI2VFamily", "first_frame_mask", "FRAME_MASK_CHANNELS", "WAN_I2V_PRESETS"]

FRAME_MASK_CHANNELS = 4  # the pipeline's mask: Wan's VAE folds 4 frames into a latent frame (vae_scale_factor_temporal)
WAN_I2V_PRESETS = {
    # Wan-AI/Wan2.2-I2V-A14B-Diffusers' transformer/config.json (either expert): 14.3 B parameters
    "i2v-a14b": dict(WAN_PRESETS["t2v-14b"], in_channels=36),
    # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers' transformer/config.json (also -720P's): 16.4 B parameters
    "i2v-14b": dict(WAN_PRESETS["t2v-14b"], in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "digits": dict(WAN_PRESETS["digits"], in_channels=2 + FRAME_MASK_CHANNELS),  # clips of moving digits
    "ti2v-5b": WAN_PRESETS["ti2v-5b"],  # the first frame replaced (models/families/wan/ti2v.py)
    "digits-ti2v": WAN_PRESETS["digits"],
    # Wan 2.1 I2V's: the stand-in text encoder's pooled output in the CLIP states' place (257 tokens of 8)
    "digits-clip": dict(WAN_PRESETS["digits"], in_channels=2 + FRAME_MASK_CHANNELS, image_dim=8, added_kv_proj_dim=48),
}


def replaces_first_frame(cfg) -> bool:
    """Whether a Wan transformer is continued as TI2V-5B is (its first latent frame replaced: as many channels read
    as predicted), rather than reading the first frame beside the noisy latents (I2V-A14B)."""
    return cfg.in_channels == cfg.out_channels


def first_frame_mask(batch: int, latent_size: tuple[int, int, int], device=None) -> torch.Tensor:
    """(B, 4, F, H, W): ones on the first latent frame, zeros after, as WanImageToVideoPipeline.prepare_latents."""
    mask = torch.zeros(batch, FRAME_MASK_CHANNELS, *latent_size, device=device)
    mask[:, :, 0] = 1
    return mask


class _I2VEmbed(WanEmbed):
    def forward(self, sample, first_frame, timestep, encoder_hidden_states):
        return super().forward(torch.cat((sample, first_frame.to(sample.dtype)), dim=1), timestep, encoder_hidden_states)


def reads_picture(cfg) -> bool:
    """Whether a Wan transformer also reads a CLIP embedding of the picture (Wan 2.1 I2V: models/families/wan/clip.py)."""
    return cfg.image_dim is not None


def wan_i2v_backbone(model) -> Backbone:
    """Wan's units, with an `embed` that joins the first frame's mask and latents to the noisy latents (and for Wan
    2.1 I2V the picture's embedding to the text)."""
    wan = wan_backbone(model)
    own = ("first_frame", "image_embeds") if reads_picture(model.config) else ("first_frame",)
    conditions = wan.conditions + own
    embed = (ClipEmbed if reads_picture(model.config) else _I2VEmbed)(model)
    units = [Unit("embed", embed, ("sample",) + own + wan.conditions, wan.units[0].writes), *wan.units[1:]]
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model,
                    tables=("rope",))


class WanI2VFamily(WanFamily):
    """Wan image-to-video: Wan's text, VAE and objective; each clip's first frame, encoded, beside its noisy latents."""

    name = "wan_i2v"
    reads_first_frame = True
    presets = WAN_I2V_PRESETS
    pipelines = ("WanImageToVideoPipeline",)

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.WanImageToVideoPipeline

    def check_supported(self, model):
        cfg = model.config
        if cfg.pos_embed_seq_len is not None:
            raise ValueError("Wan 2.1's first-last-frame transformer (pos_embed_seq_len: it reads two pictures, the "
                             "first and the last frame) is not supported yet; Wan 2.1 I2V-14B and Wan 2.2's "
                             "image-to-video models train")
        if (cfg.image_dim is None) != (cfg.added_kv_proj_dim is None):
            raise ValueError(f"a Wan transformer that reads a CLIP embedding of the picture has both image_dim and "
                             f"added_kv_proj_dim; this one image_dim={cfg.image_dim}, added_kv_proj_dim="
                             f"{cfg.added_kv_proj_dim}")
        expected = 2 * cfg.out_channels + FRAME_MASK_CHANNELS
        if cfg.in_channels not in (expected, cfg.out_channels):
            raise ValueError(f"a Wan image-to-video transformer reads {expected} channels (latents {cfg.out_channels}, "
                             f"mask {FRAME_MASK_CHANNELS}, first frame {cfg.out_channels}: I2V-A14B's) or "
                             f"{cfg.out_channels} (its first frame replaced: TI2V-5B's); this one in_channels="
                             f"{cfg.in_channels}")

    def trains_folder(self, index):
        """WanImageToVideoPipeline's folders, and WanPipeline's with expand_timesteps (TI2V-5B: its one transformer
        makes videos from a prompt or from a first frame)."""
        return super().trains_folder(index) or (index.get("_class_name") == "WanPipeline"
                                                and bool(index.get("expand_timesteps")))

    def describe(self, model, granularity):
        return (wan_ti2v_backbone if replaces_first_frame(model.config) else wan_i2v_backbone)(model)

    def sequence_refusal_for(self, model):
        """I2V-A14B and Wan 2.1 I2V split as text-to-video does (the picture and its mask join the latents along the
        channels; Wan 2.1's picture embedding is read by cross-attention alone); TI2V-5B's timesteps and
        modulations are per latent frame and its output puts the first frame back: not split yet."""
        if not isinstance(model, TwoExperts) and replaces_first_frame(model.config):
            return ("TI2V's timesteps and modulations are per latent frame and its output puts the first frame "
                    "back, which the token shares do not carry yet")
        return super().sequence_refusal_for(model)

    def latent_channels(self, cfg):
        return cfg.out_channels

    def text_widths(self, cfg):
        return cfg.text_dim, WAN_CLIP_TOKENS * cfg.image_dim if reads_picture(cfg) else 0

    def folder_text_encoder(self, folder):
        if has_image_encoder(folder):
            from .clip import WanImageText

            return WanImageText.from_folder(folder)
        return super().folder_text_encoder(folder)

    def folder_text_widths(self, folder):
        hidden, _ = super().folder_text_widths(folder)
        return hidden, image_encoder_widths(folder) if has_image_encoder(folder) else 0

    def gives_first_latent_frame(self, cfg):
        return replaces_first_frame(cfg)

    def clean_latents(self, cfg, conditions, latent_size):
        return ti2v_clean_latents(conditions["first_frame"], latent_size[0]) if replaces_first_frame(cfg) else None

    def conditions(self, cfg, text: TextBatch):
        batch, device = text.hidden.shape[0], text.hidden.device
        frames = text.latent_size
        if replaces_first_frame(cfg):
            first = ti2v_first_frame(text.control, batch, frames, cfg.out_channels, device)
            return {"encoder_hidden_states": text.hidden, "first_frame": first}
        control = text.control  # no first frame (a prompt alone): grey, unmasked, as nothing fixed
        if control is None:
            latents = torch.zeros(batch, cfg.out_channels, *frames, device=device)
            mask = torch.zeros(batch, FRAME_MASK_CHANNELS, *frames, device=device)
        else:
            latents, mask = control, first_frame_mask(batch, frames, device)
        first = {"first_frame": torch.cat((mask, latents.to(mask.dtype)), dim=1)}
        if reads_picture(cfg):
            return {**image_embeds(cfg, text.hidden, text.pooled), **first}
        return {"encoder_hidden_states": text.hidden, **first}

    def diffusers_forward(self, model, sample, conditions):
        if replaces_first_frame(model.config):
            joined, per_token, keep = ti2v_pipeline_input(sample, conditions["first_frame"], conditions["timestep"],
                                                          model.config.patch_size[1:])
            out = model(hidden_states=joined, timestep=per_token,
                        encoder_hidden_states=conditions["encoder_hidden_states"], return_dict=False)[0]
            return self.pack_prediction(model.config, out * keep)
        joined = torch.cat((sample, conditions["first_frame"].to(sample.dtype)), dim=1)
        out = model(hidden_states=joined, timestep=conditions["timestep"],
                    encoder_hidden_states=conditions["encoder_hidden_states"],
                    encoder_hidden_states_image=conditions.get("image_embeds"), return_dict=False)[0]
        return self.pack_prediction(model.config, out)

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
`expand_timesteps`: the first latent frame replaced by the picture's, its timestep zero (models/wan_ti2v.py). Its
WanPipeline folder trains image-to-video with `model.architecture = "wan_i2v"` set (text-to-video without).

Wan 2.1's I2V transformers also read a CLIP vision model's embedding of the picture (`image_dim`, the pipeline's
`image_encoder/`): not supported yet, and refused naming the keys.
"""
from __future__ import annotations

import torch

from .family import TextBatch
from .units import Backbone, Unit
from .wan import WAN_PRESETS, WanFamily, _Embed, wan_backbone
from .wan_ti2v import ti2v_clean_latents, ti2v_first_frame, ti2v_pipeline_input, wan_ti2v_backbone

__all__ = ["WanI2VFamily", "first_frame_mask", "FRAME_MASK_CHANNELS", "WAN_I2V_PRESETS"]

FRAME_MASK_CHANNELS = 4  # the pipeline's mask: Wan's VAE folds 4 frames into a latent frame (vae_scale_factor_temporal)
WAN_I2V_PRESETS = {
    # Wan-AI/Wan2.2-I2V-A14B-Diffusers' transformer/config.json (either expert): 14.3 B parameters
    "i2v-a14b": dict(WAN_PRESETS["t2v-14b"], in_channels=36),
    "digits": dict(WAN_PRESETS["digits"], in_channels=2 + FRAME_MASK_CHANNELS),  # clips of moving digits
    "ti2v-5b": WAN_PRESETS["ti2v-5b"],  # the first frame replaced (models/wan_ti2v.py)
    "digits-ti2v": WAN_PRESETS["digits"],
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


class _I2VEmbed(_Embed):
    def forward(self, sample, first_frame, timestep, encoder_hidden_states):
        return super().forward(torch.cat((sample, first_frame.to(sample.dtype)), dim=1), timestep, encoder_hidden_states)


def wan_i2v_backbone(model) -> Backbone:
    """Wan's units, with an `embed` that joins the first frame's mask and latents to the noisy latents."""
    wan = wan_backbone(model)
    conditions = wan.conditions + ("first_frame",)
    units = [Unit("embed", _I2VEmbed(model), ("sample", "first_frame") + wan.conditions, wan.units[0].writes),
             *wan.units[1:]]
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


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
        if cfg.image_dim is not None or cfg.added_kv_proj_dim is not None:
            raise ValueError("Wan 2.1 image-to-video transformers (image_dim, added_kv_proj_dim: they also read a CLIP "
                             "vision model's embedding of the picture) are not supported yet; Wan 2.2 I2V-A14B's "
                             "experts train")
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

    def latent_channels(self, cfg):
        return cfg.out_channels

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
        return {"encoder_hidden_states": text.hidden, "first_frame": torch.cat((mask, latents.to(mask.dtype)), dim=1)}

    def diffusers_forward(self, model, sample, conditions):
        if replaces_first_frame(model.config):
            joined, per_token, keep = ti2v_pipeline_input(sample, conditions["first_frame"], conditions["timestep"],
                                                          model.config.patch_size[1:])
            out = model(hidden_states=joined, timestep=per_token,
                        encoder_hidden_states=conditions["encoder_hidden_states"], return_dict=False)[0]
            return self.pack_prediction(model.config, out * keep)
        joined = torch.cat((sample, conditions["first_frame"].to(sample.dtype)), dim=1)
        out = model(hidden_states=joined, timestep=conditions["timestep"],
                    encoder_hidden_states=conditions["encoder_hidden_states"], return_dict=False)[0]
        return self.pack_prediction(model.config, out)

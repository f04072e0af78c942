"""Adapter for diffusers' `LTX2VideoTransformer3DModel` (LTX-2: video with its sound): issue 57's third family.

LTX-2 denoises a clip's video latents and its audio latents together: two token streams, video (`h`) and audio
(`audio`), each with its own attention, text cross-attention and feed-forward, and in every block an attention from
each to the other. Both are trained at one timestep per sample, as LTX2Pipeline runs them (it passes the same `t` as
`timestep` and `sigma` to both streams).

**A sample's layout** (layout.py). diffpipe trains one latent tensor per sample; an LTX-2 sample is the clip's video
latents (C, F, H, W) with its audio's tokens after them in extra latent frames (zero-padded to whole frames: an audio
token is `audio_in_channels` = C wide, 8 channels x 16 mel bins in the release, as a video token is 128 channels),
as many as LTX2Pipeline makes for the clip. `pack` turns such a tensor into the tokens the model reads, the video's
then the audio's (the padding dropped); `unpack_prediction` lays a prediction out again the same way. codec.py makes
such samples of clips with their sound; text.py the captions.

Units: `embed` (both streams' input projections, the rotary tables of both streams and of their cross-attentions,
cosines and sines stacked, each stream's time embedding and its output modulation, the cross-attention modulations and
gates, and the captions projected for each stream), each block `block.i`, and `out` (each stream's adaptive output
norm and projection, the video's tokens then the audio's).

Captions: `encoder_hidden_states` is the video's text states then the audio's side by side (the text connectors make
one of each from Gemma 3's states; text_widths reports their sum). No mask is fed: the connectors replace a caption's
padding with learned registers and give a mask of ones (pipelines/ltx2/connectors.py).
"""
from __future__ import annotations

import torch
from diffusers import LTX2VideoTransformer3DModel
from torch import nn

from ...family import ModelFamily, TextBatch
from ...units import Backbone, Unit
from .layout import FRAME_RATE, audio_latent_frames, sample_frames, video_frames_of
from .release_layout import LIGHTRICKS, release_name

__all__ = ["LTX2Family", "ltx2_backbone", "LTX2_PRESETS", "caption_widths", "video_coords", "audio_coords",
           "FRAME_RATE", "audio_latent_frames", "sample_frames", "video_frames_of"]  # the last four: layout.py

LTX2_PRESETS = {
    # LTX-2 (19 B: a 14 B video stream, a 5 B audio stream): diffusers' defaults for the class, the release's config
    "2.0": dict(),
    # 8-channel latents on both streams (the digits' tiny clips): two blocks, 16 wide
    "digits": dict(in_channels=8, out_channels=8, audio_in_channels=8, audio_out_channels=8, num_attention_heads=2,
                   attention_head_dim=8, cross_attention_dim=16, audio_num_attention_heads=2,
                   audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2, caption_channels=16),
}

# the embed unit's outputs, every block's inputs past the two streams and the captions
_MODULATIONS = ("temb", "temb_audio", "ca_shift", "ca_audio_shift", "ca_gate", "ca_audio_gate")
_ROPES = ("rope", "rope_audio", "rope_ca", "rope_ca_audio")


def caption_widths(cfg) -> tuple[int, int]:
    """(video, audio) widths of the caption states the model reads: LTX-2.0 projects captions of `caption_channels`
    for each stream; LTX-2.3's connectors project them to each stream's cross-attention width themselves."""
    if cfg.use_prompt_embeddings:
        return cfg.caption_channels, cfg.caption_channels
    return cfg.cross_attention_dim, cfg.audio_cross_attention_dim


def _stacked(rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.stack(rope, dim=1)  # (B, 2, ...): the batch first, as every stream


class LTX2Embed(nn.Module):
    _PARTS = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope", "proj_in", "audio_proj_in",
              "time_embed", "audio_time_embed", "av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate",
              "av_cross_attn_audio_scale_shift", "av_cross_attn_audio_v2a_gate", "prompt_adaln",
              "audio_prompt_adaln", "caption_projection", "audio_caption_projection")

    def __init__(self, model: LTX2VideoTransformer3DModel):
        super().__init__()
        for name in self._PARTS:  # the model's own modules (those its config has)
            if hasattr(model, name):
                setattr(self, name, getattr(model, name))
        self.cfg = model.config
        self.prompted = bool(model.prompt_modulation and model.config.use_prompt_adaln_single)

    def forward(self, sample, timestep, encoder_hidden_states, video_coords, audio_coords):
        cfg = self.cfg
        batch, videos = sample.shape[0], video_coords.shape[2]
        streams = {"rope": _stacked(self.rope(video_coords)), "rope_audio": _stacked(self.audio_rope(audio_coords)),
                   "rope_ca": _stacked(self.cross_attn_rope(video_coords[:, 0:1])),
                   "rope_ca_audio": _stacked(self.cross_attn_audio_rope(audio_coords[:, 0:1]))}
        h, audio = self.proj_in(sample[:, :videos]), self.audio_proj_in(sample[:, videos:])
        t = timestep.flatten()

        def embedded(norm, value, dtype):
            out, embedded_timestep = norm(value, batch_size=batch, hidden_dtype=dtype)
            return out.view(batch, -1, out.shape[-1]), embedded_timestep.view(batch, -1, embedded_timestep.shape[-1])

        gate_scale = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
        streams["temb"], streams["out_mod"] = embedded(self.time_embed, t, h.dtype)
        streams["temb_audio"], streams["audio_out_mod"] = embedded(self.audio_time_embed, t, audio.dtype)
        streams["ca_shift"] = embedded(self.av_cross_attn_video_scale_shift, t, h.dtype)[0]
        streams["ca_gate"] = embedded(self.av_cross_attn_video_a2v_gate, t * gate_scale, h.dtype)[0]
        streams["ca_audio_shift"] = embedded(self.av_cross_attn_audio_scale_shift, t, audio.dtype)[0]
        streams["ca_audio_gate"] = embedded(self.av_cross_attn_audio_v2a_gate, t * gate_scale, audio.dtype)[0]
        if self.prompted:  # LTX-2.3: sigma is the timestep (the pipeline's)
            streams["temb_prompt"] = embedded(self.prompt_adaln, t, h.dtype)[0]
            streams["temb_prompt_audio"] = embedded(self.audio_prompt_adaln, t, audio.dtype)[0]
        context, audio_context = encoder_hidden_states.split(caption_widths(cfg), dim=-1)
        if cfg.use_prompt_embeddings:
            context = self.caption_projection(context).view(batch, -1, h.shape[-1])
            audio_context = self.audio_caption_projection(audio_context).view(batch, -1, audio.shape[-1])
        return dict(streams, h=h, audio=audio, context=context, audio_context=audio_context)


class _Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, audio, context, audio_context, temb, temb_audio, ca_shift, ca_audio_shift, ca_gate,
                ca_audio_gate, rope, rope_audio, rope_ca, rope_ca_audio, temb_prompt=None, temb_prompt_audio=None):
        h, audio = self.block(hidden_states=h, audio_hidden_states=audio, encoder_hidden_states=context,
                              audio_encoder_hidden_states=audio_context, temb=temb, temb_audio=temb_audio,
                              temb_ca_scale_shift=ca_shift, temb_ca_audio_scale_shift=ca_audio_shift,
                              temb_ca_gate=ca_gate, temb_ca_audio_gate=ca_audio_gate, temb_prompt=temb_prompt,
                              temb_prompt_audio=temb_prompt_audio, video_rotary_emb=rope.unbind(1),
                              audio_rotary_emb=rope_audio.unbind(1), ca_video_rotary_emb=rope_ca.unbind(1),
                              ca_audio_rotary_emb=rope_ca_audio.unbind(1))
        return {"h": h, "audio": audio}


class LTX2Out(nn.Module):
    def __init__(self, model: LTX2VideoTransformer3DModel):
        super().__init__()
        self.norm_out, self.proj_out, self.scale_shift_table = model.norm_out, model.proj_out, model.scale_shift_table
        self.audio_norm_out, self.audio_proj_out = model.audio_norm_out, model.audio_proj_out
        self.audio_scale_shift_table = model.audio_scale_shift_table

    @staticmethod
    def _out(norm, proj, table, x, modulation):
        shift, scale = (table[None, None] + modulation[:, :, None]).unbind(2)
        return proj(norm(x) * (1 + scale) + shift)

    def forward(self, h, audio, out_mod, audio_out_mod):
        video = self._out(self.norm_out, self.proj_out, self.scale_shift_table, h, out_mod)
        audio = self._out(self.audio_norm_out, self.audio_proj_out, self.audio_scale_shift_table, audio, audio_out_mod)
        return {"prediction": torch.cat((video, audio), dim=1)}


def ltx2_backbone(model: LTX2VideoTransformer3DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states", "video_coords", "audio_coords")
    prompted = bool(model.prompt_modulation and model.config.use_prompt_adaln_single)
    prompts = ("temb_prompt", "temb_prompt_audio") if prompted else ()
    streams = ("h", "audio", "context", "audio_context") + _MODULATIONS + _ROPES + prompts
    units = [Unit("embed", LTX2Embed(model), ("sample",) + conditions, streams + ("out_mod", "audio_out_mod"))]
    units += [Unit(f"block.{i}", _Block(b), streams, ("h", "audio"))
              for i, b in enumerate(model.transformer_blocks)]
    units.append(Unit("out", LTX2Out(model), ("h", "audio", "out_mod", "audio_out_mod"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class LTX2Family(ModelFamily):
    """LTX-2: a clip's video and audio denoised together (flow matching); captions from Gemma 3 through the
    pipeline's text connectors (text.py)."""

    name = "ltx2"
    model_class = LTX2VideoTransformer3DModel
    component = "transformer"
    presets = LTX2_PRESETS
    pipelines = ("LTX2Pipeline",)
    default_objective = "flow_matching"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    sequence_refusal = "pipeline.sequence_parallel is not built for LTX-2 yet: set pipeline.sequence_parallel = 1"
    release_layout = LIGHTRICKS  # Lightricks' single files (ltx-2-19b-dev.safetensors): release_layout.py

    def check_supported(self, model):
        cfg = model.config
        if (cfg.patch_size, cfg.patch_size_t, cfg.audio_patch_size, cfg.audio_patch_size_t) != (1, 1, 1, 1):
            raise ValueError("LTX-2 configs with patches larger than 1 are not supported: the released ones read "
                             "each latent as a token")
        if cfg.in_channels != cfg.audio_in_channels or cfg.out_channels != cfg.audio_out_channels:
            raise ValueError(f"this LTX-2 transformer reads video tokens {cfg.in_channels} wide and audio tokens "
                             f"{cfg.audio_in_channels} wide: diffpipe lays a sample's audio tokens after its video's "
                             "in one tensor, which needs them equally wide (128 and 128 in the release)")

    def describe(self, model, granularity):
        return ltx2_backbone(model)

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.LTX2Pipeline

    def comfyui_lora_names(self, cfg, modules):
        """`diffusion_model.` and the release's names (release_layout.py), which ComfyUI's LTX-2 model (its LTXAV,
        Lightricks' names) maps onto its own weights (comfy/lora.py `model_lora_keys_unet`)."""
        return {m: f"diffusion_model.{release_name(m)}" for m in modules}

    def latent_channels(self, cfg):
        return cfg.in_channels

    def default_latent_size(self, cfg):
        return 4 if cfg.in_channels == 8 else 16  # 512 pixels through the 32x VAE; the digits' 4 x 4

    def latent_frames(self, cfg):
        """The video's latent frames: 16 of 121 frames (LTX2Pipeline's default); the digits' 2."""
        return 2 if cfg.in_channels == 8 else 16

    def sample_frames(self, cfg, frames, latent_size):
        return sample_frames(cfg, frames, *latent_size)

    def text_widths(self, cfg):
        return sum(caption_widths(cfg)), 0  # the video's and the audio's caption states side by side

    def folder_text_encoder(self, folder):
        from .text import LTX2Text

        return LTX2Text.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs
        from .text import connector_widths

        return sum(connector_widths(text_encoder_configs(folder, ("connectors",))[0])), 0

    def folder_vae(self, folder):
        from .codec import AudioVideoCodec

        return AudioVideoCodec.from_folder(folder)

    def folder_text_length(self, folder):
        from .text import LTX2_TEXT_TOKENS

        return LTX2_TEXT_TOKENS

    def conditions(self, cfg, text: TextBatch):
        frames, height, width = text.latent_size
        batch, device = text.hidden.shape[0], text.hidden.device
        videos = video_frames_of(cfg, frames, height, width)
        return {"encoder_hidden_states": text.hidden,
                "video_coords": video_coords(cfg, batch, videos, height, width, device),
                "audio_coords": audio_coords(cfg, batch, audio_latent_frames(cfg, videos), device)}

    def pack(self, cfg, latents):
        """(B, C, F + A, H, W) -> (B, F * H * W + audio tokens, C): the video's tokens then the audio's."""
        b, c, frames, h, w = latents.shape
        videos = video_frames_of(cfg, frames, h, w)
        tokens = latents.permute(0, 2, 3, 4, 1).reshape(b, frames * h * w, c)
        return tokens[:, :videos * h * w + audio_latent_frames(cfg, videos)]

    def unpack_prediction(self, cfg, prediction, latent_size):
        frames, h, w = latent_size
        b, n, c = prediction.shape
        padded = torch.cat((prediction, prediction.new_zeros(b, frames * h * w - n, c)), dim=1)
        return padded.reshape(b, frames, h, w, c).permute(0, 4, 1, 2, 3)

    def diffusers_forward(self, model, sample, conditions):
        coords = conditions["video_coords"]
        video, audio = sample[:, :coords.shape[2]], sample[:, coords.shape[2]:]
        context, audio_context = conditions["encoder_hidden_states"].split(caption_widths(model.config), dim=-1)
        out = model(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=context,
                    audio_encoder_hidden_states=audio_context, timestep=conditions["timestep"],
                    sigma=conditions["timestep"], video_coords=coords, audio_coords=conditions["audio_coords"],
                    return_dict=False)
        return torch.cat(out, dim=1)

    def reset_own_parameters(self, module):
        """The output modulation tables (`scale_shift_table`, `audio_scale_shift_table`) as diffusers draws them:
        randn / sqrt(width); the blocks' own tables likewise."""
        own = dict(module.named_parameters(recurse=False))
        if not own or not all(name.endswith("scale_shift_table") for name in own):
            return False
        for p in own.values():
            p.normal_().div_(p.shape[-1] ** 0.5)
        return True


def video_coords(cfg, batch: int, frames: int, height: int, width: int, device) -> torch.Tensor:
    """(B, 3, F * H * W, 2) the video tokens' bounds in pixel space and seconds, as LTX2Pipeline prepares them."""
    rope = _rope_of(cfg, "video")
    return rope.prepare_video_coords(batch, frames, height, width, device, fps=FRAME_RATE)


def audio_coords(cfg, batch: int, frames: int, device) -> torch.Tensor:
    """(B, 1, frames, 2) the audio tokens' bounds in seconds, as LTX2Pipeline prepares them."""
    return _rope_of(cfg, "audio").prepare_audio_coords(batch, frames, device)


def _rope_of(cfg, modality: str):
    """The model's rotary embedding of `modality`, built from its config alone (no weights: it holds none)."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    if modality == "video":
        return LTX2AudioVideoRotaryPosEmbed(
            dim=cfg.num_attention_heads * cfg.attention_head_dim, patch_size=cfg.patch_size,
            patch_size_t=cfg.patch_size_t, base_num_frames=cfg.pos_embed_max_pos, base_height=cfg.base_height,
            base_width=cfg.base_width, scale_factors=cfg.vae_scale_factors, theta=cfg.rope_theta,
            causal_offset=cfg.causal_offset, modality="video", double_precision=cfg.rope_double_precision,
            rope_type=cfg.rope_type, num_attention_heads=cfg.num_attention_heads)
    return LTX2AudioVideoRotaryPosEmbed(
        dim=cfg.audio_num_attention_heads * cfg.audio_attention_head_dim, patch_size=cfg.audio_patch_size,
        patch_size_t=cfg.audio_patch_size_t, base_num_frames=cfg.audio_pos_embed_max_pos,
        sampling_rate=cfg.audio_sampling_rate, hop_length=cfg.audio_hop_length, scale_factors=[cfg.audio_scale_factor],
        theta=cfg.rope_theta, causal_offset=cfg.causal_offset, modality="audio",
        double_precision=cfg.rope_double_precision, rope_type=cfg.rope_type,
        num_attention_heads=cfg.audio_num_attention_heads)

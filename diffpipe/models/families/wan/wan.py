"""Adapter for diffusers' `WanTransformer3DModel` (Wan 2.1 text-to-video): clips of frames through the pipeline.

Units: `embed` (the 3-D patch embedding, the time and text embeddings, and the rotary embedding of every
frame/row/column position), each transformer block `block.i`, and `out` (the modulated output norm and
projection). Named tensors: `h` (video tokens, frames x rows x columns), `context` (text tokens), `temb`, `tproj`
(the six modulations each block reads) and `rope` (cosines and sines stacked, computed once and sent on, as for
Flux). The backbone reads latents (B, C, F, H, W) and predicts in its token layout, unpatchified outside the
pipeline, so no later stage needs the clip's frame count or size. Timesteps reach the model as diffusers' Wan
pipeline gives them (t x 1000).
"""
from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanRotaryPosEmbed
from torch import nn

from ...family import ModelFamily, TextBatch
from .attention import Fp8WanAttnProcessor
from .release_layout import WAN, original_wan_name
from ...units import Backbone, Unit

__all__ = ["WanFamily", "wan_backbone", "WAN_PRESETS"]

WAN_PRESETS = {
    "t2v-1.3b": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    "t2v-14b": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers' transformer/config.json: 5.0 B parameters over its 16x VAE's 48 channels
    "ti2v-5b": dict(patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48,
                    out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    # clips of 1-channel 8x8 frames (moving digits): 4 frames of 16 tokens each
    "digits": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=1, out_channels=1,
                   text_dim=32, freq_dim=32, ffn_dim=128, num_layers=4, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64),
}


class WanEmbed(nn.Module):
    def __init__(self, model: WanTransformer3DModel):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = model.rope, model.patch_embedding, model.condition_embedder

    def forward(self, sample, timestep, encoder_hidden_states):
        cos, sin = self.rope(sample)
        h = self.patch_embedding(sample).flatten(2).transpose(1, 2).contiguous()
        temb, tproj, context, _ = self.condition_embedder(timestep, encoder_hidden_states, None)
        return {"h": h, "context": context, "temb": temb, "tproj": tproj.unflatten(1, (6, -1)),
                "rope": torch.stack((cos, sin))}


class _Block(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h, context, tproj, rope):
        return {"h": self.block(h, context, tproj, (rope[0], rope[1]))}


class _Out(nn.Module):
    def __init__(self, model: WanTransformer3DModel):
        super().__init__()
        # the model's own parameter, held directly (materialise fills parameters in place, so it gets the weights)
        self.norm_out, self.proj_out, self.scale_shift_table = model.norm_out, model.proj_out, model.scale_shift_table

    def forward(self, h, temb):
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        h = (self.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        return {"prediction": self.proj_out(h)}


def wan_backbone(model: WanTransformer3DModel) -> Backbone:
    conditions = ("timestep", "encoder_hidden_states")
    streams = ("h", "context", "temb", "tproj", "rope")
    units = [Unit("embed", WanEmbed(model), ("sample",) + conditions, streams)]
    units += [Unit(f"block.{i}", _Block(b), ("h", "context", "tproj", "rope"), ("h",)) for i, b in enumerate(model.blocks)]
    units.append(Unit("out", _Out(model), ("h", "temb"), ("prediction",)))
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model,
                    tables=("rope",))


class WanFamily(ModelFamily):
    """Wan 2.1 text-to-video: umT5's hidden states (from a WanPipeline folder; a tiny stand-in encoder of its width
    without one); flow matching. Latents are clips (B, C, F, H, W)."""

    name = "wan"
    model_class = WanTransformer3DModel
    component = "transformer"
    presets = WAN_PRESETS
    release_layout = WAN  # its own releases' single-file layout
    pipelines = ("WanPipeline",)  # WanImageToVideoPipeline's folders: wan_i2v (the same transformer class)
    # Wan LoRA files in this layout carry no `.alpha` outside the blocks (diffusion-pipe's; diffusers' reader of them
    # refuses a `head.head.alpha`): the scale goes into lora_up, which ComfyUI and diffusers then take at 1
    comfyui_lora_alpha = False
    fp8_attention_processors = {WanAttnProcessor: Fp8WanAttnProcessor}  # train.fp8_attention: its self-attention
    # the video tokens and their rotary table (cos and sin stacked: 2, 1, tokens, 1, width) split over a sample's
    # processes; the text tokens stay whole, which only the cross-attentions read
    sequence_streams = {"h": 1, "rope": 2}
    sequence_pads = True

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.WanPipeline

    def comfyui_lora_names(self, cfg, modules):
        """`diffusion_model.` and Wan's own layout: ComfyUI maps every weight of its Wan model under that name (and
        diffusers and diffusion-pipe read the same files)."""
        names = {}
        for m in modules:
            try:
                names[m] = f"diffusion_model.{original_wan_name(m)}"
            except KeyError:
                raise ValueError(f"no layer of Wan's own layout is known for {m!r}: train adapter.target_modules "
                                 "among the attention projections (to_q/to_k/to_v/to_out.0), ffn.net.0.proj/ffn.net.2 and the embedders")
        return names

    def check_supported(self, model):
        cfg = model.config
        if cfg.image_dim is not None or cfg.added_kv_proj_dim is not None or cfg.pos_embed_seq_len is not None:
            raise ValueError("this Wan transformer reads a CLIP embedding of a picture (image_dim, added_kv_proj_dim, "
                             "pos_embed_seq_len: Wan 2.1's image-to-video): train it with model.architecture = "
                             "\"wan_i2v\"")
        if cfg.in_channels != cfg.out_channels:
            raise ValueError(f"this Wan transformer reads {cfg.in_channels} channels and predicts {cfg.out_channels}: "
                             "an image-to-video one (the first frame beside the latents); train it with "
                             "model.architecture = \"wan_i2v\"")

    def describe(self, model, granularity):
        return wan_backbone(model)

    def latent_channels(self, cfg):
        return cfg.in_channels

    def default_latent_size(self, cfg):
        if cfg.out_channels == 1:
            return 8  # digits clips
        return 30 if cfg.out_channels == 48 else 60  # 480 x 480 pixels through Wan 2.2's 16x VAE (48 channels), 2.1's 8x

    def latent_frames(self, cfg):
        return 4 if cfg.out_channels == 1 else 21  # Wan's VAE: 81 frames -> 1 + 80 / 4 latent frames

    def latent_multiple(self, cfg):
        return cfg.patch_size[1]

    def text_widths(self, cfg):
        return cfg.text_dim, 0

    def conditions(self, cfg, text: TextBatch):
        return {"encoder_hidden_states": text.hidden}

    def folder_text_encoder(self, folder):
        from .text import WanText

        return WanText.from_folder(folder)

    def folder_text_widths(self, folder):
        from ...folder import text_encoder_configs

        return text_encoder_configs(folder)[0]["d_model"], 0

    def folder_text_length(self, folder):
        from .text import WAN_T5_TOKENS

        return WAN_T5_TOKENS

    def pack_prediction(self, cfg, latents):
        """(B, C, F, H, W) -> (B, F/pt * H/ph * W/pw, pt * ph * pw * C): the model's tokens before it unpatchifies."""
        b, c, f, h, w = latents.shape
        pt, ph, pw = cfg.patch_size
        out = latents.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
        return out.reshape(b, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)

    def unpack_prediction(self, cfg, prediction, latent_size):
        """As the end of WanTransformer3DModel.forward; latent_size = (frames, height, width)."""
        (f, h, w), (pt, ph, pw) = latent_size, cfg.patch_size
        b = prediction.shape[0]
        out = prediction.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def diffusers_forward(self, model, sample, conditions):
        out = model(hidden_states=sample, timestep=conditions["timestep"],
                    encoder_hidden_states=conditions["encoder_hidden_states"], return_dict=False)[0]
        return self.pack_prediction(model.config, out)

    def reset_own_parameters(self, module):
        """Wan's modulation tables (the model's and each block's `scale_shift_table`), drawn as diffusers draws them:
        randn / sqrt(width)."""
        own = list(module.parameters(recurse=False))
        if not own or any(name != "scale_shift_table" for name, _ in module.named_parameters(recurse=False)):
            return False
        for p in own:
            p.normal_().div_(p.shape[-1] ** 0.5)
        return True

    def constructor_buffers(self, model):
        """The rotary tables WanRotaryPosEmbed's constructor computes, built again on the CPU."""
        cfg = model.config
        with torch.device("cpu"):
            rope = WanRotaryPosEmbed(cfg.attention_head_dim, cfg.patch_size, cfg.rope_max_seq_len)
        return {f"rope.{name}": buffer for name, buffer in rope.named_buffers()}

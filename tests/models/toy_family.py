"""A model family defined outside diffpipe, as a user would add one: `model.architecture =
"tests.models.toy_family:ToyFamily"`. A tiny transformer over the pixels of 1-channel 8x8 images (digits) whose
input and output layers share one norm, so splitting it puts a tied weight on its first and last stage."""
from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from diffpipe.models.family import ModelFamily, TextBatch
from diffpipe.models.units import Backbone, Unit


class _Block(nn.Module):
    def __init__(self, width: int, text_width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        # no key bias: attention is blind to it, so its gradient is rounding noise (as diffusers' attention)
        self.to_q = nn.Linear(width, width, bias=False)
        self.to_k, self.to_v = nn.Linear(text_width, width, bias=False), nn.Linear(text_width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h, temb, text):
        x = self.norm(h) + temb[:, None]
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in (self.to_q(x), self.to_k(text), self.to_v(text)))
        h = h + nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return h + self.mlp(x)


class ToyTiedModel(ModelMixin, ConfigMixin):
    """Pixels as tokens; `shared_norm` normalises both the embedded input and the last hidden state."""

    @register_to_config
    def __init__(self, channels: int = 1, width: int = 32, depth: int = 4, text_width: int = 32):
        super().__init__()
        self.time_proj = Timesteps(width, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(width, width)
        self.proj_in = nn.Linear(channels, width)
        self.shared_norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(_Block(width, text_width) for _ in range(depth))
        self.proj_out = nn.Linear(width, channels)

    def forward(self, sample, timestep, encoder_hidden_states):
        b, c, height, width = sample.shape
        temb = self.time_embed(self.time_proj(timestep).to(sample.dtype))
        h = self.shared_norm(self.proj_in(sample.flatten(2).transpose(1, 2)))
        for block in self.blocks:
            h = block(h, temb, encoder_hidden_states)
        out = self.proj_out(self.shared_norm(h))
        return out.transpose(1, 2).reshape(b, c, height, width)


class _In(nn.Module):
    def __init__(self, model: ToyTiedModel):
        super().__init__()
        self.time_proj, self.time_embed = model.time_proj, model.time_embed
        self.proj_in, self.shared_norm = model.proj_in, model.shared_norm

    def forward(self, sample, timestep):
        temb = self.time_embed(self.time_proj(timestep).to(sample.dtype))
        return {"h": self.shared_norm(self.proj_in(sample.flatten(2).transpose(1, 2))), "temb": temb}


class _BlockUnit(nn.Module):
    def __init__(self, block: _Block):
        super().__init__()
        self.block = block

    def forward(self, h, temb, encoder_hidden_states):
        return {"h": self.block(h, temb, encoder_hidden_states)}


class _Out(nn.Module):
    def __init__(self, model: ToyTiedModel):
        super().__init__()
        self.shared_norm, self.proj_out = model.shared_norm, model.proj_out  # the same norm as _In's

    def forward(self, h):
        return {"prediction": self.proj_out(self.shared_norm(h))}


class ToyFamily(ModelFamily):
    name = "toy"
    model_class = ToyTiedModel
    component = "transformer"
    presets = {"digits": {}}
    lora_targets = ("proj_in", "proj_out")

    def describe(self, model, granularity):
        units = [Unit("in", _In(model), ("sample", "timestep"), ("h", "temb"))]
        units += [Unit(f"block.{i}", _BlockUnit(b), ("h", "temb", "encoder_hidden_states"), ("h",))
                  for i, b in enumerate(model.blocks)]
        units.append(Unit("out", _Out(model), ("h",), ("prediction",)))
        return Backbone(units, ("sample",), ("timestep", "encoder_hidden_states"), "prediction", model)

    def latent_channels(self, cfg):
        return cfg.channels

    def default_latent_size(self, cfg):
        return 8

    def text_widths(self, cfg):
        return cfg.text_width, 0

    def conditions(self, cfg, text: TextBatch):
        return {"encoder_hidden_states": text.hidden}

    def pack_prediction(self, cfg, latents):  # the last unit leaves the pixels as tokens (B, H*W, C)
        return latents.flatten(2).transpose(1, 2)

    def unpack_prediction(self, cfg, prediction, latent_size):
        return prediction.transpose(1, 2).unflatten(2, latent_size)

    def diffusers_forward(self, model, sample, conditions):
        out = model(sample, conditions["timestep"], conditions["encoder_hidden_states"])
        return self.pack_prediction(model.config, out)

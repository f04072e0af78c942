"""Adapter for Flux.1 Kontext (diffusers' `FluxKontextPipeline`): Flux's own `FluxTransformer2DModel`, trained to edit
a control image (data.control_path: the picture each training picture was made from).

The control image's latents are packed 2x2 as the picture's and appended after its tokens, with position ids whose
first coordinate is 1 (the picture's are 0), as FluxKontextPipeline feeds them; the prediction is the picture's
tokens only (the pipeline's `noise_pred[:, : latents.size(1)]`). The control's tokens (`reference`) and position ids
(`reference_ids`) are conditions every stage is given: `embed` joins them to the picture's and `out` cuts them back
off, so only Flux's `h`, `context`, `temb` and `rope` cross a boundary. Without a control image (data without
data.control_path, the sample grid's text-only prompts) the model is fed no reference tokens: Kontext as a
text-to-image model, as the pipeline without `image`.
"""
from __future__ import annotations

import torch
from torch import nn

from ...family import TextBatch
from .flux import FluxEmbed, FluxFamily, FluxOut, flux_backbone, image_ids
from ...tokens import pack_latents
from ...units import Backbone, Unit

__all__ = ["FluxKontextFamily", "reference_ids"]


def reference_ids(latent_size: tuple[int, int], device=None) -> torch.Tensor:
    """Position ids of a control image's packed tokens: (1, row, column), as FluxKontextPipeline.prepare_latents."""
    ids = image_ids(latent_size, device)
    ids[:, 0] = 1
    return ids


class _KontextEmbed(FluxEmbed):
    def forward(self, sample, reference, timestep, pooled_projections, encoder_hidden_states, img_ids, reference_ids,
                txt_ids, guidance=None):
        joined = torch.cat((img_ids, reference_ids), dim=1)
        return super().forward(torch.cat((sample, reference), dim=1), timestep, pooled_projections,
                               encoder_hidden_states, joined, txt_ids, guidance)


class _KontextOut(FluxOut):
    def forward(self, h, temb, reference):
        return super().forward(h[:, :h.shape[1] - reference.shape[1]], temb)


def kontext_backbone(model: nn.Module) -> Backbone:
    """Flux's units, with an `embed` that joins the control's tokens and an `out` that cuts them off."""
    flux = flux_backbone(model)
    conditions = flux.conditions + ("reference", "reference_ids")
    units = [Unit("embed", _KontextEmbed(model), ("sample",) + conditions, flux.units[0].writes), *flux.units[1:-1],
             Unit("out", _KontextOut(model), ("h", "temb", "reference"), ("prediction",))]
    return Backbone(units=units, inputs=("sample",), conditions=conditions, output="prediction", model=model)


class FluxKontextFamily(FluxFamily):
    """Flux.1 Kontext: Flux's text encoders, latents and objective; a control image's tokens beside the picture's."""

    sequence_streams = {}
    sequence_refusal = ("its prediction is the first part of the picture's tokens joined with the control's, which "
                        "a share of the tokens does not hold: not built yet")

    name = "flux_kontext"
    reads_control = True
    pipelines = ("FluxKontextPipeline",)

    def diffusers_lora_pipeline(self, cfg):
        import diffusers

        return diffusers.FluxKontextPipeline

    def describe(self, model, granularity):
        return kontext_backbone(model)

    def conditions(self, cfg, text: TextBatch):
        named = super().conditions(cfg, text)
        batch, device = text.hidden.shape[0], text.hidden.device
        if text.control is None:
            named["reference"] = torch.zeros(batch, 0, cfg.in_channels, device=device)
            named["reference_ids"] = torch.zeros(batch, 0, 3, device=device)
        else:
            named["reference"] = pack_latents(text.control)
            named["reference_ids"] = reference_ids(tuple(text.control.shape[2:]), device).expand(batch, -1, -1)
        return named

    def diffusers_forward(self, model, sample, conditions):
        joined = torch.cat((sample, conditions["reference"]), dim=1)
        ids = torch.cat((conditions["img_ids"][0], conditions["reference_ids"][0]))
        out = model(hidden_states=joined, timestep=conditions["timestep"] / 1000, guidance=conditions.get("guidance"),
                    pooled_projections=conditions["pooled_projections"],
                    encoder_hidden_states=conditions["encoder_hidden_states"], img_ids=ids,
                    txt_ids=conditions["txt_ids"][0], return_dict=False)[0]
        return out[:, :sample.shape[1]]

"""Flux transformer weights in Black Forest Labs' layout (their releases, ComfyUI and most shared fine-tunes:
`double_blocks.0.img_attn.qkv.weight`, `single_blocks.0.linear1.weight`, ...) and diffusers' layout.

Flux.1's names (`FLUX1`) in the scheme BFL's releases share with FLUX.2 (models/bfl_layout.py: the fused `qkv` and
`linear1`, norms as `.scale`, the final modulation's halves swapped). Both directions read the widths from the
weights, so any size converts (diffusers' own reader, `convert_flux_transformer_checkpoint_to_diffusers`, assumes
Flux.1's 3072; a test checks the two agree at that width).

Chroma's releases (`CHROMA`) keep BFL's names for what they kept of Flux.1-schnell: no modulation layers (`img_mod`,
`txt_mod`, `modulation`, the final layer's `adaLN_modulation`) and no time, text or guidance embedders; instead the
`distilled_guidance_layer` (its `layers.i.in_layer` / `out_layer` are diffusers' `linear_1` / `linear_2`, its
`norms.i.scale` diffusers' `.weight`), as diffusers' `convert_chroma_transformer_checkpoint_to_diffusers` reads them.
"""
from __future__ import annotations

import torch

from ...bfl_layout import (DOUBLE_NORMS, DOUBLE_QKV, FINAL_MODULATION, SINGLE_NORMS, BflNames, count_blocks,
                           from_bfl, is_bfl_layout, is_flux2_layout, to_bfl)
from ...family import ReleaseLayout, unprefixed

__all__ = ["BFL", "CHROMA", "FLUX1", "is_bfl_layout", "is_chroma_layout", "flux_from_bfl", "flux_to_bfl"]

FLUX1 = BflNames(
    top={"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
         "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
         "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
         "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
         "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
         "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
         "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2"},
    double={"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear", "img_attn.proj": "attn.to_out.0",
            "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
            "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"},
    double_norms=DOUBLE_NORMS,
    double_fused=DOUBLE_QKV,
    single={"modulation.lin": "norm.linear", "linear2": "proj_out"},
    single_norms=SINGLE_NORMS,
    single_fused={"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")},
    swapped=FINAL_MODULATION)
# what Chroma pruned from Flux.1-schnell: the modulation layers and the embedders of time, pooled text and guidance
_PRUNED = ("time_in.", "vector_in.", "guidance_in.", "final_layer.adaLN_modulation.", ".img_mod.", ".txt_mod.",
           ".modulation.")
_GUIDANCE_LAYER = "distilled_guidance_layer."


def _rules(double: int, single: int, guidance_layers: int = 0) -> list[tuple[str, tuple[str, ...], str]]:
    """Flux.1's rules (`BflNames.rules`); with `guidance_layers` (Chroma's distilled guidance layer), Chroma's:
    Flux's less what it pruned, plus that layer."""
    rules = FLUX1.rules(double, single)
    if not guidance_layers:
        return rules
    rules = [rule for rule in rules if not any(part in rule[0] for part in _PRUNED)]
    g = _GUIDANCE_LAYER
    for end in ("weight", "bias"):
        rules += [(f"{g}{name}.{end}", (f"{g}{name}.{end}",), "same") for name in ("in_proj", "out_proj")]
        for i in range(guidance_layers):
            rules += [(f"{g}layers.{i}.in_layer.{end}", (f"{g}layers.{i}.linear_1.{end}",), "same"),
                      (f"{g}layers.{i}.out_layer.{end}", (f"{g}layers.{i}.linear_2.{end}",), "same")]
    rules += [(f"{g}norms.{i}.scale", (f"{g}norms.{i}.weight",), "same") for i in range(guidance_layers)]
    return rules


def is_chroma_layout(keys) -> bool:
    """Whether weight names are a Chroma release's: BFL's, with the distilled guidance layer."""
    return is_bfl_layout(keys) and any(unprefixed(k).startswith(_GUIDANCE_LAYER) for k in keys)


def flux_from_bfl(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL-layout Flux.1 or Chroma state dict under diffusers' names; KeyError naming a weight it does not know or
    lacks."""
    theirs = {unprefixed(k): v for k, v in weights.items()}
    double = count_blocks(theirs, r"double_blocks\.(\d+)\.")
    single = count_blocks(theirs, r"single_blocks\.(\d+)\.")
    guidance_layers = count_blocks(theirs, r"distilled_guidance_layer\.layers\.(\d+)\.")
    return from_bfl(theirs, _rules(double, single, guidance_layers), theirs["img_in.weight"].shape[0])


def flux_to_bfl(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Flux.1 or Chroma state dict under BFL's names (no prefix, as BFL releases it)."""
    double = count_blocks(weights, r"transformer_blocks\.(\d+)\.")
    single = count_blocks(weights, r"single_transformer_blocks\.(\d+)\.")
    guidance_layers = count_blocks(weights, r"distilled_guidance_layer\.layers\.(\d+)\.")
    return to_bfl(weights, _rules(double, single, guidance_layers))


def _is_flux1_layout(keys) -> bool:
    return is_bfl_layout(keys) and not is_chroma_layout(keys) and not is_flux2_layout(keys)


BFL = ReleaseLayout("BFL", _is_flux1_layout, lambda weights, cfg: flux_from_bfl(weights),
                    lambda weights, cfg: flux_to_bfl(weights))
CHROMA = ReleaseLayout("Chroma", is_chroma_layout, lambda weights, cfg: flux_from_bfl(weights),
                       lambda weights, cfg: flux_to_bfl(weights))

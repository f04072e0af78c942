"""Flux transformer weights in Black Forest Labs' layout (their releases, ComfyUI and most shared fine-tunes:
`double_blocks.0.img_attn.qkv.weight`, `single_blocks.0.linear1.weight`, ...) and diffusers' layout.

BFL fuses what diffusers keeps apart: a double block's query, key and value (`img_attn.qkv`, `txt_attn.qkv`), a
single block's query, key, value and MLP input (`linear1`); its norms' weights are `.scale`; its final modulation
puts shift before scale, diffusers scale before shift. Both directions here read the widths from the weights, so
any size converts (diffusers' own reader, `convert_flux_transformer_checkpoint_to_diffusers`, assumes Flux.1's
3072; a test checks the two agree at that width).

Chroma's releases (`CHROMA`) keep BFL's names for what they kept of Flux.1-schnell: no modulation layers (`img_mod`,
`txt_mod`, `modulation`, the final layer's `adaLN_modulation`) and no time, text or guidance embedders; instead the
`distilled_guidance_layer` (its `layers.i.in_layer` / `out_layer` are diffusers' `linear_1` / `linear_2`, its
`norms.i.scale` diffusers' `.weight`), as diffusers' `convert_chroma_transformer_checkpoint_to_diffusers` reads them.
"""
from __future__ import annotations

import re

import torch

from ...family import ReleaseLayout, unprefixed

__all__ = ["BFL", "CHROMA", "is_bfl_layout", "is_chroma_layout", "flux_from_bfl", "flux_to_bfl"]

_TOP = {"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
        "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
        "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
        "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2"}
_DOUBLE = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear", "img_attn.proj": "attn.to_out.0",
           "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
           "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
_DOUBLE_NORMS = {"img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
                 "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k"}
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"modulation.lin": "norm.linear", "linear2": "proj_out"}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_SWAPPED = {"final_layer.adaLN_modulation.1": "norm_out.linear"}
# what Chroma pruned from Flux.1-schnell: the modulation layers and the embedders of time, pooled text and guidance
_PRUNED = ("time_in.", "vector_in.", "guidance_in.", "final_layer.adaLN_modulation.", ".img_mod.", ".txt_mod.",
           ".modulation.")
_GUIDANCE_LAYER = "distilled_guidance_layer."


def _rules(double: int, single: int, guidance_layers: int = 0) -> list[tuple[str, tuple[str, ...], str]]:
    """(BFL key, diffusers keys, how they join: "same", "fused" (rows concatenated) or "swapped" (halves swapped));
    with `guidance_layers` (Chroma's distilled guidance layer), Chroma's: Flux's less what it pruned, plus that layer."""
    rules = _flux_rules(double, single)
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


def _flux_rules(double: int, single: int) -> list[tuple[str, tuple[str, ...], str]]:
    rules = []

    def add(ours: dict, theirs_prefix: str, diffusers_prefix: str, how: str, ends=("weight", "bias")):
        for theirs, mine in ours.items():
            mine = mine if isinstance(mine, tuple) else (mine,)
            for end in ends:
                rules.append((f"{theirs_prefix}{theirs}.{end}", tuple(f"{diffusers_prefix}{m}.{end}" for m in mine), how))

    add(_TOP, "", "", "same")
    add(_SWAPPED, "", "", "swapped")
    for i in range(double):
        add(_DOUBLE, f"double_blocks.{i}.", f"transformer_blocks.{i}.", "same")
        add(_DOUBLE_FUSED, f"double_blocks.{i}.", f"transformer_blocks.{i}.", "fused")
        rules += [(f"double_blocks.{i}.{t}.scale", (f"transformer_blocks.{i}.{m}.weight",), "same")
                  for t, m in _DOUBLE_NORMS.items()]
    for i in range(single):
        add(_SINGLE, f"single_blocks.{i}.", f"single_transformer_blocks.{i}.", "same")
        add(_SINGLE_FUSED, f"single_blocks.{i}.", f"single_transformer_blocks.{i}.", "fused")
        rules += [(f"single_blocks.{i}.{t}.scale", (f"single_transformer_blocks.{i}.{m}.weight",), "same")
                  for t, m in _SINGLE_NORMS.items()]
    return rules


def _count(keys, pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def is_bfl_layout(keys) -> bool:
    """Whether weight names are BFL's Flux layout (with or without ComfyUI's `model.diffusion_model.` prefix)."""
    return any(unprefixed(k).startswith("double_blocks.") and ".img_attn.qkv." in k for k in keys)


def is_chroma_layout(keys) -> bool:
    """Whether weight names are a Chroma release's: BFL's, with the distilled guidance layer."""
    return is_bfl_layout(keys) and any(unprefixed(k).startswith(_GUIDANCE_LAYER) for k in keys)


def flux_from_bfl(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL-layout Flux state dict under diffusers' names; KeyError naming a weight it does not know or lacks."""
    theirs = {unprefixed(k): v for k, v in weights.items()}
    double, single = _count(theirs, r"double_blocks\.(\d+)\."), _count(theirs, r"single_blocks\.(\d+)\.")
    guidance_layers = _count(theirs, r"distilled_guidance_layer\.layers\.(\d+)\.")
    width = theirs["img_in.weight"].shape[0]
    out = {}
    for key, mine, how in _rules(double, single, guidance_layers):
        if key not in theirs:
            if key.startswith("guidance_in."):  # Flux.1-schnell embeds no guidance
                continue
            raise KeyError(f"{key}: missing from the BFL-layout file")
        tensor = theirs.pop(key)
        if how == "swapped":
            shift, scale = tensor.chunk(2, dim=0)
            tensor = torch.cat([scale, shift], dim=0)
        if how == "fused":
            sizes = [width] * 3 + ([tensor.shape[0] - 3 * width] if len(mine) == 4 else [])
            out.update(zip(mine, (part.clone() for part in torch.split(tensor, sizes, dim=0))))
        else:
            out[mine[0]] = tensor
    if theirs:
        raise KeyError(f"{sorted(theirs)[0]}: not a weight of BFL's Flux layout ({len(theirs)} such)")
    return out


def flux_to_bfl(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Flux state dict under BFL's names (no prefix, as BFL releases it)."""
    mine = dict(weights)
    double = _count(mine, r"transformer_blocks\.(\d+)\.")
    single = _count(mine, r"single_transformer_blocks\.(\d+)\.")
    guidance_layers = _count(mine, r"distilled_guidance_layer\.layers\.(\d+)\.")
    out = {}
    for key, parts, how in _rules(double, single, guidance_layers):
        if parts[0] not in mine:
            if key.startswith("guidance_in."):
                continue
            raise KeyError(f"{parts[0]}: missing from the diffusers Flux weights")
        tensors = [mine.pop(p) for p in parts]
        tensor = torch.cat(tensors, dim=0) if how == "fused" else tensors[0]
        if how == "swapped":
            scale, shift = tensor.chunk(2, dim=0)
            tensor = torch.cat([shift, scale], dim=0)
        out[key] = tensor
    if mine:
        raise KeyError(f"{sorted(mine)[0]}: no BFL-layout name known for it ({len(mine)} such)")
    return out


BFL = ReleaseLayout("BFL", lambda keys: is_bfl_layout(keys) and not is_chroma_layout(keys),
                    lambda weights, cfg: flux_from_bfl(weights), lambda weights, cfg: flux_to_bfl(weights))
CHROMA = ReleaseLayout("Chroma", is_chroma_layout, lambda weights, cfg: flux_from_bfl(weights),
                       lambda weights, cfg: flux_to_bfl(weights))

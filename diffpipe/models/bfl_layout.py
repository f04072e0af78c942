"""Black Forest Labs' single-file layout, shared by Flux.1 (families/flux/release_layout.py) and FLUX.2
(families/flux2/release_layout.py): what each generation's names are (`BflNames`) and the conversions both use.

BFL fuses what diffusers keeps apart: a double block's query, key and value (`img_attn.qkv`, `txt_attn.qkv`), Flux.1's
single block's query, key, value and MLP input (`linear1`); its norms' weights are `.scale`; its final modulation
puts shift before scale, diffusers scale before shift. Both directions read the widths from the weights, so any size
converts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .family import unprefixed

__all__ = ["BflNames", "DOUBLE_NORMS", "DOUBLE_QKV", "FINAL_MODULATION", "SINGLE_NORMS", "count_blocks", "from_bfl",
           "is_bfl_layout", "is_flux2_layout", "to_bfl"]

# what Flux.1 and FLUX.2 name alike (diffusers' converters of both agree): a double block's norms and fused query, key
# and value, a single block's norms, the final modulation (its halves swapped)
DOUBLE_NORMS = {"img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
                "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k"}
DOUBLE_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
              "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
FINAL_MODULATION = {"final_layer.adaLN_modulation.1": "norm_out.linear"}


@dataclass(frozen=True)
class BflNames:
    """One generation's BFL names against diffusers': renamed layers (`top`, a double block's `double`, a single
    block's `single`), norms (`.scale` in BFL's files, `.weight` in diffusers'), fused layers (BFL's one weight, the
    rows of diffusers' several), `swapped` layers (the final modulation's halves in the other order). Biases are
    converted where the weights have them (FLUX.2 has none)."""

    top: dict
    double: dict
    double_norms: dict
    double_fused: dict
    single: dict
    single_norms: dict
    single_fused: dict
    swapped: dict

    def rules(self, double: int, single: int) -> list[tuple[str, tuple[str, ...], str]]:
        """(BFL key, diffusers keys, how they join: "same", "fused" (rows concatenated) or "swapped" (halves
        swapped)) for a model of `double` double and `single` single blocks."""
        rules = []

        def add(ours: dict, theirs_prefix: str, diffusers_prefix: str, how: str, ends=("weight", "bias")):
            for theirs, mine in ours.items():
                mine = mine if isinstance(mine, tuple) else (mine,)
                for end in ends:
                    rules.append((f"{theirs_prefix}{theirs}.{end}", tuple(f"{diffusers_prefix}{m}.{end}" for m in mine),
                                  how))

        add(self.top, "", "", "same")
        add(self.swapped, "", "", "swapped")
        for i in range(double):
            add(self.double, f"double_blocks.{i}.", f"transformer_blocks.{i}.", "same")
            add(self.double_fused, f"double_blocks.{i}.", f"transformer_blocks.{i}.", "fused")
            rules += [(f"double_blocks.{i}.{t}.scale", (f"transformer_blocks.{i}.{m}.weight",), "same")
                      for t, m in self.double_norms.items()]
        for i in range(single):
            add(self.single, f"single_blocks.{i}.", f"single_transformer_blocks.{i}.", "same")
            add(self.single_fused, f"single_blocks.{i}.", f"single_transformer_blocks.{i}.", "fused")
            rules += [(f"single_blocks.{i}.{t}.scale", (f"single_transformer_blocks.{i}.{m}.weight",), "same")
                      for t, m in self.single_norms.items()]
        return rules

    def layer_names(self, double: int, single: int) -> dict[str, tuple[str, str, int, int]]:
        """diffusers' linear layer -> (BFL's layer, how they join, the part's place among the fused, parts)."""
        names = {}
        for theirs, mine, how in self.rules(double, single):
            if theirs.endswith(".weight"):
                for index, part in enumerate(mine):
                    names[part.removesuffix(".weight")] = (theirs.removesuffix(".weight"), how, index, len(mine))
        return names


def count_blocks(keys, pattern: str) -> int:
    """How many blocks `pattern` (a regular expression whose group is a block's number) finds among `keys`."""
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def _optional(key: str) -> bool:
    """A weight a model may lack: Flux.1-schnell's guidance embedder, FLUX.2's biases (a missing one the model has
    is named when the converted weights are checked against it)."""
    return key.startswith("guidance_in.") or key.endswith(".bias")


def is_bfl_layout(keys) -> bool:
    """Whether weight names are BFL's layout (with or without ComfyUI's `model.diffusion_model.` prefix)."""
    return any(unprefixed(k).startswith("double_blocks.") and ".img_attn.qkv." in k for k in keys)


def is_flux2_layout(keys) -> bool:
    """Whether weight names are BFL's FLUX.2 layout: the modulations shared by every block of a kind."""
    return is_bfl_layout(keys) and any(unprefixed(k).startswith("double_stream_modulation_img.") for k in keys)


def from_bfl(theirs: dict[str, torch.Tensor], rules, width: int) -> dict[str, torch.Tensor]:
    """BFL-named weights (unprefixed) under diffusers' names by `rules` (`BflNames.rules`), a fused layer's parts
    `width` rows each (Flux.1's `linear1`: the rest its MLP's); KeyError naming a weight it does not know or lacks."""
    theirs = dict(theirs)
    out = {}
    for key, mine, how in rules:
        if key not in theirs:
            if _optional(key):
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
        raise KeyError(f"{sorted(theirs)[0]}: not a weight of BFL's layout ({len(theirs)} such)")
    return out


def to_bfl(weights: dict[str, torch.Tensor], rules) -> dict[str, torch.Tensor]:
    """diffusers-named weights under BFL's names by `rules` (no prefix, as BFL releases them)."""
    mine = dict(weights)
    out = {}
    for key, parts, how in rules:
        if parts[0] not in mine:
            if _optional(key):
                continue
            raise KeyError(f"{parts[0]}: missing from the diffusers weights")
        tensors = [mine.pop(p) for p in parts]
        tensor = torch.cat(tensors, dim=0) if how == "fused" else tensors[0]
        if how == "swapped":
            scale, shift = tensor.chunk(2, dim=0)
            tensor = torch.cat([shift, scale], dim=0)
        out[key] = tensor
    if mine:
        raise KeyError(f"{sorted(mine)[0]}: no BFL-layout name known for it ({len(mine)} such)")
    return out

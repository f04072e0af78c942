"""Z-Image transformer weights in Tongyi-MAI's release layout (ComfyUI's `z_image_turbo_bf16.safetensors`:
`layers.0.attention.qkv.weight`, `x_embedder.weight`, `final_layer.linear.weight`, ...) and diffusers' layout.

Reading goes through diffusers' own converter (`convert_z_image_transformer_checkpoint_to_diffusers`, what
`from_single_file` uses). Writing is its inverse: query, key and value concatenated into `qkv`, `q_norm` / `k_norm`
for the norms, `out` for the output projection, the one patch size's embedder and final layer without diffusers'
`2-1` key. A test round-trips every tensor through diffusers' reader.
"""
from __future__ import annotations

import re

import torch

from ...family import ReleaseLayout, unprefixed

__all__ = ["TONGYI", "z_image_from_release", "z_image_to_release"]

_RENAMED = ((".attention.norm_q.", ".attention.q_norm."), (".attention.norm_k.", ".attention.k_norm."),
            (".attention.to_out.0.", ".attention.out."))
_TOP = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."))


def z_image_from_release(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release layout under diffusers' names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers({unprefixed(k): v for k, v in weights.items()})


def z_image_to_release(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Z-Image weights under the release's names (no prefix)."""
    out = {}
    for key, value in weights.items():
        fused = re.fullmatch(r"(.+\.attention)\.to_([qkv])\.weight", key)
        if fused:
            if fused.group(2) == "q":
                out[f"{fused.group(1)}.qkv.weight"] = torch.cat(
                    [weights[f"{fused.group(1)}.to_{p}.weight"] for p in "qkv"], dim=0)
            continue
        for ours, theirs in (*_RENAMED, *_TOP):
            key = key.replace(ours, theirs) if ours.startswith(".") else (
                theirs + key[len(ours):] if key.startswith(ours) else key)
        out[key] = value
    return out


TONGYI = ReleaseLayout(
    name="Z-Image (Tongyi-MAI's release)",
    recognises=lambda keys: any(unprefixed(k).endswith(".attention.qkv.weight") for k in keys),
    to_diffusers=lambda weights, config: z_image_from_release(weights),
    from_diffusers=lambda weights, config: z_image_to_release(weights))

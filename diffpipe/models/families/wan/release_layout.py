"""Wan transformer weights in Wan's own release layout (Wan-AI's files, ComfyUI's repackaged ones, diffusion-pipe's
LoRAs: `blocks.0.self_attn.q.weight`, `head.head.weight`, ...) and diffusers' layout.

Reading goes through diffusers' own converter (`convert_wan_transformer_to_diffusers`, what `from_single_file` uses:
a renaming, so any width converts). Writing is its inverse, layer by layer: the same names diffusers' converters pair
(also for LoRA files, loaders/lora_conversion_utils.py), with Wan's cross-attention norm `norm3` where diffusers
says `norm2` and the modulation tables as `modulation`. A test round-trips every tensor through diffusers' reader.
"""
from __future__ import annotations

import re

import torch

from ...family import ReleaseLayout, unprefixed

__all__ = ["WAN", "is_wan_layout", "original_wan_name", "wan_from_original", "wan_to_original"]

_BLOCK_LAYERS = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
                 "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
                 "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "attn2.add_k_proj": "cross_attn.k_img",
                 "attn2.add_v_proj": "cross_attn.v_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
                 # not linear layers: norms and the modulation table
                 "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
                 "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
                 "attn2.norm_added_k": "cross_attn.norm_k_img", "norm2": "norm3"}
_TOP_LAYERS = {"patch_embedding": "patch_embedding", "proj_out": "head.head",
               "condition_embedder.time_proj": "time_projection.1",
               "condition_embedder.text_embedder.linear_1": "text_embedding.0",
               "condition_embedder.text_embedder.linear_2": "text_embedding.2",
               "condition_embedder.time_embedder.linear_1": "time_embedding.0",
               "condition_embedder.time_embedder.linear_2": "time_embedding.2",
               "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
               "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
               "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
               "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}


def original_wan_name(module: str) -> str:
    """A layer's path in diffusers' WanTransformer3DModel as Wan's own files name it (`blocks.3.attn1.to_q` ->
    `blocks.3.self_attn.q`); KeyError for a layer with no known counterpart."""
    parts = module.split(".")
    if parts[0] == "blocks" and len(parts) > 2:
        return f"blocks.{parts[1]}.{_BLOCK_LAYERS['.'.join(parts[2:])]}"
    return _TOP_LAYERS[module]


def _original_key(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    if re.fullmatch(r"blocks\.\d+\.scale_shift_table", key):
        return key.replace("scale_shift_table", "modulation")
    module, _, end = key.rpartition(".")
    return f"{original_wan_name(module)}.{end}"


def is_wan_layout(keys) -> bool:
    """Whether weight names are Wan's own layout (with or without a `model.diffusion_model.` prefix)."""
    return any(re.fullmatch(r"(model\.)?(diffusion_model\.)?blocks\.\d+\.self_attn\.q\.weight", k) for k in keys)


def wan_from_original(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan's own layout under diffusers' names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers({unprefixed(k): v for k, v in weights.items()})


def wan_to_original(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Wan weights under Wan's own names (no prefix, as Wan-AI releases them); KeyError naming a weight
    with no known counterpart."""
    try:
        return {_original_key(k): v for k, v in weights.items()}
    except KeyError as exc:
        raise KeyError(f"{exc.args[0]}: no name in Wan's own layout is known for this layer") from None


WAN = ReleaseLayout("Wan's own", is_wan_layout, lambda weights, cfg: wan_from_original(weights),
                    lambda weights, cfg: wan_to_original(weights))

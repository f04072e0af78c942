"""SD3 / SD3.5 transformer weights in Stability's release layout (`sd3.5_medium.safetensors` and ComfyUI's files:
`joint_blocks.0.x_block.attn.qkv.weight`, ...) and diffusers' layout.

Reading goes through diffusers' own converter (`convert_sd3_transformer_checkpoint_to_diffusers`, what
`from_single_file` uses; it reads the widths from the weights). Writing is its inverse: query, key and value
concatenated into `qkv` (the image stream's `x_block`, the text stream's `context_block`, SD3.5's second attention
`attn2`), `ln_q` / `ln_k` for the norms, shift before scale in the final modulation and in the last block's text
modulation. A test round-trips every tensor through diffusers' reader.
"""
from __future__ import annotations

import re

import torch

from ...family import ReleaseLayout, unprefixed

__all__ = ["SAI", "is_sai_layout", "sd3_from_sai", "sd3_to_sai"]

_TOP = {"pos_embed.proj": "x_embedder.proj", "context_embedder": "context_embedder", "proj_out": "final_layer.linear",
        "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2"}
_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
          "attn2.to_out.0": "x_block.attn2.proj", "norm1.linear": "x_block.adaLN_modulation.1",
          "norm1_context.linear": "context_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
          "ff.net.2": "x_block.mlp.fc2", "ff_context.net.0.proj": "context_block.mlp.fc1",
          "ff_context.net.2": "context_block.mlp.fc2"}
_NORMS = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
          "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
          "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
_FUSED = {"x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v")}


def _swapped(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def is_sai_layout(keys) -> bool:
    """Whether weight names are Stability's SD3 layout (with or without a `model.diffusion_model.` prefix)."""
    return any(re.fullmatch(r"(model\.)?(diffusion_model\.)?joint_blocks\.\d+\.x_block\.attn\.qkv\.weight", k)
               for k in keys)


def sd3_from_sai(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stability's SD3 layout under diffusers' names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    return convert_sd3_transformer_checkpoint_to_diffusers({unprefixed(k): v for k, v in weights.items()})


def sd3_to_sai(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' SD3 weights under Stability's names (no prefix, as Stability releases them); KeyError naming a
    weight with no known counterpart."""
    mine = dict(weights)
    blocks = 1 + max(int(m.group(1)) for k in mine if (m := re.match(r"transformer_blocks\.(\d+)\.", k)))
    out = {"pos_embed": mine.pop("pos_embed.pos_embed")} if "pos_embed.pos_embed" in mine else {}
    for ours, theirs in _TOP.items():
        for end in ("weight", "bias"):
            out[f"{theirs}.{end}"] = mine.pop(f"{ours}.{end}")
    for end in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{end}"] = _swapped(mine.pop(f"norm_out.linear.{end}"))
    for i in range(blocks):
        ours, theirs = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for fused, parts in _FUSED.items():
            for end in ("weight", "bias"):
                if f"{ours}{parts[0]}.{end}" in mine:
                    out[f"{theirs}{fused}.{end}"] = torch.cat([mine.pop(f"{ours}{p}.{end}") for p in parts], dim=0)
        for mine_name, their_name in _NORMS.items():
            if f"{ours}{mine_name}.weight" in mine:
                out[f"{theirs}{their_name}.weight"] = mine.pop(f"{ours}{mine_name}.weight")
        for mine_name, their_name in _BLOCK.items():
            for end in ("weight", "bias"):
                if f"{ours}{mine_name}.{end}" in mine:
                    tensor = mine.pop(f"{ours}{mine_name}.{end}")
                    last_context = i == blocks - 1 and mine_name == "norm1_context.linear"
                    out[f"{theirs}{their_name}.{end}"] = _swapped(tensor) if last_context else tensor
    if mine:
        raise KeyError(f"{sorted(mine)[0]}: no name in Stability's SD3 layout is known for it ({len(mine)} such)")
    return out


SAI = ReleaseLayout("Stability's SD3", is_sai_layout, lambda weights, cfg: sd3_from_sai(weights),
                    lambda weights, cfg: sd3_to_sai(weights))

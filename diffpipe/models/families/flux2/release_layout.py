"""FLUX.2 transformer weights in Black Forest Labs' release layout (`flux2-dev.safetensors`, the klein files, what
ComfyUI loads: `double_blocks.0.img_attn.qkv.weight`, `single_blocks.0.linear1.weight`,
`double_stream_modulation_img.lin.weight`, ...) and diffusers' layout.

FLUX.2 keeps Flux.1's scheme (models/bfl_layout.py): a double block's query, key and value
fused into `qkv`, norms' weights as `.scale`, the final modulation's halves swapped; a single block's fused input
and output (`linear1`, `linear2`) are one layer in diffusers too; no biases. Reading goes through diffusers' own
converter (`convert_flux2_transformer_checkpoint_to_diffusers`, what `from_single_file` uses); writing
(`export --format original`) and ComfyUI's LoRA names (export --format comfyui) use the tables here. A test
round-trips every tensor through diffusers' reader.
"""
from __future__ import annotations

import torch

from ...bfl_layout import (DOUBLE_NORMS, DOUBLE_QKV, FINAL_MODULATION, SINGLE_NORMS, BflNames, count_blocks,
                           is_flux2_layout, to_bfl)
from ...family import FusedRows, ReleaseLayout, unprefixed

__all__ = ["FLUX2", "FLUX2_BFL", "comfyui_names", "flux2_from_release", "flux2_to_release"]

FLUX2 = BflNames(
    top={"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
         "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
         "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
         "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
         "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
         "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
         "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
         "single_stream_modulation.lin": "single_stream_modulation.linear"},
    double={"img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.linear_in",
            "img_mlp.2": "ff.linear_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out"},
    double_norms=DOUBLE_NORMS,
    double_fused=DOUBLE_QKV,
    single={"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"},
    single_norms=SINGLE_NORMS,
    single_fused={},
    swapped=FINAL_MODULATION)


def flux2_from_release(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FLUX.2 release's transformer weights under diffusers' names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers({unprefixed(k): v for k, v in weights.items()})


def flux2_to_release(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' FLUX.2 transformer weights under BFL's names (no prefix, as BFL releases them)."""
    double = count_blocks(weights, r"transformer_blocks\.(\d+)\.")
    single = count_blocks(weights, r"single_transformer_blocks\.(\d+)\.")
    return to_bfl(weights, FLUX2.rules(double, single))


def comfyui_names(cfg, modules: list[str]) -> dict[str, str | FusedRows]:
    """Each adapted layer under `diffusion_model.` and BFL's name, which ComfyUI maps onto its FLUX.2 model's own
    weight (comfy/lora.py `model_lora_keys_unet`: every weight of the model by its own name); a double block's query,
    key and value as their rows of `qkv`."""
    layers = FLUX2.layer_names(cfg["num_layers"], cfg["num_single_layers"])
    names = {}
    for module in modules:
        if module not in layers:
            raise ValueError(f"{module} is no layer of FLUX.2 BFL's layout names: leave it out of "
                             "adapter.target_modules")
        theirs, how, part, parts = layers[module]
        if how == "swapped":
            raise ValueError(f"{module}: ComfyUI's final modulation holds its halves in the other order, which a "
                             "LoRA file cannot say: leave it out of adapter.target_modules")
        name = f"diffusion_model.{theirs}"
        names[module] = FusedRows(name, part, parts) if how == "fused" else name
    return names


FLUX2_BFL = ReleaseLayout("FLUX.2 (BFL's release)", is_flux2_layout,
                          lambda weights, cfg: flux2_from_release(weights),
                          lambda weights, cfg: flux2_to_release(weights))

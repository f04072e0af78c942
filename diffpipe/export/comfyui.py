"""--format comfyui: a LoRA under the names ComfyUI's LoRA loader maps for the run's family (comfy/lora.py,
`model_lora_keys_unet`), with kohya's `.lora_down.weight` / `.lora_up.weight` / `.alpha`, which every ComfyUI version
reads (its loader scales by alpha / rank, as peft trained):

- SD 1.x/2.x and SDXL: kohya's file (`lora_unet_...`, as --format kohya);
- Flux and SD3: diffusers' layer names under `transformer.`, which ComfyUI maps onto its fused layouts;
- Wan: `diffusion_model.` and Wan's own layer names (`blocks.0.self_attn.q`), ComfyUI's own layout for Wan LoRAs,
  without `.alpha` (the scale in `lora_up`), as diffusion-pipe writes them and diffusers reads them.

Each family says its names (`ModelFamily.comfyui_lora_names`); one it does not know is refused before writing.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ExportError
from .kohya import write_down_up
from .run import one_file

__all__ = ["check", "target", "write"]


target = one_file


def check(run) -> None:
    if not run.lora:
        raise ExportError(f"--format comfyui writes LoRA adapters, and {run.folder} trained every weight "
                          "(adapter.type = \"none\"): ComfyUI loads the full model from --format original (UNets) or "
                          "--format diffusers --out MODEL.safetensors")
    _names(run, run.adapted_modules())


def _names(run, modules: list[str]) -> dict[str, str]:
    try:
        names = run.family.comfyui_lora_names(run.model_config, modules)
    except ValueError as e:
        raise ExportError(f"--format comfyui: {e}") from None
    if names is None:
        raise ExportError(f"ComfyUI loads no LoRA of {run.family.name!r} models that diffpipe knows how to write: "
                          "use --format diffusers")
    return names


def write(run, out: Path) -> Path:
    return write_down_up(run, out, lambda modules: _names(run, modules), alpha=run.family.comfyui_lora_alpha)

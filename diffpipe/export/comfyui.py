"""--format comfyui: adapters under the names ComfyUI's LoRA loader maps for the run's family (comfy/lora.py,
`model_lora_keys_unet`), with kohya's `.lora_down.weight` / `.lora_up.weight` / `.alpha`, which every ComfyUI version
reads (its loader scales by alpha / rank, as peft trained); LoHa and LoKr in LyCORIS' keys (comfy/weight_adapter
loha.py, lokr.py), DoRA with a `.dora_scale` made for ComfyUI's arithmetic (below: unlike --format kohya's):

- SD 1.x/2.x and SDXL: kohya's file (`lora_unet_...`, as --format kohya);
- Flux and SD3: diffusers' layer names under `transformer.`, which ComfyUI maps onto its fused layouts;
- FLUX.2 and LTX-2: `diffusion_model.` and their releases' own names (BFL's, Lightricks'), a FLUX.2 double block's
  query, key and value written as one LoRA of its fused `qkv` (export/kohya.py `fused_lora`);
- Wan: `diffusion_model.` and Wan's own layer names (`blocks.0.self_attn.q`), ComfyUI's own layout for Wan LoRAs,
  without `.alpha` (the scale in `lora_up`), as diffusion-pipe writes them and diffusers reads them.

Each family says its names (`ModelFamily.comfyui_lora_names`); one it does not know is refused before writing.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ExportError
from ..models.family import FusedRows
import torch

from .kohya import write_adapters
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
    fused = sorted(m for m, name in names.items() if isinstance(name, FusedRows))
    if fused and run.config.adapter.type != "lora":
        raise ExportError(f"--format comfyui: ComfyUI's {run.family.name} fuses {fused[0]} with other layers into "
                          f"one weight, and a {run.config.adapter.type} of fused layers is not written yet: use "
                          "--format diffusers, or train adapter.type = \"lora\"")
    return names


def write(run, out: Path) -> Path:
    dora_scale = _dora_scale_for_comfyui(run) if run.config.adapter.type == "dora" else None
    return write_adapters(run, out, lambda modules: _names(run, modules), alpha=run.family.comfyui_lora_alpha,
                          dora_scale=dora_scale, fmt="comfyui")


def _dora_scale_for_comfyui(run):
    """DoRA's `.dora_scale` as ComfyUI applies it: its `weight_decompose` (comfy/weight_adapter/base.py) divides each
    output row of W + delta by the norm of the base's row |W|, where peft's DoRA divides by |W + delta|; the file
    holds m |W| / |W + delta|, so ComfyUI computes m (W + delta) / |W + delta| on the base the run trained (the base
    is built once, as at the end of training)."""
    from ..build import build_backbone
    from ..models.lora import delta_weight, lora_scale

    base = build_backbone(run.config, "cpu").model.state_dict()
    scale = lora_scale(run.config.adapter)

    def dora_scale(module: str, magnitude: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        w = base[f"{module}.weight"].float()
        adapted = w + delta_weight(adapters, module, scale, w.shape)
        rows = magnitude.float().reshape(-1) * w.flatten(1).norm(dim=1) / adapted.flatten(1).norm(dim=1)
        return rows.to(magnitude.dtype)

    return dora_scale

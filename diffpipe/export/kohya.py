"""--format kohya: a LoRA as kohya's tools write it, `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` /
`.alpha`, the module named as kohya names it (SD 1.x/2.x: the diffusers path; SDXL: the original layout's path), dots
turned to underscores; loaded by ComfyUI, A1111 and kohya's tools. UNet LoRAs only (export/comfyui.py writes the same
pairs under the names ComfyUI maps for the other families)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..errors import ExportError
from ..models.original_layout import kohya_lora_names
from ..written_files import save_tensors
from .run import one_file, only_unets

__all__ = ["check", "target", "write", "write_down_up"]


target = one_file


def check(run) -> None:
    only_unets(run, "kohya")
    if not run.lora:
        raise ExportError(f"--format kohya writes LoRA adapters, and {run.folder} trained every weight "
                          "(adapter.type = \"none\"); use --format diffusers or original")


def write(run, out: Path) -> Path:
    return write_down_up(run, out, lambda modules: kohya_lora_names(modules, run.model_config))


def write_down_up(run, out: Path, name_of, alpha: bool = True) -> Path:
    """The run's adapters as `<name>.lora_down.weight` (peft's lora_A), `.lora_up.weight` (lora_B) and `.alpha`,
    each module named by `name_of(modules)`; the loader scales by alpha / rank, as peft trained it. Without
    `alpha`, no `.alpha` is written and `lora_up` carries the scale (loaders then scale by 1)."""
    adapters = load_file(str(run.folder / "lora.safetensors"))
    with safe_open(str(run.folder / "lora.safetensors"), framework="pt") as f:
        metadata = f.metadata() or {}
    modules = sorted({k.split(".lora_A.")[0] for k in adapters if ".lora_A." in k})
    names = name_of(modules)
    adapter = run.config.adapter
    pairs, scale = {}, 1.0 if alpha else adapter.alpha / adapter.rank
    for module in modules:
        pairs[f"{names[module]}.lora_down.weight"] = adapters[f"{module}.lora_A.weight"].contiguous()
        pairs[f"{names[module]}.lora_up.weight"] = (adapters[f"{module}.lora_B.weight"] * scale).contiguous()
        if alpha:
            pairs[f"{names[module]}.alpha"] = torch.tensor(float(adapter.alpha))
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {"ss_network_module": "networks.lora", "ss_network_dim": str(adapter.rank),
              "ss_network_alpha": str(adapter.alpha), **metadata}
    return save_tensors(pairs, out, metadata=header)

"""--format kohya: a LoRA as kohya's tools write it, `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` /
`.alpha`, the module named as kohya names it (SD 1.x/2.x: the diffusers path; SDXL: the original layout's path), dots
turned to underscores; loaded by ComfyUI, A1111 and kohya's tools. UNet LoRAs only so far."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..errors import ExportError
from ..models.original_layout import ORIGINAL_PREFIX, to_original_layout
from ..written_files import save_tensors
from .run import one_file, only_unets

__all__ = ["check", "target", "write"]


target = one_file


def check(run) -> None:
    only_unets(run, "kohya")
    if not run.lora:
        raise ExportError(f"--format kohya writes LoRA adapters, and {run.folder} trained every weight "
                          "(adapter.type = \"none\"); use --format diffusers or original")


def kohya_names(modules: list[str], unet_config: dict) -> dict[str, str]:
    """Module path -> kohya's LoRA name. kohya's SDXL networks name the original layout's modules."""
    sdxl = unet_config.get("addition_embed_type") == "text_time"
    if sdxl:
        renamed = to_original_layout({f"{m}.weight": torch.empty(0) for m in modules}, unet_config)
        originals = [k.removeprefix(ORIGINAL_PREFIX).removesuffix(".weight") for k in renamed]
        pairs = zip(modules, originals)
    else:
        pairs = ((m, m) for m in modules)
    return {m: "lora_unet_" + name.replace(".", "_") for m, name in pairs}


def write(run, out: Path) -> Path:
    adapters = load_file(str(run.folder / "lora.safetensors"))
    with safe_open(str(run.folder / "lora.safetensors"), framework="pt") as f:
        metadata = f.metadata() or {}
    modules = sorted({k.split(".lora_A.")[0] for k in adapters if ".lora_A." in k})
    names = kohya_names(modules, run.model_config)
    adapter = run.config.adapter
    kohya = {}
    for module in modules:
        kohya[f"{names[module]}.lora_down.weight"] = adapters[f"{module}.lora_A.weight"].contiguous()
        kohya[f"{names[module]}.lora_up.weight"] = adapters[f"{module}.lora_B.weight"].contiguous()
        kohya[f"{names[module]}.alpha"] = torch.tensor(float(adapter.alpha))
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {"ss_network_module": "networks.lora", "ss_network_dim": str(adapter.rank),
              "ss_network_alpha": str(adapter.alpha), **metadata}
    return save_tensors(kohya, out, metadata=header)

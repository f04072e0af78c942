"""`diffpipe export RUN_DIR --format diffusers|kohya|original [--out PATH]`: a finished run's weights in the
layouts other tools load.

    diffpipe export runs/photos --format diffusers --out photos_pipeline   # full: a diffusers folder
    diffpipe export runs/lora --format diffusers --out lora_diffusers      # LoRA: pipe.load_lora_weights(folder)
    diffpipe export runs/lora --format kohya --out lora_kohya.safetensors  # LoRA: ComfyUI, A1111, kohya's tools
    diffpipe export runs/photos --format original --out unet.safetensors   # the UNet in the original (SGM) layout

Reads the run folder's files, written on rank 0 at the end of training (weights sent over the process group, so a
run over several machines needs no shared disk): `model.safetensors` (with LoRA, the base with the adapters merged
in), `lora.safetensors` (the adapters), `model_config.json` and `config.toml`.

- diffusers, full fine-tune: the backbone by `save_pretrained` in `unet/` (Flux, SD3: `transformer/`); when the run
  started from a pipeline folder, its other components (VAE, text encoders, tokenizers, scheduler, model_index.json)
  copied beside it, so `from_pretrained` loads the whole pipeline.
- diffusers, LoRA: written by diffusers' own `save_lora_weights` of the SD, SDXL, Flux or SD3 pipeline, with the
  LoRA config (rank, alpha, targets) in the header.
- kohya: `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` / `.alpha`, the module named as kohya's tools
  name it (SD 1.x/2.x: the diffusers path; SDXL: the original layout's path), dots turned to underscores.
- original: the UNet's weights under `model.diffusion_model.` (with LoRA merged), for ComfyUI's and A1111's loaders.
  (kohya and original: UNets only so far.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .config import load_config
from .models.registry import family_for
from .models.original_layout import ORIGINAL_PREFIX, to_original_layout
from .models.pipeline_folder import is_pipeline_folder

__all__ = ["export_run", "FORMATS", "ExportError"]

FORMATS = ("diffusers", "kohya", "original")


class ExportError(ValueError):
    """A run that cannot be exported as asked; the message says why."""


def export_run(run_dir: Path, fmt: str, out: Path) -> Path:
    for name in ("config.toml", "model.safetensors", "model_config.json"):
        if not (run_dir / name).is_file():
            raise ExportError(f"{run_dir} is not a finished run folder: {name} is missing")
    if fmt in ("kohya", "original") and out.suffix != ".safetensors":
        out = out.with_name(out.name + ".safetensors")  # what loaders recognise (diffusers would try a pickle)
    config = load_config(run_dir / "config.toml")
    unet_config = json.loads((run_dir / "model_config.json").read_text())
    family = family_for(config.model.architecture)
    lora = config.adapter.type == "lora"
    if fmt in ("kohya", "original") and family.name != "unet2d":
        raise ExportError(f"--format {fmt} writes UNet layouts, and {run_dir} trained a {family.name} model; use "
                          "--format diffusers (diffusers' own loaders, and ComfyUI's for diffusers LoRA files)")
    if fmt == "kohya" and not lora:
        raise ExportError(f"--format kohya writes LoRA adapters, and {run_dir} trained every weight (adapter.type = "
                          "\"none\"); use --format diffusers or original")
    if fmt == "original":
        return _write_original(run_dir, unet_config, out)
    if lora:
        return _write_lora(run_dir, config, unet_config, fmt, out)
    return _write_diffusers_folder(run_dir, config, family, unet_config, out)


def _write_original(run_dir: Path, unet_config: dict, out: Path) -> Path:
    weights = load_file(str(run_dir / "model.safetensors"))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in to_original_layout(weights, unet_config).items()}, str(out),
              metadata={"format": "pt"})
    return out


def _write_diffusers_folder(run_dir: Path, config, family, model_config: dict, out: Path) -> Path:
    with torch.device("meta"):
        model = family.model_class(**{k: v for k, v in model_config.items() if not k.startswith("_")})
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")), assign=True)
    base = Path(config.model.path) if is_pipeline_folder(config.model.path) else None
    if base is not None:
        shutil.copytree(base, out, ignore=shutil.ignore_patterns(family.component, ".diffpipe*"), dirs_exist_ok=True)
    model.save_pretrained(out / family.component if base is not None else out, safe_serialization=True)
    return out


def _kohya_names(modules: list[str], unet_config: dict) -> dict[str, str]:
    """Module path -> kohya's LoRA name. kohya's SDXL networks name the original layout's modules."""
    sdxl = unet_config.get("addition_embed_type") == "text_time"
    if sdxl:
        renamed = to_original_layout({f"{m}.weight": torch.empty(0) for m in modules}, unet_config)
        originals = [k.removeprefix(ORIGINAL_PREFIX).removesuffix(".weight") for k in renamed]
        pairs = zip(modules, originals)
    else:
        pairs = ((m, m) for m in modules)
    return {m: "lora_unet_" + name.replace(".", "_") for m, name in pairs}


def _write_lora(run_dir: Path, config, unet_config: dict, fmt: str, out: Path) -> Path:
    adapters = load_file(str(run_dir / "lora.safetensors"))
    with safe_open(str(run_dir / "lora.safetensors"), framework="pt") as f:
        metadata = f.metadata() or {}
    modules = sorted({k.split(".lora_A.")[0] for k in adapters if ".lora_A." in k})
    if fmt == "kohya":
        names = _kohya_names(modules, unet_config)
        kohya = {}
        for module in modules:
            kohya[f"{names[module]}.lora_down.weight"] = adapters[f"{module}.lora_A.weight"].contiguous()
            kohya[f"{names[module]}.lora_up.weight"] = adapters[f"{module}.lora_B.weight"].contiguous()
            kohya[f"{names[module]}.alpha"] = torch.tensor(float(config.adapter.alpha))
        out.parent.mkdir(parents=True, exist_ok=True)
        header = {"ss_network_module": "networks.lora", "ss_network_dim": str(config.adapter.rank),
                  "ss_network_alpha": str(config.adapter.alpha), **metadata}
        save_file(kohya, str(out), metadata=header)
        return out
    import diffusers

    lora_config = json.loads(metadata.get("diffpipe.lora", "{}"))
    adapter_metadata = {"r": config.adapter.rank, "lora_alpha": config.adapter.alpha,
                        "target_modules": lora_config.get("target_modules", modules)}
    if config.model.architecture == "unet2d":
        sdxl = unet_config.get("addition_embed_type") == "text_time"
        pipeline = diffusers.StableDiffusionXLPipeline if sdxl else diffusers.StableDiffusionPipeline
        pipeline.save_lora_weights(out, unet_lora_layers=adapters, weight_name="pytorch_lora_weights.safetensors",
                                   unet_lora_adapter_metadata=adapter_metadata)
    else:
        pipeline = {"flux": diffusers.FluxPipeline, "sd3": diffusers.StableDiffusion3Pipeline}.get(config.model.architecture)
        if pipeline is None:
            raise ExportError(f"no diffusers pipeline is known to load LoRA files of {config.model.architecture!r} models")
        pipeline.save_lora_weights(out, transformer_lora_layers=adapters, weight_name="pytorch_lora_weights.safetensors",
                                   transformer_lora_adapter_metadata=adapter_metadata)
    return out / "pytorch_lora_weights.safetensors"

"""--format diffusers: what diffusers' own loaders read.

- full fine-tune: the backbone by `save_pretrained` in `unet/` (Flux, SD3: `transformer/`); when the run started from
  a pipeline folder, its other components (VAE, text encoders, tokenizers, scheduler, model_index.json) copied beside
  it, so `from_pretrained` loads the whole pipeline; `--out X.safetensors`: the backbone alone, diffusers' names.
- LoRA and DoRA: written by the family's diffusers pipeline's own `save_lora_weights`
  (`ModelFamily.diffusers_lora_pipeline`: SD, SDXL, Flux, SD3, Wan), with the LoRA config (rank, alpha, targets,
  use_dora) in the header. LoHa and LoKr: refused (diffusers loads neither; --format comfyui writes them). A LoRA of
  Wan 2.2's low-noise expert (model.expert = "low") loads with `pipe.load_lora_weights(path,
  load_into_transformer_2=True)`; a full fine-tune of either expert replaces that expert's subfolder only. Both
  experts (model.expert = "both"): a full fine-tune replaces both subfolders; a LoRA is two files in the folder,
  `pytorch_lora_weights.safetensors` (the high-noise expert's) and `pytorch_lora_weights_low_noise.safetensors`
  (`load_lora_weights(folder, weight_name=..., load_into_transformer_2=True)`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..errors import ExportError
from ..models.loading import backbone_component
from ..models.lora import adapted_module
from ..models.two_experts import EXPERT_COMPONENTS
from ..written_files import EXPORT_KEY, give_user_mode, save_tensors
from .run import replacing

__all__ = ["check", "target", "write", "WRITES_TWO_EXPERTS"]

_LORA_FILE = "pytorch_lora_weights.safetensors"
_LOW_NOISE_LORA_FILE = "pytorch_lora_weights_low_noise.safetensors"  # both experts: the low-noise one's
WRITES_TWO_EXPERTS = True  # model.expert = "both" (export/run.py refuses it for the formats without this)


def target(out: Path) -> Path:
    return out


def _by_expert(run, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The run's weights by the pipeline subfolder they go in: both experts' apart (under their subfolders' names in
    the run's files: models/two_experts.py), else all in the trained backbone's."""
    if run.config.model.expert != "both":
        return {backbone_component(run.config.model, run.family): weights}
    return {name: {k[len(name) + 1:]: v for k, v in weights.items() if k.startswith(f"{name}.")}
            for name in EXPERT_COMPONENTS}


def check(run) -> None:
    if run.config.adapter.type in ("loha", "lokr"):
        raise ExportError(f"diffusers' load_lora_weights reads LoRA and DoRA files, and {run.folder} trained "
                          f"{run.config.adapter.type}: use --format comfyui (LyCORIS' keys, which ComfyUI, A1111 and "
                          "kohya's tools load), or load the merged model.safetensors")
    if run.lora and run.family.diffusers_lora_pipeline(run.model_config) is None:
        raise ExportError(f"no diffusers pipeline is known to load LoRA files of {run.family.name!r} models")


def write(run, out: Path) -> Path:
    if run.config.model.expert == "both" and out.suffix == ".safetensors":
        raise ExportError(f"{run.folder} trained both experts (model.expert = \"both\"): --out names a folder, "
                          "which gets both (one .safetensors file holds one backbone)")
    return _write_lora(run, out) if run.lora else _write_folder(run, out)


def _write_folder(run, out: Path) -> Path:
    family = run.family
    models = {}  # pipeline subfolder -> the trained backbone in it (a two-expert pipeline: the one trained, or both)
    for component, weights in _by_expert(run, load_file(str(run.folder / "model.safetensors"))).items():
        with torch.device("meta"):
            models[component] = family.model_class(**{k: v for k, v in run.model_config.items()
                                                      if not k.startswith("_")})
        models[component].load_state_dict(weights, assign=True)
    if out.suffix == ".safetensors":  # the backbone alone, in diffusers' names (from_single_file, ComfyUI)
        (model,) = models.values()
        return save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, out,
                            metadata={"format": "pt", EXPORT_KEY: "diffusers"})
    base = run.config.model.pipeline_folder()

    def write_into(folder: Path) -> None:
        if base is not None:
            shutil.copytree(base, folder, ignore=shutil.ignore_patterns(*models, ".diffpipe*"), dirs_exist_ok=True)
        alone = base is None and len(models) == 1  # no pipeline to sit in: the folder is the backbone's own
        for component, model in models.items():
            model.save_pretrained(folder if alone else folder / component, safe_serialization=True)

    return replacing(out, write_into, "diffusers")


def _write_lora(run, out: Path) -> Path:
    adapters = load_file(str(run.folder / "lora.safetensors"))
    with safe_open(str(run.folder / "lora.safetensors"), framework="pt") as f:
        metadata = f.metadata() or {}
    modules = sorted({adapted_module(k) for k in adapters})
    lora_config = json.loads(metadata.get("diffpipe.lora", "{}"))
    adapter = run.config.adapter
    adapter_metadata = {"r": adapter.rank, "lora_alpha": adapter.alpha,
                        "target_modules": lora_config.get("target_modules", modules),
                        "use_dora": adapter.type == "dora"}
    pipeline = run.family.diffusers_lora_pipeline(run.model_config)
    component = run.family.component  # "unet" or "transformer": the keyword save_lora_weights takes them under
    files = list(zip(_by_expert(run, adapters).values(), (_LORA_FILE, _LOW_NOISE_LORA_FILE)))  # both: one each

    def write_into(folder: Path) -> None:
        for layers, name in files:
            pipeline.save_lora_weights(folder, weight_name=name, **{f"{component}_lora_layers": layers,
                                                                    f"{component}_lora_adapter_metadata": adapter_metadata})

    if out.suffix == ".safetensors":  # the file alone (pipe.load_lora_weights reads a file too)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as folder:
            write_into(Path(folder))
            written = Path(folder) / _LORA_FILE
            with safe_open(str(written), framework="pt") as f:  # diffusers' own header, and diffpipe's mark
                header = {**(f.metadata() or {}), EXPORT_KEY: "diffusers"}
            save_tensors(load_file(str(written)), written, metadata=header)
            give_user_mode(Path(folder))
            os.replace(written, out)
        return out
    return replacing(out, write_into, "diffusers") / _LORA_FILE

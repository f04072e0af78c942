"""`diffpipe export RUN_DIR --format diffusers|kohya|original [--out PATH]`: a finished run's weights in the
layouts other tools load.

    diffpipe export runs/photos --format diffusers --out photos_pipeline   # full: a diffusers folder
    diffpipe export runs/lora --format diffusers --out lora_diffusers      # LoRA: pipe.load_lora_weights(folder)
    diffpipe export runs/lora --format kohya --out lora_kohya.safetensors  # LoRA: ComfyUI, A1111, kohya's tools
    diffpipe export runs/photos --format original --out unet.safetensors   # the UNet in the original (SGM) layout
    diffpipe export runs/photos --format diffusers --out unet.safetensors  # the backbone alone, diffusers' names

An existing --out is refused unless --force (then replaced whole, once the new export is written); the run's own
files and its base model (model.path) never. Files get the user's umask.

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
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .config import load_config
from .models.registry import family_for
from .models.original_layout import ORIGINAL_PREFIX, to_original_layout
from .models.pipeline_folder import is_pipeline_folder
from .written_files import give_user_mode, save_tensors
from .errors import ExportError

__all__ = ["export_run", "FORMATS", "ExportError"]

FORMATS = ("diffusers", "kohya", "original")


def export_run(run_dir: Path, fmt: str, out: Path, force: bool = False) -> Path:
    """Writes the export (refusing an existing `out` unless `force`, and ever the run's or its base model's own
    files); returns the path written. `out` ending in .safetensors is one file, in every format."""
    for name in ("config.toml", "model.safetensors", "model_config.json"):
        if not (run_dir / name).is_file():
            raise ExportError(f"{run_dir} is not a finished run folder: {name} is missing")
    if fmt in ("kohya", "original") and out.suffix != ".safetensors":
        out = out.with_name(out.name + ".safetensors")  # what loaders recognise (diffusers would try a pickle)
    config = load_config(run_dir / "config.toml")
    _check_target(out, run_dir, config.model.path, force)
    for name in ("model.safetensors", "lora.safetensors"):
        _check_readable(run_dir / name)
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


def _check_target(out: Path, run_dir: Path, base_model: str | None, force: bool) -> None:
    """Refuse to write over the run's own files or its base model, and over anything that exists without --force."""
    target = out.resolve()
    protected = [("the run folder", run_dir.resolve())]
    if base_model:
        protected.append(("the run's base model (model.path)", Path(base_model).resolve()))
    for what, path in protected:
        if target == path or path in target.parents or target in path.parents:
            raise ExportError(f"--out {out} is in or around {what} {path}; write the export somewhere else")
    if out.exists() and not force:
        raise ExportError(f"--out {out} already exists; choose another path, or add --force to replace it")
    if out.suffix != ".safetensors" and out.is_file():
        raise ExportError(f"--out {out} is a file, and this export is a folder; name a folder, or a .safetensors file")


def _check_readable(path: Path) -> None:
    if not path.is_file():
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ExportError(f"{path} is damaged ({exc}); export an earlier copy, or train the run again") from None


def _replacing(out: Path, write) -> Path:
    """`write(folder)` into a new folder beside `out`, which then replaces `out` whole (nothing half-written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        write(partial)
        give_user_mode(partial)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return out


def _write_original(run_dir: Path, unet_config: dict, out: Path) -> Path:
    weights = load_file(str(run_dir / "model.safetensors"))
    return save_tensors({k: v.contiguous() for k, v in to_original_layout(weights, unet_config).items()}, out,
                        metadata={"format": "pt"})


def _write_diffusers_folder(run_dir: Path, config, family, model_config: dict, out: Path) -> Path:
    with torch.device("meta"):
        model = family.model_class(**{k: v for k, v in model_config.items() if not k.startswith("_")})
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")), assign=True)
    if out.suffix == ".safetensors":  # the backbone alone, in diffusers' names (from_single_file, ComfyUI)
        return save_tensors({k: v.contiguous() for k, v in model.state_dict().items()}, out, metadata={"format": "pt"})
    base = Path(config.model.path) if is_pipeline_folder(config.model.path) else None

    def write(folder: Path) -> None:
        if base is not None:
            shutil.copytree(base, folder, ignore=shutil.ignore_patterns(family.component, ".diffpipe*"),
                            dirs_exist_ok=True)
        model.save_pretrained(folder / family.component if base is not None else folder, safe_serialization=True)

    return _replacing(out, write)


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
        return save_tensors(kohya, out, metadata=header)
    import diffusers

    lora_config = json.loads(metadata.get("diffpipe.lora", "{}"))
    adapter_metadata = {"r": config.adapter.rank, "lora_alpha": config.adapter.alpha,
                        "target_modules": lora_config.get("target_modules", modules)}
    weight_name = "pytorch_lora_weights.safetensors"
    if config.model.architecture == "unet2d":
        sdxl = unet_config.get("addition_embed_type") == "text_time"
        pipeline = diffusers.StableDiffusionXLPipeline if sdxl else diffusers.StableDiffusionPipeline
        layers = {"unet_lora_layers": adapters, "unet_lora_adapter_metadata": adapter_metadata}
    else:
        pipeline = {"flux": diffusers.FluxPipeline, "sd3": diffusers.StableDiffusion3Pipeline}.get(config.model.architecture)
        if pipeline is None:
            raise ExportError(f"no diffusers pipeline is known to load LoRA files of {config.model.architecture!r} models")
        layers = {"transformer_lora_layers": adapters, "transformer_lora_adapter_metadata": adapter_metadata}

    def write(folder: Path) -> None:
        pipeline.save_lora_weights(folder, weight_name=weight_name, **layers)

    if out.suffix == ".safetensors":  # the file alone (pipe.load_lora_weights reads a file too)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as folder:
            write(Path(folder))
            give_user_mode(Path(folder))
            os.replace(Path(folder) / weight_name, out)
        return out
    return _replacing(out, write) / weight_name

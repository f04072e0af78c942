"""Build the backbone (of any family: family.py) from a preset, an inline config, a local diffusers folder or a
single .safetensors file.

The model is built on the meta device; `build.give_weights` then gives weights (materialise.py): random
(seeded) unless `model.path` is given, checked here against the architecture first. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from .family import ModelFamily
from ..errors import CheckpointError
from .folder import PICKLE_SUFFIXES
from .weight_files import INDEX_SUFFIX, weight_shapes

__all__ = ["CheckpointError", "backbone_component", "build_model", "model_kwargs", "check_checkpoint", "weights_file",
           "checked_weights"]


def backbone_component(cfg: ModelConfig, family: ModelFamily) -> str:
    """The pipeline folder's subfolder holding the backbone this run trains: the family's, or for a two-expert
    pipeline (Wan 2.2) the expert model.expert names: `transformer` (high noise) or `transformer_2` (low noise).
    Refuses an expert the folder does not have, and a two-expert folder without model.expert."""
    from .folder import expert_boundary, is_pipeline_folder

    folder = cfg.pipeline_folder()
    two = folder is not None and is_pipeline_folder(folder) and expert_boundary(folder) is not None
    random_pair = cfg.expert == "both" and cfg.path is None  # two of a preset (plans, benches): random weights
    if cfg.expert is not None and not two and not random_pair:
        raise CheckpointError(f"model.expert = \"{cfg.expert}\" picks one of a pipeline's two experts (Wan 2.2 A14B: "
                              "transformer/ and transformer_2/ with a boundary_ratio in model_index.json), and "
                              f"{folder or 'this model'} has one backbone: leave model.expert unset")
    if two and cfg.expert is None:
        raise CheckpointError(f"model.path={folder} has two experts (transformer/ for high noise, transformer_2/ for "
                              f"low, switched at boundary_ratio {expert_boundary(folder)}): set model.expert = "
                              "\"high\" or \"low\" to train one (each on its own timesteps), or \"both\" (each sample "
                              "the expert its timestep picks)")
    return "transformer_2" if cfg.expert == "low" else family.component  # "both": the high expert's config


def model_kwargs(cfg: ModelConfig, family: ModelFamily) -> dict:
    """The backbone's constructor arguments: `config`, else a folder's config.json, else that of model.components'
    backbone, else `preset`."""
    component = backbone_component(cfg, family)
    if cfg.config is not None:
        return dict(cfg.config)
    path = Path(cfg.path) if cfg.path is not None else None
    if path is not None and path.is_dir():
        for candidate in (path / "config.json", path / "model_config.json", path / component / "config.json"):
            if candidate.is_file():
                return {k: v for k, v in json.loads(candidate.read_text()).items() if not k.startswith("_")}
        raise CheckpointError(f"model.path={cfg.path}: no config.json there (nor in its {component}/ subfolder)")
    if path is not None and not path.exists():
        raise CheckpointError(f"model.path={cfg.path} does not exist")
    components = cfg.pipeline_folder()
    if components is not None and (components / component / "config.json").is_file():
        config = json.loads((components / component / "config.json").read_text())
        return {k: v for k, v in config.items() if not k.startswith("_")}
    if cfg.preset is None:
        raise CheckpointError(f"model.path={cfg.path} is a single weights file: give the architecture too, "
                              "with model.components (the base model's pipeline folder), model.preset or model.config")
    if cfg.preset not in family.presets:
        raise CheckpointError(f"model.preset={cfg.preset!r} is not a {family.name} preset; choose one of "
                              f"{sorted(family.presets)}")
    return dict(family.presets[cfg.preset])




def weights_file(path: Path, component: str = "unet") -> Path:
    if path.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(f"model.path={path}: {path.suffix} files are Python pickles, which can run code when "
                              "loaded; diffpipe reads only .safetensors (convert it with a trusted tool first)")
    if path.is_file():
        return path
    for folder in (path, path / component):
        for name in ("diffusion_pytorch_model.safetensors", "model.safetensors", "diffusion_pytorch_model.fp16.safetensors",
                     f"diffusion_pytorch_model{INDEX_SUFFIX}", f"model{INDEX_SUFFIX}"):  # (shards: weight_files.py)
            if (folder / name).is_file():
                return folder / name
    pickles = sorted(str(p) for folder in (path, path / component) if folder.is_dir()
                     for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"model.path={path}: only pickle weight files ({', '.join(pickles)}), which can run code "
                              "when loaded; diffpipe reads only .safetensors (convert them with a trusted tool first)")
    raise CheckpointError(f"model.path={path}: no diffusion_pytorch_model.safetensors or model.safetensors found")


def check_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Refuse weights written for another architecture (reads only the headers; works on a meta model)."""
    from .lora import is_adapter, plain_name  # adapters are not the base model's: the file never holds them

    own = {plain_name(k): tuple(v.shape) for k, v in model.state_dict().items() if not is_adapter(k)}
    theirs = weight_shapes(path)
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    wrong = sorted(k for k in set(own) & set(theirs) if own[k] != theirs[k])
    if missing or unexpected or wrong:
        detail = []
        if missing:
            detail.append(f"{len(missing)} weights missing (first: {missing[0]})")
        if unexpected:
            detail.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
        if wrong:
            k = wrong[0]
            detail.append(f"{len(wrong)} of another shape (first: {k} {theirs[k]} in the file, {own[k]} in the model)")
        raise CheckpointError(f"{path} does not match this model's architecture: {'; '.join(detail)}. "
                              "Check model.preset / model.config against the checkpoint.")


def build_model(cfg: ModelConfig, family: ModelFamily) -> torch.nn.Module:
    """The backbone of `cfg` on the meta device, without weights: `build.give_weights` gives them (the checkpoint's,
    else seeded random ones). model.expert = "both": a TwoExperts of the folder's two (models/two_experts.py)."""
    kwargs = model_kwargs(cfg, family)
    with torch.device("meta"):
        try:
            model = family.model_class(**kwargs)
            if cfg.expert == "both":
                return _two_experts(cfg, family, model, kwargs)
            return model
        except (TypeError, ValueError, AssertionError) as exc:
            raise CheckpointError(f"model config is not a valid {family.model_class.__name__} config "
                                  f"(model.architecture = {family.name!r}): {exc}") from None


def _two_experts(cfg: ModelConfig, family: ModelFamily, high: torch.nn.Module, kwargs: dict) -> torch.nn.Module:
    """The high-noise expert `high` and the low-noise one beside it, switched at the folder's boundary_ratio. The low
    one's config is its own subfolder's (or, from a run folder, the same: model_config.json), which must be the high
    one's: the units of both live on the same stages."""
    from .folder import expert_boundary
    from .two_experts import WAN22_T2V_BOUNDARY, TwoExperts

    folder = cfg.pipeline_folder()
    boundary = expert_boundary(folder) if folder is not None else WAN22_T2V_BOUNDARY
    own = folder / "transformer_2" / "config.json" if folder is not None else None
    if own is not None and own.is_file() and (cfg.path is None or Path(cfg.path) == folder):
        low_kwargs = {k: v for k, v in json.loads(own.read_text()).items() if not k.startswith("_")}
        if low_kwargs != kwargs:
            differ = sorted(k for k in set(low_kwargs) | set(kwargs) if low_kwargs.get(k) != kwargs.get(k))
            raise CheckpointError(f"model.expert = \"both\": {folder}'s experts differ in {', '.join(differ)}; both "
                                  "must be one architecture (train them one at a time: \"high\", \"low\")")
    return TwoExperts(high, family.model_class(**kwargs), 1000.0 * boundary)


def checked_weights(model: torch.nn.Module, cfg: ModelConfig, family: ModelFamily) -> Path | None:
    """The weights of `cfg.path`: a file, or a folder's shard index (weight_files.py); a single file in the family's
    original layout converted first (single_file.py); refused before anything is read if written for another
    architecture."""
    from .single_file import converted_file, is_fp8_file, without_scales

    if cfg.path is None:
        return None
    path = weights_file(Path(cfg.path), backbone_component(cfg, family))
    keys = without_scales(list(weight_shapes(path)))  # an unreadable file is named as such
    layout = family.release_layout
    recognised = layout is not None and layout.recognises(keys)
    single = Path(cfg.path).is_file()
    fp8 = single and is_fp8_file(path)  # ComfyUI's fp8 (scaled) files: dequantised once, as a layout is converted
    if single and (recognised or fp8):
        name = f"a {layout.name}-layout" if recognised else "an fp8"
        try:
            path = converted_file(path, family, dict(model.config), layout=recognised)
        except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"model.path={cfg.path}: {name}{' fp8' if fp8 and recognised else ''} checkpoint "
                                  f"that does not convert to the {family.backbone_name} of the run's architecture "
                                  f"({type(exc).__name__}: {exc}); check that model.components / model.preset / "
                                  "model.config describe the same model") from None
    check_checkpoint(model, path)
    return path

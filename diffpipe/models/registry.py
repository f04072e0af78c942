"""Model families by `model.architecture`: the built-in ones by name, or any `ModelFamily` subclass named by its
import path ("package.module:Class"), so a family can live outside diffpipe and still reach every process.

    from diffpipe.models.registry import family_for
    family_for("flux").presets                 # the built-in Flux configs
"""
from __future__ import annotations

import importlib

from .family import ModelFamily
from ..errors import ArchitectureError

__all__ = ["BUILTIN_FAMILIES", "family_for", "ArchitectureError"]

# name -> "module:Class" (imported on first use: a config check never imports diffusers)
BUILTIN_FAMILIES = {
    "unet2d": "diffpipe.models.families.unet.unet2d:UNet2DFamily",
    "flux": "diffpipe.models.families.flux.flux:FluxFamily",
    "flux_kontext": "diffpipe.models.families.flux.kontext:FluxKontextFamily",
    "chroma": "diffpipe.models.families.flux.chroma:ChromaFamily",
    "sd3": "diffpipe.models.families.sd3.sd3:SD3Family",
    "wan": "diffpipe.models.families.wan.wan:WanFamily",
    "wan_i2v": "diffpipe.models.families.wan.i2v:WanI2VFamily",
    "unet3d": "diffpipe.models.families.unet.unet3d:UNet3DFamily",
    "qwen_image": "diffpipe.models.families.qwen_image.qwen_image:QwenImageFamily",
    "qwen_image_edit": "diffpipe.models.families.qwen_image.edit:QwenImageEditFamily",
    "hunyuan_video15": "diffpipe.models.families.hunyuan_video15.hunyuan_video15:HunyuanVideo15Family",
    "z_image": "diffpipe.models.families.z_image.z_image:ZImageFamily",
    "flux2": "diffpipe.models.families.flux2.flux2:Flux2Family",
    "ltx2": "diffpipe.models.families.ltx2.ltx2:LTX2Family",
}


def family_for(architecture: str) -> ModelFamily:
    """The family named by a built-in name or an import path "module:Class"."""
    path = BUILTIN_FAMILIES.get(architecture, architecture)
    module_name, _, class_name = path.partition(":")
    if not class_name:
        raise ArchitectureError(f"model.architecture={architecture!r} is unknown; choose one of "
                                f"{sorted(BUILTIN_FAMILIES)}, or give a ModelFamily subclass as \"module:Class\"")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ArchitectureError(f"model.architecture={architecture!r}: cannot import {path} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
        raise ArchitectureError(f"model.architecture={architecture!r}: {path} is not a ModelFamily subclass")
    return cls()

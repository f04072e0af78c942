"""--format original: the backbone's weights (with LoRA merged) in its family's own release layout, one file, for
ComfyUI's and A1111's loaders: UNets under `model.diffusion_model.` (the SGM layout), Flux in BFL's layout
(models/families/flux/release_layout.py), SD3 in Stability's (models/families/sd3/release_layout.py) and Wan in Wan's own (models/families/wan/release_layout.py), as
ComfyUI's "Load Diffusion Model" reads those models' own files."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from ..errors import ExportError
from ..written_files import EXPORT_KEY, save_tensors
from .run import one_file

__all__ = ["check", "target", "write"]


target = one_file


def check(run) -> None:
    if run.family.release_layout is None:
        raise ExportError(f"--format original: diffpipe knows no release layout of {run.family.name!r} models other "
                          "than diffusers'; use --format diffusers (--out MODEL.safetensors: the backbone alone in "
                          "diffusers' names, which ComfyUI also loads)")


def write(run, out: Path) -> Path:
    weights = load_file(str(run.folder / "model.safetensors"))
    original = run.family.release_layout.from_diffusers(weights, run.model_config)
    return save_tensors({k: v.contiguous() for k, v in original.items()}, out, metadata={"format": "pt", EXPORT_KEY: "original"})

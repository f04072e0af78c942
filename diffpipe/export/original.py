"""--format original: the UNet's weights under `model.diffusion_model.` (with LoRA merged), for ComfyUI's and A1111's
loaders. UNets only so far."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from ..errors import ExportError
from ..models.original_layout import to_original_layout
from ..written_files import save_tensors

__all__ = ["check", "target", "write"]


def target(out: Path) -> Path:
    """A .safetensors file: what loaders recognise (diffusers would try a pickle)."""
    return out if out.suffix == ".safetensors" else out.with_name(out.name + ".safetensors")


def check(run) -> None:
    if run.family.name != "unet2d":
        raise ExportError(f"--format original writes UNet layouts, and {run.folder} trained a {run.family.name} model; "
                          "use --format diffusers (diffusers' own loaders, and ComfyUI's for diffusers LoRA files)")


def write(run, out: Path) -> Path:
    weights = load_file(str(run.folder / "model.safetensors"))
    return save_tensors({k: v.contiguous() for k, v in to_original_layout(weights, run.model_config).items()}, out,
                        metadata={"format": "pt"})

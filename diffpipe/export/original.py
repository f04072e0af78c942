"""--format original: the UNet's weights under `model.diffusion_model.` (with LoRA merged), for ComfyUI's and A1111's
loaders. UNets only so far."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from ..models.original_layout import to_original_layout
from ..written_files import save_tensors
from .run import one_file, only_unets

__all__ = ["check", "target", "write"]


target = one_file


def check(run) -> None:
    only_unets(run, "original")


def write(run, out: Path) -> Path:
    weights = load_file(str(run.folder / "model.safetensors"))
    return save_tensors({k: v.contiguous() for k, v in to_original_layout(weights, run.model_config).items()}, out,
                        metadata={"format": "pt"})

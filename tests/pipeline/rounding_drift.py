"""How far the unsplit model drifts from itself over a central-test scenario when its initial weights move by one
float32 rounding (each element x (1 +- 2^-24)): the noise floor under the central test's tolerances.

Run: python -m tests.pipeline.rounding_drift wan21-i2v-1f1b-2 1f1b-2   (names from test_pipelined_gradients.TWO)

Measured on an AVX2 CPU (2026-12-07): wan21-i2v-1f1b-2 gradients 9.0e-5, moments 1.1e-4 (both a cross-attention key
bias), weights 1.4e-3 of lr x steps; 1f1b-2 (digits UNet) moments 1.2e-5; flux-1f1b-2 moments 9.3e-7.
"""
from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import test_pipelined_gradients as central

WEIGHTS = "diffusion_pytorch_model.safetensors"


def one_rounding_apart(folder: Path, into: Path) -> Path:
    """A copy of the diffusers folder `folder` with every float weight moved by one float32 rounding, up or down."""
    shutil.copytree(folder, into)
    draw = torch.Generator().manual_seed(0)
    weights = load_file(str(into / WEIGHTS))
    moved = {name: value * (1 + (torch.randint(0, 2, value.shape, generator=draw) * 2 - 1) * 2.0 ** -24)
             if value.is_floating_point() else value for name, value in weights.items()}
    save_file(moved, str(into / WEIGHTS))
    return into


def drift(name: str, folders: dict[str, str], root: Path) -> dict:
    """The central test's comparison of the reference run from the scenario's weights and from weights one rounding
    apart (the same split, draws and steps)."""
    config = central.resolved(central.TWO[name], folders)
    central.planned_splits({name: config})
    first = central.reference(config, central.draws_of(config))
    data = copy.deepcopy(central.TWO[name])
    model = data["model"]["path"]
    moved_folder = root / f"{model}-moved"
    if not moved_folder.exists():
        one_rounding_apart(Path(folders[model]), moved_folder)
    moved = central.resolved(data, folders | {model: str(moved_folder)})
    moved.pipeline.split = config.pipeline.split
    second = central.reference(moved, central.draws_of(moved))
    return central.compare(first, [second], central._weight_scale(config, first))


def main(names: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="rounding-drift-"))
    folders = central.write_model_folders(root / "initial-weights")
    for name in names:
        found = drift(name, folders, root)
        print(name, {check: f"{value:.1e} {where}" for check, (value, where) in found["worst"].items()}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Real weights for the parts of a model a process trains, and for nothing else.

Every process builds the model on the meta device (no memory, no work), then gives weights to the modules of
its own stages: a 9.6 B-parameter UNet split over 8 processes then costs each process its eighth, not the
38 GB of the whole model in fp32 and a full random initialisation.

Random weights are drawn per module by the module's own `reset_parameters` (what its constructor calls), from a
generator seeded by (seed, the module's name in the model): a module gets the same weights whichever process
builds it, whatever else that process builds, so every stage count trains the same model. Checkpoint weights are
read tensor by tensor from the .safetensors file, so a process never reads another stage's weights.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import seeds
from ..torch_support import non_persistent_buffers
from .loading import CheckpointError
from .weight_files import open_weights
from .storage import FrozenStorage

__all__ = ["materialise", "is_meta", "NonFiniteWeights"]


class NonFiniteWeights(CheckpointError):
    """Weights read from a file hold NaN or inf: never trained on."""


def is_meta(model: nn.Module) -> bool:
    """True when no weight of `model` has been given memory yet."""
    return all(t.is_meta for t in model.parameters())


def materialise(model: nn.Module, seed: int, checkpoint: Path | None = None,
                modules: set[int] | None = None, device: str | torch.device = "cpu",
                rename: Callable[[str], str | None] = lambda name: name,
                buffers: dict[str, torch.Tensor] | None = None,
                reset_own: Callable[[nn.Module], bool] = lambda module: False,
                frozen: FrozenStorage | None = None) -> None:
    """Give real weights, on `device`, to the meta modules of `model` whose id() is in `modules` (all when None):
    the checkpoint's tensors when given (its architecture already checked), else seeded random ones. `rename`
    gives a module's name in the checkpoint (and so its seed), or None for one the checkpoint cannot hold (a LoRA
    adapter: drawn at random, seeded by its own name). Buffers only a constructor fills (a fixed positional table)
    come from the checkpoint when it holds them, else from `buffers` (full names: ModelFamily.constructor_buffers).
    A module without `reset_parameters` gets its random weights from `reset_own` (ModelFamily.reset_own_parameters).

    Parameters keep their identity (filled in place), so whatever holds one sees its weights; buffers given values are
    new objects: anything keyed by their identity must be rebuilt after this. `frozen`: how frozen weights are held
    (memory.base_dtype), applied as each module gets them, so the host never holds the whole in fp32.
    """
    opened = open_weights(checkpoint) if checkpoint is not None else contextlib.nullcontext()
    with opened as reader:
        for name, module in model.named_modules():
            if modules is None or id(module) in modules:
                _materialise_module(model, name, module, seed, reader, device, rename, buffers or {}, reset_own)
                if frozen is not None:
                    frozen.store(module)


def _materialise_module(model: nn.Module, name: str, module: nn.Module, seed: int, reader, device,
                        rename: Callable[[str], str | None], buffers: dict[str, torch.Tensor],
                        reset_own: Callable[[nn.Module], bool]) -> None:
    own = list(module.parameters(recurse=False))
    meta_buffers = [key for key, b in module.named_buffers(recurse=False) if b.is_meta]
    if not any(t.is_meta for t in own) and not meta_buffers:
        return
    file_name = rename(name)
    values = {}
    for key in meta_buffers:
        full = f"{file_name}.{key}" if file_name else key
        if reader is not None and full in reader.keys():
            values[key] = reader.get_tensor(full)
        elif f"{name}.{key}" in buffers:
            values[key] = buffers[f"{name}.{key}"]
        else:
            raise ValueError(f"{type(model).__name__}.{name} ({type(module).__name__}) has a buffer {key!r} only its "
                             "constructor can fill; building it on the meta device is not supported")
    if any(t.is_meta for t in own):
        _give_parameters(model, name, module, file_name, seed, reader, device, reset_own)
    for key, value in values.items():
        persistent = key not in non_persistent_buffers(module)
        module.register_buffer(key, value.to(device=device, dtype=getattr(module, key).dtype), persistent=persistent)


def _give_parameters(model: nn.Module, name: str, module: nn.Module, file_name: str | None, seed: int, reader, device,
                     reset_own: Callable[[nn.Module], bool]) -> None:
    """The module's own parameters: the checkpoint's tensors, else drawn from a generator seeded by its name."""
    from_file = reader is not None and file_name is not None
    for p in list(module.parameters(recurse=False)):  # in place: every holder of the parameter sees its weights
        torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))
    with torch.no_grad():
        if from_file:
            for key, param in module.named_parameters(recurse=False):
                full = f"{file_name}.{key}" if file_name else key
                param.copy_(reader.get_tensor(full))
                if not torch.isfinite(param).all():  # a damaged file whose header is intact reads as NaN or inf
                    raise NonFiniteWeights(f"{full} in the weights file holds NaN or inf values; the file is damaged "
                                           "or was written by a diverged run: use another checkpoint")
        else:
            with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
                torch.manual_seed(seeds.named(seed, file_name if file_name is not None else name))
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                elif not reset_own(module):
                    raise ValueError(f"{type(model).__name__}.{name} ({type(module).__name__}) has no reset_parameters "
                                     "to draw its random weights with; give model.path to load them instead")

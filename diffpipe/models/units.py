"""The adapter contract: a backbone described as ordered units and the named tensors each reads and writes.

A unit is an `nn.Module` whose forward takes the named tensors it reads (as keyword arguments) and returns
a dict of the named tensors it writes. Names listed in `Backbone.conditions` (timestep, text embeddings)
reach every stage directly; all other names are produced by an earlier unit or are model inputs, and the
pipeline package decides which of them cross each stage boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..torch_support import hook_counts

__all__ = ["Unit", "Backbone", "full_parameter_names", "twin_key"]


@dataclass(frozen=True)
class Unit:
    """One step of the backbone's forward: `module(**{name: tensor for name in reads}) -> {name: tensor}`."""

    name: str
    module: nn.Module
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    def __call__(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.module(**{name: named[name] for name in self.reads})
        if set(out) != set(self.writes):
            raise RuntimeError(f"unit {self.name} wrote {sorted(out)}, declared {sorted(self.writes)}")
        return out


@dataclass
class Backbone:
    """A model as units in forward order, plus the names at its edges.

    inputs: tensors fed to the first unit that reads them (the noisy latent).
    conditions: tensors every unit may read (timestep, text embeddings), given to every stage.
    output: the name of the prediction written by the last unit.
    parameter_names: maps each parameter/buffer object id to its name in the original model,
    so a stage's weights can be saved and loaded under the names diffusers uses.
    family: the ModelFamily that described the model (how it is fed, its diffusers forward).
    tables: names of tensors that are one table for the whole batch (a rotary table computed from the latents'
    shape), not a row per sample: what a unit that routes samples (models/two_experts.py) passes whole.
    """

    units: list[Unit]
    inputs: tuple[str, ...]
    conditions: tuple[str, ...]
    output: str
    model: nn.Module
    parameter_names: dict[int, str] = field(default_factory=dict)
    family: Any = None  # the ModelFamily that described it (family.py)
    tables: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.parameter_names:
            self.parameter_names = full_parameter_names(self.model)

    def forward(self, inputs: dict[str, torch.Tensor], conditions: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run all units in order: the unsplit model."""
        named = {**inputs, **conditions}
        for unit in self.units:
            named.update(unit(named))
        return named[self.output]

    def unit_parameters(self, index: int) -> int:
        return sum(p.numel() for p in self.units[index].module.parameters())


def full_parameter_names(model: nn.Module) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    names.update({id(b): n for n, b in model.named_buffers(remove_duplicate=False)})
    return names


def twin_key(unit: Unit, named: dict[str, torch.Tensor], grad_names: frozenset[str] | set[str] = frozenset()) -> tuple:
    """What decides what a unit computes on the meta device (its ops, their shapes and dtypes): its modules' classes,
    plain settings and hooks, its parameters' and buffers' shapes, dtypes and trainability, and its inputs' (from
    `named`) shapes and dtypes, and which of them need gradients (`grad_names`). Units alike in all of these (a DiT's
    repeated blocks) are twins: the planner counts one of them (planner/costs.py), a trace runs one
    (pipeline/traffic.py). One that keeps its place or any other setting of its own (a block index) is no twin,
    unless its module names that setting in `TWIN_FREE` (dotted from the unit's module: "rows", "block.layer_id"):
    settings that choose which rows of an input it reads, or that nothing reads, the same ops whatever they are."""
    free = frozenset(getattr(unit.module, "TWIN_FREE", ()))

    def settings(path: str, module: torch.nn.Module) -> tuple:
        plain = tuple(sorted((k, _setting(v)) for k, v in vars(module).items()
                             if not k.startswith("_") and f"{path}.{k}".lstrip(".") not in free))
        return type(module).__qualname__, plain, hook_counts(module)

    return (unit.reads, unit.writes,
            tuple((name, settings(name, m)) for name, m in unit.module.named_modules()),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in unit.module.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in unit.module.named_buffers()),
            tuple((k, tuple(named[k].shape), named[k].dtype, k in grad_names) for k in unit.reads))


def _setting(value):
    """A module's attribute as the key holds it: plain values and tuples or lists of them as they are, anything
    else by its class."""
    if isinstance(value, (tuple, list)):
        return tuple(_setting(v) for v in value)
    return value if isinstance(value, _PLAIN) else type(value).__qualname__


_PLAIN = (bool, int, float, str, type(None), torch.dtype)

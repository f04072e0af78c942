"""Weights tied between stages: a parameter that units on two stages use (a norm shared by a DiT's first and last
layers) lives on every process holding one of those stages, each computing only its stages' share of its gradient.

The shares are summed over the pipeline before anything reads the gradients (one all-reduce of a flat buffer over
the pipeline's processes, zeros from a process holding none of them), so every copy takes the same optimizer step
from the same starting weights and the copies never drift apart. The gradient norm counts each tied parameter once,
on the process holding its lowest stage. Stages on one process (interleaved schedules) share the parameter object,
so its gradient there already sums both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import Topology
from ..models.units import Backbone
from .data_parallel import local, local_numel
from .split import StageSpec

__all__ = ["TiedParameter", "tied_parameters", "TiedGradients"]


@dataclass(frozen=True)
class TiedParameter:
    name: str  # in the whole model, as diffusers names it
    stages: tuple[int, ...]  # the stages whose units use it
    shape: tuple[int, ...]


def tied_parameters(backbone: Backbone, specs: list[StageSpec]) -> list[TiedParameter]:
    """Parameters used by units of more than one stage, by name."""
    stages: dict[int, set[int]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for spec in specs:
        for unit in backbone.units[spec.first:spec.last]:
            for p in unit.module.parameters():
                if not p.requires_grad:  # frozen (LoRA's base): no gradient to share
                    continue
                stages.setdefault(id(p), set()).add(spec.index)
                shapes[id(p)] = tuple(p.shape)
    tied = [TiedParameter(backbone.parameter_names[pid], tuple(sorted(s)), shapes[pid])
            for pid, s in stages.items() if len(s) > 1]
    return sorted(tied, key=lambda t: t.name)


class TiedGradients:
    """Sums tied parameters' gradient shares over the pipeline (see the module's docstring).

    held: this process's copies by name (those of its stages); not_counted_here: the copies whose share of the
    gradient norm another process counts (the one holding their lowest stage)."""

    def __init__(self, tied: list[TiedParameter], held: dict[str, torch.nn.Parameter], my_stages: list[int],
                 topo: Topology, shard: bool = False):
        self.tied, self.held, self.group, self.device = tied, held, topo.pp_group, topo.device
        # the elements of each this process holds: a stage's replicas may cut it (pipeline/data_parallel.py), each
        # replica's part summed over its own pipeline, where every process holds the same part of it
        self.sizes = [local_numel(held.get(t.name), t.shape, topo, shard) for t in tied]
        self.not_counted_here = {id(held[t.name]) for t in tied if t.name in held and min(t.stages) not in my_stages}

    def sum_(self) -> None:
        if not self.tied:
            return
        parts = []
        for t, n in zip(self.tied, self.sizes):
            p = self.held.get(t.name)
            held = p is not None and p.grad is not None
            parts.append(local(p.grad).reshape(-1).float() if held else torch.zeros(n, device=self.device))
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for t, n in zip(self.tied, self.sizes):
            p = self.held.get(t.name)
            if p is not None and p.requires_grad:
                if p.grad is None:  # a copy whose stages here left it no share: the others' make its gradient
                    p.grad = torch.zeros_like(p)
                grad = local(p.grad)
                grad.copy_(flat[offset:offset + n].view(grad.shape))
            offset += n

    def for_norm(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """`params` less the tied copies another process counts in the gradient norm."""
        return [p for p in params if id(p) not in self.not_counted_here]


"""Shapes of every named tensor (traced on the meta device: no memory, no compute) and the bytes that
cross each stage boundary per micro-batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.units import Backbone
from .split import StageSpec

__all__ = ["trace_shapes", "Crossing", "boundary_crossings", "format_crossings"]


def trace_shapes(backbone: Backbone, inputs: dict[str, torch.Tensor],
                 conditions: dict[str, torch.Tensor]) -> list[dict[str, torch.Size]]:
    """Shapes of every live name after each unit (a name such as "h" is rewritten, so shapes change),
    from running the units on meta tensors; `backbone` must live on the meta device too."""
    named = {k: v.to("meta") for k, v in {**inputs, **conditions}.items()}
    shapes = {k: v.shape for k, v in named.items()}
    after = []
    with torch.no_grad():
        for unit in backbone.units:
            out = unit(named)
            named.update(out)
            shapes.update({k: v.shape for k, v in out.items()})
            after.append(dict(shapes))
    return after


@dataclass(frozen=True)
class Crossing:
    after_stage: int
    names: tuple[str, ...]
    bytes: int


def boundary_crossings(specs: list[StageSpec], shapes_after: list[dict[str, torch.Size]],
                       bytes_per_element: int) -> list[Crossing]:
    """What each stage sends: shapes as they are after its last unit."""
    return [Crossing(s.index, s.sends, sum(shapes_after[s.last - 1][n].numel() for n in s.sends) * bytes_per_element)
            for s in specs[:-1]]


def format_crossings(crossings: list[Crossing]) -> str:
    lines = [f"  stage {c.after_stage} -> {c.after_stage + 1}: {c.bytes / 2**20:.3f} MiB per micro-batch "
             f"({', '.join(c.names)})" for c in crossings]
    return "\n".join(lines) if lines else "  (one stage: nothing crosses)"

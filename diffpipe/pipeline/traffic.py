"""Every named tensor (traced on the meta device: no memory, no compute) and the bytes that cross each stage
boundary per micro-batch, each tensor in the dtype it has in training: under bf16 or fp16 autocast as CUDA's autocast
gives it (precision/autocast.py, which the planner counts with too), so a residual stream that an fp32 input keeps in
fp32 crosses as fp32 and a projection's output as bf16."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..models.units import Backbone, twin_key
from ..precision.autocast import CountedAutocast
from .split import StageSpec

__all__ = ["trace_shapes", "trace_tensors", "Crossing", "boundary_crossings", "format_crossings"]


def trace_tensors(backbone: Backbone, inputs: dict[str, torch.Tensor], conditions: dict[str, torch.Tensor],
                  autocast_dtype: torch.dtype | None = None) -> list[dict[str, torch.Tensor]]:
    """Every live name's tensor after each unit (a name such as "h" is rewritten, so shapes and dtypes change), from
    running the units on meta tensors, under autocast to `autocast_dtype` where given; `backbone` must live on the
    meta device too. A unit's twin (models/units.py `twin_key`) hands on what the first of them wrote."""
    named = {k: v.to("meta") for k, v in {**inputs, **conditions}.items()}
    after = []
    written: dict[tuple, dict[str, torch.Tensor]] = {}  # by twin_key: a repeated block fed alike is run once
    autocast = CountedAutocast(autocast_dtype, []) if autocast_dtype is not None else nullcontext()
    with torch.no_grad(), autocast:
        for unit in backbone.units:
            key = twin_key(unit, named)
            if key not in written:
                written[key] = unit(named)
            named.update(written[key])
            after.append(dict(named))
    return after


def trace_shapes(backbone: Backbone, inputs: dict[str, torch.Tensor],
                 conditions: dict[str, torch.Tensor]) -> list[dict[str, torch.Size]]:
    """Shapes of every live name after each unit (`trace_tensors` without autocast)."""
    return [{k: v.shape for k, v in named.items()} for named in trace_tensors(backbone, inputs, conditions)]


@dataclass(frozen=True)
class Crossing:
    after_stage: int
    names: tuple[str, ...]
    bytes: int


def boundary_crossings(specs: list[StageSpec], tensors_after: list[dict[str, torch.Tensor]]) -> list[Crossing]:
    """What each stage sends: its tensors as they are after its last unit (`trace_tensors`)."""
    return [Crossing(s.index, s.sends, sum(_bytes(tensors_after[s.last - 1][n]) for n in s.sends)) for s in specs[:-1]]


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def format_crossings(crossings: list[Crossing]) -> str:
    lines = [f"  stage {c.after_stage} -> {c.after_stage + 1}: {c.bytes / 2**20:.3f} MiB per micro-batch "
             f"({', '.join(c.names)})" for c in crossings]
    return "\n".join(lines) if lines else "  (one stage: nothing crosses)"

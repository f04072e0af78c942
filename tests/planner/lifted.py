"""A two-unit meta backbone for counting one unit as it sits inside a model: a trained scale first, so that what the
unit under test reads needs a gradient (as a unit's input does after any trained layer)."""
from __future__ import annotations

import torch
from torch import nn

from diffpipe.models.units import Backbone, Unit


class _Lift(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return {"h": x * self.scale}


def lifted(make_unit, width: int) -> Backbone:
    """Units `lift` (x -> h) and `unit` (h -> y, made by `make_unit()`), on the meta device."""
    with torch.device("meta"):
        lift, unit = _Lift(width), make_unit()
    units = [Unit("lift", lift, ("x",), ("h",)), Unit("unit", unit, ("h",), ("y",))]
    return Backbone(units, ("x",), (), "y", nn.ModuleList([lift, unit]))

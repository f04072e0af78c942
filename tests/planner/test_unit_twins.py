"""A repeated block is counted once: a unit alike in every way that decides its costs (modules, settings, hooks,
parameters, inputs) to one counted before it takes that one's costs. The costs must be what counting each unit
alone gives, on real families' backbones and on units that look alike but are not (a setting of their own, an input
of another shape)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch import nn

from diffpipe.build import build_backbone, example_inputs
from diffpipe.config_files import load_config
from diffpipe.models.units import Backbone, Unit
from diffpipe.planner.costs import count_unit_costs

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


def _costs(example: str, twins: bool):
    """A fresh meta backbone's costs (counting leaves gradients on the meta weights)."""
    config = load_config(EXAMPLES / example)
    meta = build_backbone(config, "meta")
    return count_unit_costs(meta, *example_inputs(config, meta, 1), twins=twins)


@pytest.mark.parametrize("example", ["flux_tiny.toml", "wan_clips.toml", "ltx2_tiny.toml", "sd3_tiny.toml",
                                     "qwen_image_tiny.toml", "photos.toml", "chroma_lora.toml"])
def test_twins_cost_what_counting_each_unit_alone_costs(example):
    alone, twins = _costs(example, twins=False), _costs(example, twins=True)
    assert [asdict(c) for c in twins] == [asdict(c) for c in alone]


class _Repeat(nn.Module):
    """A linear layer applied `times` times: the same parameters whatever `times` is."""

    def __init__(self, times: int):
        super().__init__()
        self.times = times
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(self.times):
            x = self.linear(x)
        return {"x": x}


class _Longer(nn.Module):
    def forward(self, x):
        return {"x": torch.cat([x, x], dim=0)}


def test_units_alike_but_for_a_setting_or_an_input_shape_are_counted_alone():
    blocks = [_Repeat(1), _Repeat(1), _Repeat(2), _Longer(), _Repeat(1), _Repeat(1)]
    blocks[5].register_forward_hook(lambda module, args, out: {"x": module.linear(out["x"])})  # a hook's own work
    model = nn.ModuleList(blocks)
    units = [Unit(f"unit.{i}", block, ("x",), ("x",)) for i, block in enumerate(blocks)]
    backbone = Backbone(units, inputs=("x",), conditions=(), output="x", model=model.to("meta"))
    costs = count_unit_costs(backbone, {"x": torch.randn(4, 8)}, {})
    flops = [c.forward_flops for c in costs]
    assert flops[1] == flops[0]  # a twin
    assert flops[2] == 2 * flops[0]  # its own setting: applied twice
    assert flops[4] == 2 * flops[0]  # after the unit that doubles the rows: twice the rows
    assert costs[4].activation_bytes == 2 * costs[0].activation_bytes
    assert flops[5] == 2 * flops[4]  # its hook applies the layer again


def _units_counted(monkeypatch) -> list[str]:
    """The names of the units the planner counts from now on (not a twin's), in order."""
    from diffpipe.planner import costs as counting

    counted, real = [], counting._count_unit

    def count(unit, *args, **kwargs):
        counted.append(unit.name)
        return real(unit, *args, **kwargs)

    monkeypatch.setattr(counting, "_count_unit", count)
    return counted


@pytest.mark.parametrize("example,blocks_counted", [
    ("flux_dev.toml", ["double.0", "single.0"]),
    # Chroma's blocks read their own rows of the modulation (TWIN_FREE); its first single block joins the streams
    ("chroma_lora.toml", ["double.0", "single.0", "single.1"])])
def test_repeated_blocks_are_counted_once_per_kind(monkeypatch, example, blocks_counted):
    """Where the saving is: Flux.1-dev's 19 double and 38 single blocks are two kinds of twins."""
    counted = _units_counted(monkeypatch)
    costs = _costs(example, twins=True)
    assert len(costs) == 59 and [c.name for c in costs][:3] == ["embed", "double.0", "double.1"]
    assert [n for n in counted if n.startswith(("double", "single"))] == blocks_counted


class _Indexed(nn.Module):
    """A block that keeps an index its forward never reads (as diffusers' Z-Image blocks keep `layer_id`)."""

    def __init__(self, index: int):
        super().__init__()
        self.index, self.linear = index, nn.Linear(8, 8)

    def forward(self, x):
        return {"x": self.linear(x)}


class _Wrapped(nn.Module):
    """An `_Indexed` block whose index is named twin-free, beside a setting of its own of the same name that is not."""

    TWIN_FREE = ("block.index",)

    def __init__(self, index: int, own: int = 0):
        super().__init__()
        self.block, self.index = _Indexed(index), own

    def forward(self, x):
        return self.block(x)


def test_a_setting_named_twin_free_does_not_part_twins(monkeypatch):
    counted = _units_counted(monkeypatch)
    blocks = [_Wrapped(0), _Wrapped(1), _Wrapped(2, own=1), _Indexed(3), _Indexed(4)]
    units = [Unit(f"unit.{i}", block, ("x",), ("x",)) for i, block in enumerate(blocks)]
    backbone = Backbone(units, inputs=("x",), conditions=(), output="x", model=nn.ModuleList(blocks).to("meta"))
    count_unit_costs(backbone, {"x": torch.randn(4, 8)}, {})
    # the first two are twins; the third's own setting and the bare blocks' index part them
    assert counted == ["unit.0", "unit.2", "unit.3", "unit.4"]


def test_a_trace_hands_on_what_each_unit_writes(monkeypatch):
    """pipeline/traffic.py runs a twin once: every name's shape and dtype after each unit as running each unit."""
    from diffpipe.pipeline import traffic

    blocks = [_Repeat(1), _Longer(), _Repeat(1), _Longer(), _Repeat(1)]
    units = [Unit(f"unit.{i}", block, ("x",), ("x",)) for i, block in enumerate(blocks)]
    backbone = Backbone(units, inputs=("x",), conditions=(), output="x", model=nn.ModuleList(blocks).to("meta"))
    assert [tuple(after["x"].shape) for after in traffic.trace_tensors(backbone, {"x": torch.randn(4, 8)}, {})] == \
        [(4, 8), (8, 8), (8, 8), (16, 8), (16, 8)]

    def shapes(traced):
        return [{k: (tuple(v.shape), v.dtype) for k, v in after.items()} for after in traced]

    config = load_config(EXAMPLES / "flux_tiny.toml")
    meta = build_backbone(config, "meta")
    args = (meta, *example_inputs(config, meta, 2), torch.bfloat16)
    twins = shapes(traffic.trace_tensors(*args))
    monkeypatch.setattr(traffic, "twin_key", lambda unit, named: id(unit))
    assert twins == shapes(traffic.trace_tensors(*args))

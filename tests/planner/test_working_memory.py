"""A unit's working memory: what it holds at once beyond what it keeps for backward (planner/live_bytes.py), charged
once per stage. A Wan 14B block at 32,760 tokens held ~3 GiB of such intermediates on an H200 (bench/unit_memory.py
--chain), which the planner missed until it counted them."""
from __future__ import annotations

import torch
from torch import nn

from diffpipe.planner.costs import count_unit_costs
from diffpipe.planner.live_bytes import LiveBytes

from .lifted import lifted

ROWS, D, WIDE = 64, 32, 1024


class _Wide(nn.Module):
    """Makes a wide intermediate, reduces it, and keeps nothing of it: its working memory is at least that."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, WIDE)

    def forward(self, h):
        wide = self.up(h).detach()  # kept by nothing: freed when the forward returns
        return {"y": h * wide.sum(-1, keepdim=True)}


def test_a_unit_is_charged_the_intermediates_it_frees_before_it_returns():
    backbone = lifted(_Wide, D)
    cost = count_unit_costs(backbone, {"x": torch.zeros(ROWS, D)}, {})[1]
    wide_bytes = ROWS * WIDE * 4
    assert wide_bytes <= cost.working_bytes < 2 * wide_bytes
    assert cost.activation_bytes < wide_bytes  # none of it is kept


def test_live_bytes_follow_what_torch_frees():
    live = LiveBytes()
    with live:
        a = torch.empty(1000, device="meta")
        b = a * 2
        del a
        view = b.view(10, 100)
        del b
        assert live.live == 4000  # the view keeps its base
    assert live.peak == 8000
    del view
    assert live.live == 0


def test_a_stage_is_charged_its_largest_working_memory_once():
    from dataclasses import replace

    from diffpipe.pipeline.schedules import ScheduleChoice
    from diffpipe.planner.partition import Hardware, estimate_stages

    backbone = lifted(_Wide, D)
    costs = count_unit_costs(backbone, {"x": torch.zeros(ROWS, D)}, {})
    none = [replace(c, working_bytes=0) for c in costs]
    for checkpointing in ("none", "all"):
        def peak(unit_costs):
            return estimate_stages(unit_costs, [0, 0], [], 2, ScheduleChoice.named("1f1b"), Hardware(),
                                   checkpointing).stages[0].memory_bytes
        assert peak(costs) - peak(none) == max(c.working_bytes for c in costs) > 0

"""Measured per-stage compute and bubble match schedule theory, with units that take known, fixed times.

Each stage is one unit that sleeps F seconds in forward and B in backward. For GPipe and 1F1B with S stages
and m micro-batches, every stage computes m (F + B) per step, the step lasts (m + S - 1)(F + B), and the
bubble is (S - 1)(F + B) per stage: (S - 1) / (m + S - 1) of the step.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffpipe.models.units import Backbone, Unit

from ..helpers import run_workers

FORWARD_S, BACKWARD_S = 0.02, 0.04


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slowdown):
        time.sleep(FORWARD_S * slowdown)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad, None


class _SleepUnit(nn.Module):
    def __init__(self, reads: str, writes: str):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.reads, self.writes = reads, writes
        self.slowdown = 1.0

    def forward(self, **named):
        return {self.writes: _Sleep.apply(named[self.reads] * self.scale, self.slowdown)}


def _sleep_pipeline(topo, schedule: str, m: int):
    from diffpipe.pipeline.runtime import PipelineRunner
    from diffpipe.pipeline.split import stage_specs
    from diffpipe.pipeline.stage import build_stage_modules

    units = [Unit("a", _SleepUnit("x", "h"), ("x",), ("h",)), Unit("b", _SleepUnit("h", "y"), ("h",), ("y",))]
    backbone = Backbone(units, ("x",), (), "y", nn.ModuleList(u.module for u in units))
    module = build_stage_modules(backbone, stage_specs(backbone, [1]))[topo.pp_rank]
    return module, PipelineRunner([module], [topo.pp_rank], 2, topo.pp_group, topo.device, schedule, m, F.mse_loss)


def _worker(cases: list[tuple[str, int]], out_dir: str) -> None:
    from pathlib import Path

    from diffpipe.config_files import build_config
    from diffpipe.distributed import init_topology
    from diffpipe.observe.observer import PipelineObserver
    torch.set_num_threads(1)
    topo = init_topology(2, 1, "cpu")
    results = {}
    for schedule, m in cases:
        _, runner = _sleep_pipeline(topo, schedule, m)
        x, target = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
        times = [runner.step(x, {}, target)[1] for _ in range(3)][1:]  # the first step infers shapes
        results[(schedule, m)] = [(t.step_s, t.compute_s, len(t.intervals)) for t in times]

    # the monitor, through the observer, on a steady run and then with stage 1 four times slower (forward 10x)
    config = build_config({"pipeline": {"microbatches": 2}, "observe": {"log_every": 0, "timeline_step": 0}})
    observer = PipelineObserver(config, topo, Path(out_dir), 0, 0.0)
    module, runner = _sleep_pipeline(topo, "1f1b", 2)
    x, target = torch.randn(8, 8), torch.randn(8, 8)
    actions = []
    for step in range(12):
        module.units[0].slowdown = 10.0 if step == 11 and topo.pp_rank == 1 else 1.0
        actions.append(observer.after_step(step, {}, runner.step(x, {}, target)[1]))
    module.units[0].slowdown = 10.0 if topo.pp_rank == 1 else 1.0  # a new bucket's first step: it compiles
    actions.append(observer.after_step(12, {"bucket": "64x64"}, runner.step(x, {}, target)[1]))
    results["actions"] = actions
    torch.save(results, os.path.join(out_dir, f"rank{topo.rank}.pt"))


CASES = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]


def test_measured_compute_and_bubble_match_theory(tmp_path):
    """Bounds that hold however busy the machine is: a sleep never ends early, so each stage computes at least
    m (F + B) and the step lasts at least (m + 1)(F + B), the schedule's critical path; everything extra is
    overhead, which a loaded machine stretches. So the lower bounds are exact and the upper ones are a sanity
    check (half again the theory), not a timing claim; bubble within 0.15 of (S - 1) / (m + S - 1)."""
    run_workers(_worker, (CASES, str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    unit = FORWARD_S + BACKWARD_S
    for schedule, m in CASES:
        for steps in zip(*(r[(schedule, m)] for r in ranks)):
            window = max(step_s for step_s, _, _ in steps)
            assert (m + 1) * unit <= window <= 1.5 * (m + 1) * unit, (schedule, m, window)
            for step_s, compute_s, count in steps:
                assert count == 2 * m  # one forward and one backward interval per micro-batch
                assert m * unit <= compute_s <= min(step_s, 1.5 * m * unit), (schedule, m, compute_s)
                bubble = (window - compute_s) / window
                assert bubble == pytest.approx(1 / (m + 1), abs=0.15), (schedule, m, bubble)


def test_monitor_fires_on_a_slowed_stage_only(tmp_path):
    run_workers(_worker, (CASES[:1], str(tmp_path)), 2)
    for rank in range(2):
        actions = torch.load(tmp_path / f"rank{rank}.pt")["actions"]
        assert actions[:11] == ["continue"] * 11  # steady: silent (the first step included)
        assert actions[11] == "warn"  # every rank gets the decision
        assert actions[12] == "continue"  # a new bucket's first step, as slow, is its own shape's first

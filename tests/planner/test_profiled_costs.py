"""Profiling measures every unit, and the planner splits by the measured times, not by FLOPs. (Whether the times
predict stage times is a timing claim: bench/profile_accuracy.py measures it.)"""
from __future__ import annotations

import dataclasses
import math

import torch

from diffpipe.build import build_backbone, example_inputs
from diffpipe.config_files import build_config
from diffpipe.pipeline.schedules import ScheduleChoice
from diffpipe.planner.costs import count_unit_costs, profile_unit_costs, save_profile
from diffpipe.planner.partition import Hardware, partition
from diffpipe.planner.plan import boundary_bytes, profile_key, unit_costs

MICRO = 4


def test_every_unit_is_timed_and_the_plan_follows_the_times():
    config = build_config({"train": {"batch_size": MICRO * 4}, "pipeline": {"microbatches": 4}})
    meta, real = build_backbone(config, "meta"), build_backbone(config)
    examples = example_inputs(config, meta, MICRO)
    costs = count_unit_costs(meta, *examples)
    inputs, conditions = example_inputs(config, real, MICRO)
    profile_unit_costs(real, costs, inputs, conditions, torch.device("cpu"), None, repeats=2, warmup=1)
    assert all(0 < c.forward_s < math.inf and 0 <= c.backward_s < math.inf for c in costs)
    assert sum(c.backward_s > 0 for c in costs) >= len(costs) - 1  # the time embedding may have none to do

    bounds = boundary_bytes(meta, costs, examples[0])
    hw = Hardware(link_gbps=1e6)
    # the same measured times everywhere but one unit a hundred times slower: it must stand alone at the end
    even = [dataclasses.replace(c, forward_s=1e-3, backward_s=2e-3) for c in costs]
    slow_last = even[:-1] + [dataclasses.replace(even[-1], forward_s=0.1, backward_s=0.2)]
    assert partition(slow_last, bounds, 2, 4, ScheduleChoice.named("1f1b"), hw).starts == [len(costs) - 1]
    slow_first = [dataclasses.replace(even[0], forward_s=0.1, backward_s=0.2)] + even[1:]
    assert partition(slow_first, bounds, 2, 4, ScheduleChoice.named("1f1b"), hw).starts == [1]


def test_a_cpu_profile_keeps_the_counted_memory_at_the_planned_micro_batch(tmp_path):
    """A profile measured on the CPU gives times but no memory: the counted activation and weight-pass bytes are
    kept, at the micro-batch planned (not at the one micro-batch they are counted for)."""
    config = build_config({"train": {"batch_size": MICRO * 4}, "pipeline": {"microbatches": 4}})
    meta = build_backbone(config, "meta")
    counted = unit_costs(config, meta, 2 * MICRO)
    measured = [dataclasses.replace(c, forward_s=1e-3, backward_s=2e-3, activation_bytes=0, weight_pass_bytes=0)
                for c in count_unit_costs(meta, *example_inputs(config, meta, MICRO))]
    path = tmp_path / "profile.json"
    save_profile(measured, profile_key(config, MICRO, "cpu"), path)
    profiled = unit_costs(config.model_copy(update={"plan": config.plan.model_copy(update={"profile": str(path)})}),
                          meta, 2 * MICRO)
    assert [c.forward_s for c in profiled] == [2e-3] * len(counted)  # the times, at twice the micro-batch
    assert [c.activation_bytes for c in profiled] == [c.activation_bytes for c in counted]
    assert [c.weight_pass_bytes for c in profiled] == [c.weight_pass_bytes for c in counted]

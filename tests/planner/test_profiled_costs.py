"""Profiled unit times predict measured stage times (CPU, the digits UNet), and the planned split built on
them is no slower than the parameter-count split when the stages are measured."""
from __future__ import annotations

import time

import torch

from diffpipe.build import build_backbone, example_inputs
from diffpipe.config import build_config
from diffpipe.pipeline.split import balanced_by_parameters, stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.planner.costs import count_unit_costs, profile_unit_costs
from diffpipe.planner.partition import Hardware, estimate_stages, partition
from diffpipe.planner.plan import boundary_bytes

MICRO = 32


def _inputs(config, backbone):
    inputs, conditions = example_inputs(config, backbone, MICRO)
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(v.shape, generator=gen) for k, v in inputs.items()}
    conditions = {k: torch.randn(v.shape, generator=gen) if k != "timestep" else torch.full(v.shape, 500.0)
                  for k, v in conditions.items()}
    return inputs, conditions


def _measure_stages(backbone, starts, inputs, conditions, repeats=9, warmup=2) -> list[float]:
    """Forward + backward seconds of each stage alone, fed the real tensors that cross its boundary."""
    modules = build_stage_modules(backbone, stage_specs(backbone, starts))
    received = (inputs["sample"],)
    times = []
    for module in modules:
        samples = []
        for _ in range(warmup + repeats):
            args = tuple(t.detach().requires_grad_(t.is_floating_point() and module.spec.index > 0) for t in received)
            start = time.perf_counter()
            out = module(*args, **conditions)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            samples.append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
        times.append(min(samples[warmup:]))  # as the profiler: fastest run
        received = tuple(o.detach() for o in outs)
    return times


def test_profiled_stage_times_within_25_percent_and_plan_no_slower_than_parameter_split():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: timings that do not depend on what the other core is doing
    try:
        _check_profile_against_measurement()
    finally:
        torch.set_num_threads(threads)


def _check_profile_against_measurement():
    config = build_config({"train": {"batch_size": MICRO * 4}, "pipeline": {"microbatches": 4}})
    meta = build_backbone(config, "meta")
    real = build_backbone(config)
    inputs, conditions = _inputs(config, real)
    costs = count_unit_costs(meta, *example_inputs(config, meta, MICRO))
    profile_unit_costs(real, costs, inputs, conditions, torch.device("cpu"), None)
    bounds = boundary_bytes(meta, costs, example_inputs(config, meta, MICRO)[0])
    hw = Hardware(link_gbps=1e6)  # stages measured alone: no sends
    planned = partition(costs, bounds, 2, 4, "1f1b", hw)
    by_params = estimate_stages(costs, bounds, balanced_by_parameters(real, 2), 4, "1f1b", hw)

    measured = {}
    for name, part in (("planned", planned), ("parameters", by_params)):
        measured[name] = _measure_stages(real, part.starts, inputs, conditions)
        for stage, seconds in zip(part.stages, measured[name]):
            predicted = stage.forward_s + stage.backward_s
            assert abs(predicted - seconds) <= 0.25 * seconds, (name, stage.index, predicted, seconds)
    print({k: [round(s * 1e3, 2) for s in v] for k, v in measured.items()},
          {"planned": planned.starts, "parameters": by_params.starts},
          [round((s.forward_s + s.backward_s) * 1e3, 2) for s in planned.stages + by_params.stages])
    assert max(measured["planned"]) <= 1.1 * max(measured["parameters"])  # 10 %: timing noise on a shared CPU

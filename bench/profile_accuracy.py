"""Do profiled unit times predict measured stage times? The digits UNet, 2 stages, on this machine's CPU.

    python bench/profile_accuracy.py [--micro 32]

Profiles each unit (the measurement of `diffpipe plan --profile`), plans 2 stages from the profile and splits by
parameter count, then times each stage of both splits alone (forward + backward, fastest of 9 runs) and prints,
per stage, the predicted and measured milliseconds and their ratio (JSON lines), and whether the planned split's
slowest stage is within 10 % of the parameter split's. Single-threaded, so the other core's work disturbs it
less. A timing claim, so it lives here and not in the unit tests (which failed it under load).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.build import build_backbone, example_inputs  # noqa: E402
from diffpipe.config_files import build_config  # noqa: E402
from diffpipe.pipeline.split import balanced_by_parameters, stage_specs  # noqa: E402
from diffpipe.pipeline.stage import build_stage_modules  # noqa: E402
from diffpipe.pipeline.schedules import ScheduleChoice
from diffpipe.planner.costs import count_unit_costs, profile_unit_costs  # noqa: E402
from diffpipe.planner.partition import Hardware, estimate_stages, partition  # noqa: E402
from diffpipe.planner.plan import boundary_bytes  # noqa: E402


def _inputs(config, backbone, micro: int):
    inputs, conditions = example_inputs(config, backbone, micro)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=32, help="micro-batch size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = build_config({"train": {"batch_size": args.micro * 4}, "pipeline": {"microbatches": 4}})
    meta = build_backbone(config, "meta")
    real = build_backbone(config)
    inputs, conditions = _inputs(config, real, args.micro)
    costs = count_unit_costs(meta, *example_inputs(config, meta, args.micro))
    profile_unit_costs(real, costs, inputs, conditions, torch.device("cpu"), None)
    bounds = boundary_bytes(meta, costs, example_inputs(config, meta, args.micro)[0])
    hw = Hardware(link_gbps=1e6)  # stages measured alone: no sends
    splits = {"planned": partition(costs, bounds, 2, 4, ScheduleChoice.named("1f1b"), hw),
              "parameters": estimate_stages(costs, bounds, balanced_by_parameters(real, 2), 4, ScheduleChoice.named("1f1b"), hw)}
    slowest = {}
    for name, part in splits.items():
        measured = _measure_stages(real, part.starts, inputs, conditions)
        slowest[name] = max(measured)
        for stage, seconds in zip(part.stages, measured):
            predicted = stage.forward_s + stage.backward_s
            print(json.dumps({"split": name, "starts": part.starts, "stage": stage.index,
                              "predicted_ms": round(predicted * 1e3, 2), "measured_ms": round(seconds * 1e3, 2),
                              "predicted_over_measured": round(predicted / seconds, 3)}), flush=True)
    print(json.dumps({"planned_slowest_over_parameter_slowest": round(slowest["planned"] / slowest["parameters"], 3),
                      "within_10_percent": slowest["planned"] <= 1.1 * slowest["parameters"]}))


if __name__ == "__main__":
    main()

"""Per-stage probe: run each stage of a plan alone on this device, fed synthetic boundary tensors of the right
shapes, and compare its measured forward+backward time and peak memory with the planner's prediction.

    python bench/stage_probe.py examples/sdxl_unet.toml [--set KEY=VALUE ...] [--repeats 5]

Uses the unit profile named by plan.profile when it exists (make it with `diffpipe plan CONFIG --profile`),
else FLOP-based times. Prints one JSON line per stage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.build import AUTOCAST_DTYPES, build_backbone, example_inputs  # noqa: E402
from diffpipe.config import load_config  # noqa: E402
from diffpipe.pipeline.split import stage_specs  # noqa: E402
from diffpipe.pipeline.stage import build_stage_modules  # noqa: E402
from diffpipe.pipeline.traffic import trace_shapes  # noqa: E402
from diffpipe.planner.plan import hardware, make_plan  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = build_backbone(config, "meta")
    p = config.pipeline
    plan = make_plan(config, meta, p.stages * p.virtual_stages, p.data_parallel, p.microbatches, hardware(config))
    micro = plan.micro_batch_size
    inputs, conditions = example_inputs(config, meta, micro)
    shapes_after = trace_shapes(meta, inputs, conditions)
    real = build_backbone(config)
    dtype = AUTOCAST_DTYPES[config.train.precision]
    modules = build_stage_modules(real, stage_specs(real, plan.planned.starts), dtype)
    conditions = {k: (torch.full(v.shape, 500.0) if k == "timestep" else torch.randn(v.shape)).to(device)
                  for k, v in conditions.items()}
    for module, predicted in zip(modules, plan.planned.stages):
        module.to(device)
        act_dtype = dtype if dtype is not None else torch.float32
        shapes = shapes_after[module.spec.first - 1] if module.spec.first > 0 else inputs
        received = [torch.randn(shapes[n].shape if n in inputs else shapes[n], device=device,
                                dtype=torch.float32 if n == "sample" or module.spec.index == 0 else act_dtype)
                    for n in module.spec.receives]
        torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
        times = []
        for _ in range(args.repeats + 2):
            args_in = [t.detach().requires_grad_(module.spec.index > 0) for t in received]
            _sync(device)
            start = time.perf_counter()
            out = module(*args_in, **conditions)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            _sync(device)
            times.append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
        measured = min(times[2:])
        expect = predicted.forward_s + predicted.backward_s
        print(json.dumps({"stage": module.spec.index, "units": f"{module.unit_list[0].name}..{module.unit_list[-1].name}",
                          "micro_batch": micro, "measured_fwd_bwd_ms": round(measured * 1e3, 2),
                          "planned_fwd_bwd_ms": round(expect * 1e3, 2), "error": round(expect / measured - 1, 3),
                          "peak_gib_no_optimizer": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                          if device.type == "cuda" else None}), flush=True)
        module.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Per-stage probe: run each stage of a plan alone on this device, fed synthetic boundary tensors of the right
shapes, and compare its measured forward+backward time and peak memory with the planner's prediction.

    python bench/stage_probe.py examples/sdxl_unet.toml [--set KEY=VALUE ...] [--repeats 5] [--optimizer] [--unsplit]

Each stage holds as many micro-batches in flight as its schedule makes it hold at its peak (1F1B: stages - s)
and is checkpointed if the plan says so; with --optimizer it also keeps AdamW state, so its peak is what the
stage would need on a GPU of its own. --unsplit first probes the whole model the same way (one micro-batch),
the figure the stages' peaks are compared with. Uses the unit profile named by plan.profile when it exists
(make it with `diffpipe plan CONFIG --profile`), else FLOP-based times. Prints one JSON line per stage.
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
from diffpipe.planner.partition import in_flight  # noqa: E402
from diffpipe.planner.plan import hardware, make_plan  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _probe(module, received, conditions, device, in_flight: int, repeats: int, optimizer: bool) -> tuple[float, float]:
    """Seconds of forward+backward per micro-batch (best of `repeats`) and peak bytes (None off CUDA)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda") if optimizer else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats + 2):
        module.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        held = []
        for _ in range(in_flight):  # forwards of the micro-batches in flight, then their backwards
            args_in = [t.detach().requires_grad_(module.spec.index > 0) for t in received]
            out = module(*args_in, **conditions)
            held.append(out if isinstance(out, tuple) else (out,))
        for outs in held:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        del held, outs, out
        _sync(device)
        times.append((time.perf_counter() - start) / in_flight)
        if opt is not None:
            opt.step()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    del opt
    module.zero_grad(set_to_none=True)
    return min(times[2:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--optimizer", action="store_true", help="keep AdamW state, as training does")
    parser.add_argument("--unsplit", action="store_true", help="first probe the whole model as one stage")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = build_backbone(config, "meta")
    p = config.pipeline
    stages = p.stages * p.virtual_stages
    plan = make_plan(config, meta, stages, p.data_parallel, p.microbatches, hardware(config))
    micro = plan.micro_batch_size
    inputs, conditions = example_inputs(config, meta, micro)
    shapes_after = trace_shapes(meta, inputs, conditions)
    real = build_backbone(config)
    dtype = AUTOCAST_DTYPES[config.train.precision]
    act_dtype = dtype if dtype is not None else torch.float32
    conditions = {k: (torch.full(v.shape, 500.0) if k == "timestep" else torch.randn(v.shape)).to(device)
                  for k, v in conditions.items()}
    unsplit_peak = None
    if args.unsplit:
        whole = build_stage_modules(real, stage_specs(real, []), dtype)[0].to(device)
        seconds, unsplit_peak = _probe(whole, [torch.randn(inputs["sample"].shape, device=device)], conditions,
                                       device, 1, args.repeats, args.optimizer)
        print(json.dumps({"stage": "unsplit", "micro_batch": micro, "measured_fwd_bwd_ms": round(seconds * 1e3, 2),
                          "peak_gib": None if unsplit_peak is None else round(unsplit_peak / 2**30, 2),
                          "optimizer_state": args.optimizer}), flush=True)
        whole.to("cpu")
        del whole
        if device.type == "cuda":
            torch.cuda.empty_cache()
    checkpointed = frozenset(s.index for s in plan.planned.stages if s.checkpointed)
    modules = build_stage_modules(real, stage_specs(real, plan.planned.starts), dtype, checkpointed)
    for module, predicted in zip(modules, plan.planned.stages):
        module.to(device)
        shapes = shapes_after[module.spec.first - 1] if module.spec.first > 0 else inputs
        received = [torch.randn(shapes[n].shape if n in inputs else shapes[n], device=device,
                                dtype=torch.float32 if n == "sample" or module.spec.index == 0 else act_dtype)
                    for n in module.spec.receives]
        held = in_flight(p.schedule, module.spec.index, stages, p.microbatches)
        seconds, peak = _probe(module, received, conditions, device, held, args.repeats, args.optimizer)
        expect = predicted.forward_s + predicted.backward_s
        row = {"stage": module.spec.index, "units": f"{module.unit_list[0].name}..{module.unit_list[-1].name}",
               "micro_batch": micro, "in_flight": held, "checkpointed": module.checkpointed,
               "measured_fwd_bwd_ms": round(seconds * 1e3, 2), "planned_fwd_bwd_ms": round(expect * 1e3, 2),
               "error": round(expect / seconds - 1, 3), "optimizer_state": args.optimizer,
               "peak_gib": None if peak is None else round(peak / 2**30, 2),
               "planned_peak_gib": round(predicted.memory_bytes / 2**30, 2)}
        if peak is not None and unsplit_peak:
            row["peak_vs_unsplit"] = round(peak / unsplit_peak, 3)
        print(json.dumps(row), flush=True)
        module.to("cpu")
        del received
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

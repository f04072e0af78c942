"""Each stage of a plan run alone on this machine's device, to check the plan against the hardware.

A stage gets synthetic tensors of the shapes its boundary receives, holds as many micro-batches in flight as
its schedule makes it hold at its peak (1F1B: stages - s), is checkpointed where the plan says so and keeps
AdamW state; its forward+backward time per micro-batch and (on CUDA) its peak memory are what it would take on
a device of its own, beside what the planner predicted.

    diffpipe plan examples/sdxl_unet.toml --probe [--probe-unsplit]
"""
from __future__ import annotations

import time

import torch

from ..build import build_backbone, example_inputs
from ..precision import AUTOCAST_DTYPES
from ..config import RunConfig
from ..models.units import Backbone
from ..pipeline.split import stage_specs
from ..pipeline.stage import StageModule, build_stage_modules
from ..pipeline.traffic import trace_shapes
from .costs import sync
from .plan import Plan

__all__ = ["probe_stage", "probe_plan", "format_probe"]

GIB = 2**30


def probe_stage(module: StageModule, received: list[torch.Tensor], conditions: dict[str, torch.Tensor],
                device: torch.device, held: int, repeats: int = 3, optimizer: bool = True) -> tuple[float, int | None]:
    """Best-of-`repeats` seconds of forward+backward per micro-batch with `held` micro-batches in flight, and
    peak bytes allocated (None off CUDA). Two unmeasured rounds come first (allocator and kernel warm-up)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda") if optimizer and params else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats + 2):
        module.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        outputs = []
        for _ in range(held):  # the forwards of the micro-batches in flight, then their backwards
            args = [t.detach().requires_grad_(module.spec.index > 0) for t in received]
            out = module(*args, **conditions)
            outputs.append(out if isinstance(out, tuple) else (out,))
        for outs in outputs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        outputs.clear()
        sync(device)
        times.append((time.perf_counter() - start) / held)
        if opt is not None:
            opt.step()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    module.zero_grad(set_to_none=True)
    return min(times[2:]), peak


def _synthetic(config: RunConfig, meta: Backbone, micro: int, device: torch.device):
    """Inputs, conditions, and the shapes of every live tensor after each unit, at micro-batch `micro`."""
    inputs, conditions = example_inputs(config, meta, micro)
    shapes_after = trace_shapes(meta, inputs, conditions)
    conditions = {k: (torch.full(v.shape, 500.0) if k == "timestep" else torch.randn(v.shape)).to(device)
                  for k, v in conditions.items()}
    return inputs, conditions, shapes_after


def probe_plan(config: RunConfig, meta: Backbone, plan: Plan, device: torch.device, repeats: int = 3,
               optimizer: bool = True, unsplit: bool = False) -> list[dict]:
    """One row per planned stage (and first the whole model as one stage, with `unsplit`): probed against planned."""
    p = config.pipeline
    dtype = AUTOCAST_DTYPES[config.train.precision]
    boundary_dtype = dtype if dtype is not None else torch.float32
    micro = plan.micro_batch_size
    inputs, conditions, shapes_after = _synthetic(config, meta, micro, device)
    real = build_backbone(config)
    rows, unsplit_peak = [], None
    if unsplit:
        whole = build_stage_modules(real, stage_specs(real, []), dtype)[0].to(device)
        seconds, unsplit_peak = probe_stage(whole, [torch.randn(inputs["sample"].shape, device=device)], conditions,
                                            device, 1, repeats, optimizer)
        rows.append({"stage": "unsplit", "units": "all", "micro_batch": micro, "in_flight": 1, "checkpointed": False,
                     "probed_ms": round(seconds * 1e3, 2), "probed_peak_gib": _gib(unsplit_peak)})
        whole.to("cpu")
        del whole
        _free(device)
    checkpointed = frozenset(s.index for s in plan.planned.stages if s.checkpointed)
    modules = build_stage_modules(real, stage_specs(real, plan.planned.starts), dtype, checkpointed)
    for module, predicted in zip(modules, plan.planned.stages):
        module.to(device)
        shapes = shapes_after[module.spec.first - 1] if module.spec.first > 0 else {}
        received = [torch.randn(inputs[n].shape if n in inputs else shapes[n], device=device,
                                dtype=torch.float32 if n in inputs else boundary_dtype)
                    for n in module.spec.receives]
        held = plan.planned.schedule.in_flight(module.spec.index, plan.stages, plan.microbatches)
        seconds, peak = probe_stage(module, received, conditions, device, held, repeats, optimizer)
        planned_s = predicted.forward_s + predicted.backward_s
        row = {"stage": module.spec.index, "units": f"{module.unit_list[0].name}..{module.unit_list[-1].name}",
               "micro_batch": micro, "in_flight": held, "checkpointed": module.checkpointed,
               "planned_ms": round(planned_s * 1e3, 2), "probed_ms": round(seconds * 1e3, 2),
               "time_error": round(planned_s / seconds - 1, 3),
               "planned_peak_gib": round(predicted.memory_bytes / GIB, 2), "probed_peak_gib": _gib(peak)}
        if peak is not None and unsplit_peak:
            row["peak_vs_unsplit"] = round(peak / unsplit_peak, 3)
        rows.append(row)
        module.to("cpu")
        del received
        _free(device)
    return rows


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 2)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_probe(rows: list[dict], device: torch.device) -> str:
    lines = [f"\neach planned stage run alone on {device.type} (AdamW state kept, micro-batches in flight as 1F1B holds them):",
             f"  {'stage':>7} {'units':<26} {'in flight':>9} {'planned ms':>11} {'probed ms':>10} {'error':>7} "
             f"{'planned GiB':>12} {'probed GiB':>11}"]
    for r in rows:
        probed_gib = "-" if r["probed_peak_gib"] is None else f"{r['probed_peak_gib']:.2f}"
        lines.append(f"  {r['stage']!s:>7} {r['units']:<26} {r['in_flight']:>9} {r.get('planned_ms', '-')!s:>11} "
                     f"{r['probed_ms']:>10.2f} {_percent(r.get('time_error')):>7} "
                     f"{r.get('planned_peak_gib', '-')!s:>12} {probed_gib:>11}")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"

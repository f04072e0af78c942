"""Each stage of a plan run alone on this machine's device, to check the plan against the hardware.

A stage gets synthetic tensors of the shapes its boundary receives, holds as many micro-batches in flight as
its schedule makes it hold at its peak (1F1B: stages - s), is checkpointed where the plan says so and keeps
AdamW state; its forward+backward time per micro-batch and (on CUDA) its peak memory are what it would take on
a device of its own, beside what the planner predicted.

    diffpipe plan examples/sdxl_unet.toml --probe [--probe-unsplit]
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

import torch

from ..build import build_backbone, build_stages, example_inputs
from ..config import RunConfig
from ..models.units import Backbone
from ..pipeline.split import stage_specs
from ..pipeline.stage import StageModule
from ..pipeline.traffic import trace_shapes
from ..precision import AUTOCAST_DTYPES
from ..planner.costs import needs_grad, sync
from ..planner.levers import plan_memory
from ..planner.plan import Plan
from .optim import make_optimizer

__all__ = ["probe_stage", "probe_plan", "probed_samples_per_s", "format_probe"]

GIB = 2**30


def probe_stage(module: StageModule, received: list[torch.Tensor], conditions: dict[str, torch.Tensor],
                device: torch.device, held: int, repeats: int = 3, optimizer: bool = True,
                config: RunConfig | None = None) -> tuple[float, int | None]:
    """Best-of-`repeats` seconds of forward+backward per micro-batch with `held` micro-batches in flight, and
    peak bytes allocated (None off CUDA). Each of `received` needs a gradient where the pipeline's would. Two
    unmeasured rounds come first (allocator and kernel warm-up). The optimizer is the run's (`config`:
    memory.optimizer_state), else torch's AdamW."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = None
    if optimizer and params:
        opt = (make_optimizer([(params, 1.0)], config.train, config.memory.optimizer_state)[0] if config is not None
               else torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats + 2):
        module.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        outputs = []
        for _ in range(held):  # the forwards of the micro-batches in flight, then their backwards
            args = [t.detach().requires_grad_(t.requires_grad) for t in received]
            out = module(*args, **conditions)
            outputs.append(out if isinstance(out, tuple) else (out,))
        for outs in outputs:  # a LoRA run's stage may send tensors no trained weight made (Flux's rope)
            outs = [o for o in outs if o.requires_grad]
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
               optimizer: bool = True, unsplit: bool = False, only: list[int] | None = None) -> list[dict]:
    """One row per planned stage (`only` these, where given; and first the whole model as one stage, with
    `unsplit`): probed against planned.
    Each stage is built as the trainer builds it (LoRA, memory.base_dtype, block swap and the optimizer's state as
    the plan holds them), alone, from a fresh meta backbone: the host holds one stage's weights at a time. A stage
    that runs out of the device's memory gets a row saying so."""
    config = config.model_copy(update={"memory": config.memory.model_copy(update=vars(plan_memory(config, plan)))})
    dtype = AUTOCAST_DTYPES[config.train.precision]
    boundary_dtype = dtype if dtype is not None else torch.float32
    micro = plan.micro_batch_size
    inputs, conditions, shapes_after = _synthetic(config, meta, micro, device)
    grad_names = needs_grad(meta)
    rows, unsplit_peak = [], None
    if unsplit:
        row = {"stage": "unsplit", "units": "all", "micro_batch": micro, "in_flight": 1, "checkpointed": False}
        whole = _StageToProbe([], 0, [], [(inputs["sample"].shape, torch.float32, False)], held=1)
        seconds, unsplit_peak = _probe_built(config, whole, conditions, device, repeats, optimizer)
        rows.append({**row, **_probed(seconds, unsplit_peak)})
    recomputed = [s.recomputed for s in plan.planned.stages]
    specs = stage_specs(meta, plan.planned.starts)
    for spec, predicted in zip(specs, plan.planned.stages):
        if only is not None and spec.index not in only:
            continue
        shapes = shapes_after[spec.first - 1] if spec.first > 0 else {}
        # a received tensor needs a gradient only where a trained weight made it, as the pipeline carries it (a
        # LoRA run's Flux rope does not: given one, every block keeps fp32 copies of its queries and keys for it)
        received = [(inputs[n].shape, torch.float32, False) if n in inputs
                    else (shapes[n], boundary_dtype, n in grad_names) for n in spec.receives]
        held = plan.planned.schedule.in_flight(spec.index, plan.stages, plan.microbatches)
        stage = _StageToProbe(plan.planned.starts, spec.index, recomputed, received, held)
        seconds, peak = _probe_built(config, stage, conditions, device, repeats, optimizer)
        planned_s = predicted.forward_s + predicted.backward_s
        units = f"{meta.units[spec.first].name}..{meta.units[spec.last - 1].name}"
        row = {"stage": spec.index, "units": units, "micro_batch": micro, "in_flight": held,
               "checkpointed": predicted.checkpointed, "recomputed_units": predicted.recomputed,
               "planned_ms": round(planned_s * 1e3, 2),
               **_probed(seconds, peak), "planned_peak_gib": round(predicted.memory_bytes / GIB, 2)}
        if seconds is not None:
            row["time_error"] = round(planned_s / seconds - 1, 3)
        if peak is not None and unsplit_peak:
            row["peak_vs_unsplit"] = round(peak / unsplit_peak, 3)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class _StageToProbe:
    starts: list[int]  # the plan's split
    index: int
    recomputed: list[int]  # the plan's checkpointed units, counted from each stage's end
    # the shape and dtype of each tensor the stage receives, and whether it needs a gradient
    received: list[tuple[torch.Size, torch.dtype, bool]]
    held: int  # micro-batches in flight


def _probe_built(config: RunConfig, stage: _StageToProbe, conditions, device: torch.device, repeats: int,
                 optimizer: bool):
    """`probe_stage` of a stage built here and freed after; (None, None) where it runs out of the device's memory."""
    backbone = build_backbone(config, "meta")
    module = None
    try:
        module = build_stages(config, backbone, stage_specs(backbone, stage.starts), [stage.index], device,
                              stage.recomputed)[0]
        received = [torch.randn(shape, device=device, dtype=dtype).requires_grad_(grad)
                    for shape, dtype, grad in stage.received]
        return probe_stage(module, received, conditions, device, stage.held, repeats, optimizer, config)
    except torch.cuda.OutOfMemoryError:
        return None, None
    finally:
        del module, backbone
        _free(device)


def _probed(seconds: float | None, peak: int | None) -> dict:
    if seconds is None:
        return {"probed_ms": None, "probed_peak_gib": None, "out_of_memory": True}
    return {"probed_ms": round(seconds * 1e3, 2), "probed_peak_gib": _gib(peak)}


def probed_samples_per_s(plan: Plan, rows: list[dict]) -> float | None:
    """The plan's samples/s with each stage's compute time as probed (its planned sends kept): what the pipeline
    would train at with each stage on a device of its own. None where a stage was not probed or ran out of memory."""
    probed = {r["stage"]: r["probed_ms"] for r in rows}
    if any(probed.get(s.index) is None for s in plan.planned.stages):
        return None
    stages = tuple(replace(s, forward_s=probed[s.index] / 1e3, backward_s=0.0) for s in plan.planned.stages)
    return plan.samples_per_s_of(replace(plan.planned, stages=stages))


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 2)


def _free(device: torch.device) -> None:
    """Give back the memory of a stage just probed. Its modules sit in reference cycles (peft's and the swap's
    hooks), which only the cycle collector frees: on a GPU a stage of Flux.1-dev was still held when the next was
    built, which then ran out of memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_probe(rows: list[dict], device: torch.device, samples_per_s: float | None = None) -> str:
    lines = [f"\neach planned stage run alone on {device.type} (built as the run builds it, its optimizer's state kept, "
             "micro-batches in flight as the schedule holds them):",
             f"  {'stage':>7} {'units':<26} {'in flight':>9} {'planned ms':>11} {'probed ms':>10} {'error':>7} "
             f"{'planned GiB':>12} {'probed GiB':>11}"]
    for r in rows:
        probed_ms = "out of memory" if r.get("out_of_memory") else f"{r['probed_ms']:.2f}"
        probed_gib = "-" if r["probed_peak_gib"] is None else f"{r['probed_peak_gib']:.2f}"
        lines.append(f"  {r['stage']!s:>7} {r['units']:<26} {r['in_flight']:>9} {r.get('planned_ms', '-')!s:>11} "
                     f"{probed_ms:>10} {_percent(r.get('time_error')):>7} "
                     f"{r.get('planned_peak_gib', '-')!s:>12} {probed_gib:>11}")
    if samples_per_s is not None:
        lines.append(f"with each stage on a device of its own at the probed times (planned sends kept): "
                     f"{samples_per_s:.3f} samples/s")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"

"""A plan in words and as JSON (the planned split beside the parameter-count split), and unit profiles measured on
this machine's device: what `diffpipe plan` (commands/plan.py) prints and saves."""
from __future__ import annotations

import re

import torch

from ..build import build_backbone, choose_attention, example_inputs
from ..precision import AUTOCAST_DTYPES, moment_bytes
from ..config import ConfigError, RunConfig
from ..models.units import Backbone
from ..pipeline.split import live_after
from .costs import count_unit_costs, profile_unit_costs, save_profile
from .partition import Partition
from .plan import Plan, planning_device, profile_key

__all__ = ["parse_memory", "format_plan", "plan_as_dict", "write_profile"]

GIB = 2**30

def parse_memory(text: str) -> float:
    """'80GiB', '80G', '80' (GiB) or '512MiB' -> GiB."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|GB|G|MiB|MB|M)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(f"--gpu-memory {text!r}: give a size such as 80GiB or 512MiB")
    value, unit = float(match.group(1)), (match.group(2) or "GiB").lower()
    return value / 1024 if unit.startswith("m") else value


def _stage_rows(part: Partition, meta: Backbone, trainable: list[int]) -> list[dict]:
    rows = []
    for s in part.stages:
        carried = list(live_after(meta, s.last - 1)) if s.last < len(meta.units) else []  # to the next stage
        rows.append({"stage": s.index, "units": f"{meta.units[s.first].name}..{meta.units[s.last - 1].name}",
                     "trainable_params_M": round(sum(trainable[s.first:s.last]) / 1e6, 2),
                     "forward_ms": round(s.forward_s * 1e3, 3), "backward_ms": round(s.backward_s * 1e3, 3),
                     "send_ms": round(s.send_s * 1e3, 3), "peak_GiB": round(s.memory_bytes / GIB, 2),
                     "checkpointed": s.checkpointed, "sends": carried})
    return rows


def plan_as_dict(plan: Plan, meta: Backbone) -> dict:
    trainable = [sum(p.numel() for p in u.module.parameters() if p.requires_grad) for u in meta.units]

    def summary(part: Partition) -> dict:
        return {"split": part.starts, "slowest_stage_ms": round(part.slowest_s * 1e3, 3),
                "allreduce_ms": round(plan.allreduce_s(part) * 1e3, 3), "step_s": round(plan.step_s(part), 5),
                "bubble_fraction": round(part.bubble_fraction, 4), "samples_per_s": round(plan.samples_per_s_of(part), 3),
                "process_peak_GiB": [round(b / GIB, 2) for b in part.process_memory_bytes],
                "stages": _stage_rows(part, meta, trainable)}

    return {"stages": plan.stages, "data_parallel": plan.data_parallel, "microbatches": plan.microbatches,
            "micro_batch_size": plan.micro_batch_size, "planned": summary(plan.planned),
            "by_parameters": summary(plan.by_parameters)}


def _params(meta: Backbone) -> int:
    return sum(p.numel() for p in meta.model.parameters())


def format_plan(plan: Plan, meta: Backbone) -> str:
    d = plan_as_dict(plan, meta)
    ranks = plan.planned.schedule.ranks(plan.stages)
    per_process = f" ({plan.stages // ranks} stages per process)" if plan.stages > ranks else ""
    held = plan.replicas
    frozen = f"; frozen weights held in {held.frozen.name} (memory.base_dtype)"
    if held.block_swap:
        frozen += f", those of {held.block_swap} units per stage in host memory (memory.block_swap)"
    lines = [f"{ranks} pipeline processes{per_process} x {d['data_parallel']} data parallel, {d['microbatches']} "
             f"micro-batches of {d['micro_batch_size']}"
             + (frozen if sum(plan.trainable) < _params(meta) else "")
             + ("; AdamW's moments in 8 bits (memory.optimizer_state)" if held.moment_bytes == moment_bytes("8bit") else "")]
    for title, key in (("planned split", "planned"), ("parameter-count split", "by_parameters")):
        part = d[key]
        lines.append(f"\n{title} {part['split']}:")
        lines.append(f"  {'stage':>5} {'units':<22} {'params M':>9} {'fwd ms':>9} {'bwd ms':>9} {'send ms':>8} "
                     f"{'peak GiB':>9}  ckpt  sends")
        for r in part["stages"]:
            lines.append(f"  {r['stage']:>5} {r['units']:<22} {r['trainable_params_M']:>9.2f} {r['forward_ms']:>9.3f} "
                         f"{r['backward_ms']:>9.3f} {r['send_ms']:>8.3f} {r['peak_GiB']:>9.2f}  "
                         f"{'yes' if r['checkpointed'] else 'no ':<4}  {', '.join(r['sends']) or '-'}")
        lines.append(f"  slowest stage {part['slowest_stage_ms']:.3f} ms, data-parallel collectives "
                     f"{part['allreduce_ms']:.1f} ms, step {part['step_s']:.4f} s, bubble {part['bubble_fraction']:.1%}, "
                     f"{part['samples_per_s']:.2f} samples/s")
        if per_process:  # what must fit one device: the stages a process runs, together
            lines.append("  peak GiB by process: " + ", ".join(f"{gib:.2f}" for gib in part["process_peak_GiB"]))
    return "\n".join(lines)


def write_profile(config: RunConfig, meta: Backbone, path: str) -> None:
    """Each unit timed (and its memory measured, on CUDA) on this machine's device, saved to `path` for plans to use."""
    device = planning_device(config)
    micro = config.micro_batch_size
    costs = count_unit_costs(meta, *example_inputs(config, meta, micro))
    real = build_backbone(config)
    choose_attention(real, device)
    inputs, conditions = example_inputs(config, real, micro)
    inputs = {k: torch.randn_like(v) for k, v in inputs.items()}
    conditions = {k: torch.randn_like(v) if k != "timestep" else torch.full_like(v, 500.0)
                  for k, v in conditions.items()}
    profile_unit_costs(real, costs, inputs, conditions, device, AUTOCAST_DTYPES[config.train.precision])
    save_profile(costs, profile_key(config, micro, device.type), path)
    print(f"profiled {len(costs)} units at micro-batch {micro} on {device.type}; saved {path}")

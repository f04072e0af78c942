"""A plan in words and as JSON (the planned split beside the parameter-count split), and unit profiles measured on
this machine's device: what `diffpipe plan` (commands/plan.py) prints and saves."""
from __future__ import annotations

import re
import textwrap

import torch

from ..build import build_backbone, choose_attention, example_inputs
from ..precision import AUTOCAST_DTYPES, moment_bytes
from ..config import ConfigError, RunConfig
from ..models.units import Backbone
from ..pipeline.split import live_after
from .costs import count_unit_costs, profile_unit_costs, save_profile
from .partition import Partition
from .partition import Hardware
from .plan import Plan, planning_device, profile_key

__all__ = ["parse_memory", "format_plan", "plan_as_dict", "write_profile", "describe_layout", "rate", "assumptions",
           "explain", "COLUMNS"]

# what each column of a plan's table holds (printed under it, and in docs/planning.md)
COLUMNS = ("trained M: the stage's trained parameters, millions; fwd/bwd ms: one micro-batch's forward/backward; "
           "send ms: its sends to the next stage; peak GiB: the stage's memory at its peak (weights, optimizer state, "
           "activations in flight); ckpt: activations recomputed in the backward (yes: every unit; 12/59: the stage's "
           "last 12 of its 59 units); sends: the tensors it sends on")

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
                     "send_ms": round(s.send_s * 1e3, 3), "all_to_all_ms": round(s.exchange_s * 1e3, 3),
                     "peak_GiB": round(s.memory_bytes / GIB, 2),
                     "checkpointed": s.checkpointed, "recomputed_units": s.recomputed, "ckpt": s.checkpointed_words,
                     "sends": carried})
    return rows


def plan_as_dict(plan: Plan, meta: Backbone) -> dict:
    trainable = [sum(p.numel() for p in u.module.parameters() if p.requires_grad) for u in meta.units]

    def summary(part: Partition) -> dict:
        return {"split": part.starts, "slowest_stage_ms": round(part.slowest_s * 1e3, 3),
                "allreduce_ms": round(plan.allreduce_s(part) * 1e3, 3), "step_s": round(plan.step_s(part), 5),
                "bubble_fraction": round(part.bubble_fraction, 4), "samples_per_s": round(plan.samples_per_s_of(part), 3),
                "process_peak_GiB": [round(b / GIB, 2) for b in part.process_memory_bytes],
                "stages": _stage_rows(part, meta, trainable)}

    return {"stages": plan.stages, "data_parallel": plan.data_parallel,
            "sequence_parallel": plan.sequence_parallel, "microbatches": plan.microbatches,
            "micro_batch_size": plan.micro_batch_size, "planned": summary(plan.planned),
            "by_parameters": summary(plan.by_parameters)}


def _params(meta: Backbone) -> int:
    return sum(p.numel() for p in meta.model.parameters())


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def rate(samples_per_s: float) -> str:
    """Samples a second to two decimals, or to three significant figures below 1 (a long clip's 0.043)."""
    return f"{samples_per_s:.2f}" if samples_per_s >= 1 else f"{samples_per_s:.3g}"


def describe_layout(plan: Plan) -> str:
    """The layout in words: "a pipeline of 4 processes x 2 data-parallel replicas, 8 micro-batches of 2 samples"."""
    ranks = plan.planned.schedule.ranks(plan.stages)
    per_process = f" ({plan.stages // ranks} stages each)" if plan.stages > ranks else ""
    pipeline = "one process (no pipeline)" if plan.stages == 1 else f"a pipeline of {_count(ranks, 'process')}"
    sequence = (f" x {plan.sequence_parallel} processes sharing each sample's tokens"
                if plan.sequence_parallel > 1 else "")
    return (f"{pipeline.replace('processs', 'processes')}{per_process} x "
            f"{_count(plan.data_parallel, 'data-parallel replica')}{sequence}, "
            f"{_count(plan.microbatches, 'micro-batch')} of {_count(plan.micro_batch_size, 'sample')}"
            ).replace("batchs", "batches")


def assumptions(config: RunConfig, hw: Hardware) -> str:
    """The device the plan assumes, each figure with the key that sets it; on a machine without a GPU, how to plan
    for one (the CPU's own speed would make a GPU's plan read 0.00 samples/s)."""
    p = config.plan
    memory = (f"{hw.memory_bytes / GIB:.1f} GiB usable a device ({1 - p.memory_headroom:.0%} of "
              f"{hw.memory_bytes / GIB / (1 - p.memory_headroom):.1f}: plan.memory_headroom)"
              if hw.memory_bytes is not None else "memory unlimited (no plan.memory_gib, no GPU here)")
    lines = [f"assumed: {hw.tflops:g} TFLOP/s a device (plan.device_tflops), {hw.link_gbps:g} GB/s between stages "
             f"(plan.link_gbps), {hw.host_gbps:g} GB/s host to device (plan.host_gbps), {memory}"]
    if planning_device(config).type == "cpu" and p.device_tflops is None:
        lines.append(textwrap.fill(
            "no GPU here: times are this CPU's; to plan a GPU's, --set plan.device_tflops=300 (an H200's measured "
            "eager bf16 speed, the GPU default) and plan.link_gbps=100 (NVLink), or a figure for yours (`diffpipe "
            "plan --profile` on it measures each unit)", 118, initial_indent="  ", subsequent_indent="  "))
    return "\n".join(lines)


def format_plan(plan: Plan, meta: Backbone, config: RunConfig | None = None, hw: Hardware | None = None) -> str:
    d = plan_as_dict(plan, meta)
    ranks = plan.planned.schedule.ranks(plan.stages)
    per_process = plan.stages > ranks
    held = plan.replicas
    frozen = f"; frozen weights held in {held.frozen.name} (memory.base_dtype)"
    if held.block_swap:
        frozen += f", those of {held.block_swap} units per stage in host memory (memory.block_swap)"
    lines = [describe_layout(plan)
             + (frozen if sum(plan.trainable) < _params(meta) else "")
             + ("; AdamW's moments in 8 bits (memory.optimizer_state)" if held.moment_bytes == moment_bytes("8bit") else "")]
    if config is not None and hw is not None:
        lines.append(assumptions(config, hw))
    stages = plan.planned.stages
    params, trained = _params(meta) / 1e6, sum(plan.trainable) / 1e6
    lines.append(f"all {len(meta.units)} units: {params:,.1f} M parameters ({trained:,.2f} M trained); a micro-batch's forward {sum(st.forward_s for st in stages) * 1e3:,.1f} ms, backward "
                 f"{sum(st.backward_s for st in stages) * 1e3:,.1f} ms, all stages together")
    for title, key in (("planned split", "planned"), ("parameter-count split", "by_parameters")):
        part = d[key]
        lines.append(f"\n{title} {part['split']}:")
        lines.append(f"  {'stage':>5} {'units':<22} {'trained M':>9} {'fwd ms':>9} {'bwd ms':>9} {'send ms':>8} "
                     f"{'peak GiB':>9}  ckpt  sends")
        for r in part["stages"]:
            lines.append(f"  {r['stage']:>5} {r['units']:<22} {r['trainable_params_M']:>9.2f} {r['forward_ms']:>9.3f} "
                         f"{r['backward_ms']:>9.3f} {r['send_ms']:>8.3f} {r['peak_GiB']:>9.2f}  "
                         f"{r['ckpt']:<4}  {', '.join(r['sends']) or '-'}")
        lines.append(f"  slowest stage {part['slowest_stage_ms']:.3f} ms, data-parallel collectives "
                     f"{part['allreduce_ms']:.1f} ms, step {part['step_s']:.4f} s, bubble {part['bubble_fraction']:.1%}, "
                     f"{rate(part['samples_per_s'])} samples/s")
        exchanged = [r["all_to_all_ms"] for r in part["stages"]]
        if any(exchanged):
            lines.append(f"  of the stages' fwd and bwd, sequence parallelism's all-to-alls: "
                         f"{', '.join(f'{ms:,.3f}' for ms in exchanged)} ms a micro-batch (plan.link_gbps)")
        if per_process:  # what must fit one device: the stages a process runs, together
            lines.append("  peak GiB by process: " + ", ".join(f"{gib:.2f}" for gib in part["process_peak_GiB"]))
    lines.append("\n" + textwrap.fill(COLUMNS, 118))
    return "\n".join(lines)


def explain(plan: Plan, tried: list[tuple[Plan | None, str]] | None = None) -> str:
    """Why this layout: its planned split against the parameter-count split, and with `tried` (every layout
    `--world-size` searched, each a Plan or, where it did not fit, None and why) how each runner-up fared."""
    planned, even = plan.planned, plan.by_parameters
    lines = ["why this layout:"]
    if planned.starts != even.starts:
        lines.append(f"  the planned split {planned.starts} against the parameter-count split {even.starts}: slowest "
                     f"stage {planned.slowest_s * 1e3:,.1f} against {even.slowest_s * 1e3:,.1f} ms, "
                     f"{rate(plan.samples_per_s_of(planned))} against {rate(plan.samples_per_s_of(even))} samples/s")
    else:
        lines.append(f"  the planned split is the parameter-count split {planned.starts}: the planner found none faster")
    for st in planned.stages:
        if st.checkpointed:
            units = st.last - st.first
            which = "all" if st.recomputed == units else f"the last {st.recomputed}"
            lines.append(f"  stage {st.index} recomputes the activations of {which} of its {units} units: with fewer "
                         "it would not fit the memory")
    runners_up = sorted((p for p, _ in tried or [] if p is not None and p is not plan), key=lambda p: -p.samples_per_s)
    for other in runners_up:
        lines.append(f"  {describe_layout(other)}: {rate(other.samples_per_s)} samples/s "
                     f"(bubble {other.planned.bubble_fraction:.1%}), slower")
    lines += [textwrap.fill(why, 118, initial_indent="  ", subsequent_indent="    ")
              for p, why in tried or [] if p is None]
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

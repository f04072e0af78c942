"""`diffpipe plan`: print the planned split beside the parameter-count split, or the best layouts for a world size;
with --profile time each unit first, with --probe run each planned stage alone after.

    diffpipe plan examples/sdxl_unet.toml --set pipeline.stages=4 [--world-size 8] [--gpu-memory 80GiB] [--json]
    diffpipe plan examples/digits.toml --profile     # time each unit on this machine's device, save, reuse
    diffpipe plan examples/digits.toml --probe       # then run each planned stage alone: probed against planned
"""
from __future__ import annotations

import json
from pathlib import Path

from ..build import build_backbone
from ..config import RunConfig
from ..planner.plan import Plan, hardware, layouts_tried, make_plan, planning_device, unit_costs
from ..planner.report import (describe_layout, explain, format_plan, parse_memory, plan_as_dict, rate,
                              write_profile)
from ..train.probe import format_probe, probe_plan, probed_samples_per_s

__all__ = ["plan_command"]


def _plan_without_weights(config: RunConfig) -> None:
    """A plan needs the architecture, not the weights: a recipe's model.path that is not on this machine yet is
    planned as the preset the config names (model.preset, set beside the path), and the plan says so."""
    from ..errors import CheckpointError
    from ..models.registry import family_for

    model = config.model
    if model.path is None or Path(model.path).exists() or model.config is not None:
        return
    presets = sorted(family_for(model.architecture).presets)
    if "preset" not in model.model_fields_set or model.preset not in presets:
        raise CheckpointError(f"model.path={model.path} does not exist; to plan before the weights are here, name "
                              f"the architecture's preset of that model: --set model.preset='\"NAME\"' (the "
                              f"{model.architecture} presets: {', '.join(presets)})")
    print(f"model.path={model.path} is not on this machine: planning the {model.architecture} preset "
          f"{model.preset!r} (model.preset), the same architecture with no weights read", flush=True)
    model.path = None


# issue 54's runner-ups: how the frozen base is held and computed, each as its [memory] and [train] settings
_BASES = (("bf16", False, 'memory.base_dtype = "bf16"'),
          ("fp8", False, 'memory.base_dtype = "fp8" (stored in fp8, computed in bf16)'),
          ("int8", False, 'memory.base_dtype = "int8"'),
          ("nf4", False, 'memory.base_dtype = "nf4"'),
          ("fp8", True, "train.fp8_compute = true (stored in fp8, products on fp8 tensor cores)"))


def _runner_ups(config: RunConfig, meta, plan: Plan, hw) -> list[str]:
    """The same layout with the frozen base held each other way (bf16, fp8, int8, nf4, fp8 compute), block swap and
    checkpointing as the config leaves them: each one's planned samples/s and peak, or why it does not fit, and the
    fastest that fits (issue 54's runner-ups). A LoRA-like adapter in bf16 on a GPU only (what these settings take)."""
    from ..errors import Infeasible

    t = config.train
    if t.precision != "bf16" or config.adapter.type not in ("lora", "loha", "lokr") or t.device == "cpu":
        return []  # plans are for GPUs unless train.device = "cpu"
    used = (plan.replicas.frozen.name, plan.replicas.frozen.fp8_compute)
    lines, fitting = ["the frozen base held other ways (the same layout; memory.block_swap and checkpointing as "
                      "configured):"], []
    per_sample = None  # each way's units counted alike (bf16 compute, frozen weights outside linears in bf16): once
    for base, fp8_compute, words in _BASES:
        if (base, fp8_compute) == used:
            continue
        changed = config.model_copy(update={"train": t.model_copy(update={"fp8_compute": fp8_compute}),
                                            "memory": config.memory.model_copy(update={"base_dtype": base})})
        if per_sample is None and not config.plan.profile:  # a profile is read per way (its key names the base)
            per_sample = unit_costs(changed, meta, 1)
        try:
            other = make_plan(changed, meta, plan.stages, plan.data_parallel, plan.microbatches, hw,
                              per_sample=per_sample, sequence_parallel=plan.sequence_parallel)
        except Infeasible as why:
            lines.append(f"  {words}: does not fit ({str(why).splitlines()[0]})")
            continue
        fitting.append((other.samples_per_s, words))
        swapped = f", {other.replicas.block_swap} units swapped" if other.replicas.block_swap else ""
        lines.append(f"  {words}: {rate(other.samples_per_s)} samples/s, peak "
                     f"{max(other.planned.process_memory_bytes) / 2**30:.1f} GiB{swapped}")
    swapped = f", {plan.replicas.block_swap} units swapped" if plan.replicas.block_swap else ""
    lines.append(f"  against this plan's {rate(plan.samples_per_s)} samples/s, peak "
                 f"{max(plan.planned.process_memory_bytes) / 2**30:.1f} GiB{swapped}")
    fastest = max(fitting, default=None)
    if fastest is not None and fastest[0] > plan.samples_per_s:
        lines.append(f"  fastest that fits: {fastest[1]}")
    if not config.pipeline.compile:
        lines.append("  (planned eager: fp8 compute is counted no faster than bf16 per product there; compiled blocks, "
                     "pipeline.compile = \"blocks\", are where it gains)")
    return lines


def plan_command(config: RunConfig, world_size: int | None, gpu_memory: str | None, as_json: bool,
                 profile: bool, probe: bool = False, probe_unsplit: bool = False, explains: bool = False) -> None:
    if gpu_memory:
        config.plan.memory_gib = parse_memory(gpu_memory)
    _plan_without_weights(config)
    meta = build_backbone(config, "meta")
    if profile:
        config.plan.profile = config.plan.profile or "unit_profile.json"
        write_profile(config, meta, config.plan.profile)
    hw = hardware(config)
    p = config.pipeline
    plans: list[Plan] = []
    tried: list = []
    if world_size:
        tried = layouts_tried(config, meta, world_size, hw)
        plans = sorted((pl for pl, _ in tried if pl is not None), key=lambda pl: -pl.samples_per_s)
        if not plans and config.train.batch_size < world_size:  # not one sample for each pipeline or replica
            print(f"no layout of {world_size} devices: a global batch of {config.train.batch_size} gives not every "
                  f"device a sample to work on; set train.batch_size to {world_size} or more (--set "
                  f"train.batch_size={world_size})")
            return
        if not plans:
            print(f"no layout of {world_size} devices fits; try --gpu-memory, pipeline.checkpointing = \"auto\", "
                  "or a smaller train.batch_size")
            return
        if not as_json:
            print(f"best layouts of {world_size} devices for a global batch of {config.train.batch_size}:")
            for pl in plans[:5]:
                print(f"  {describe_layout(pl)}: {rate(pl.samples_per_s)} samples/s, bubble "
                      f"{pl.planned.bubble_fraction:.1%}, split {pl.planned.starts}")
            print()
        plan = plans[0]
    else:
        plan = make_plan(config, meta, p.stages * p.virtual_stages, p.data_parallel, p.microbatches, hw,
                         sequence_parallel=p.sequence_parallel)
    result = plan_as_dict(plan, meta)
    if not as_json:
        print(format_plan(plan, meta, config, hw), flush=True)
        if explains:
            print("\n" + explain(plan, tried), flush=True)
            for line in _runner_ups(config, meta, plan, hw):
                print(line, flush=True)
    if probe or probe_unsplit:  # the plan shown (with --world-size: the best layout)
        device = planning_device(config)
        result["probed"] = probe_plan(config, meta, plan, device, unsplit=probe_unsplit)
        result["probed_samples_per_s"] = probed_samples_per_s(plan, result["probed"])
        if not as_json:
            print(format_probe(result["probed"], device, result["probed_samples_per_s"]))
    if as_json:
        print(json.dumps([result] + [plan_as_dict(pl, meta) for pl in plans[1:5]] if world_size else result, indent=1))


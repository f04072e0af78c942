"""diffpipe from Python, for a training loop of your own: describe a diffusers backbone as units, plan its stages,
and build each stage as an `nn.Module` to hand to `torch.distributed.pipelining.PipelineStage` (or to chain in one
process). `python examples/own_loop.py` runs the example of the README.

    from diffpipe import describe, plan_split, stage_modules
    backbone = describe(transformer)                        # its family from the model's class (registry.py)
    starts = plan_split(transformer, stages=2, sample=..., conditions=...)
    stages = stage_modules(backbone, starts)                # stages[i](*received, **conditions) -> sends
"""
from __future__ import annotations

import torch
from torch import nn

from .models.family import Feed, ModelFamily
from .models.registry import BUILTIN_FAMILIES, family_for
from .models.units import Backbone
from .pipeline.split import StageSpec, stage_specs
from .pipeline.stage import StageModule, build_stage_modules

__all__ = ["family_of", "describe", "feed_of", "plan_split", "stage_modules", "stage_specs", "StageSpec"]


def family_of(model: nn.Module, architecture: str | None = None) -> ModelFamily:
    """The family of `model` (by its class among the built-in ones), or the one `architecture` names."""
    if architecture is not None:
        return family_for(architecture)
    for name in BUILTIN_FAMILIES:
        family = family_for(name)
        if isinstance(model, family.model_class):
            return family
    raise ValueError(f"no built-in family trains {type(model).__name__}; give architecture=\"module:Class\" naming "
                     "a ModelFamily of your own (diffpipe/models/family.py)")


def describe(model: nn.Module, architecture: str | None = None, granularity: str = "layers") -> Backbone:
    """`model` as units sharing its modules and weights (the unsplit forward: `backbone.forward(inputs, conditions)`)."""
    return family_of(model, architecture).backbone(model, granularity)


def feed_of(backbone: Backbone, guidance: float = 1.0) -> Feed:
    """How the backbone is fed: `feed.conditions(hidden, pooled, size_ids, latent_size)`, `feed.pack(latents)`,
    `feed.pack_prediction(target)`."""
    return Feed.of(backbone, guidance)


def plan_split(model: nn.Module, stages: int, sample: torch.Tensor, conditions: dict[str, torch.Tensor],
               microbatches: int | None = None, schedule: str = "1f1b", memory_gib: float | None = None,
               tflops: float = 300.0, link_gbps: float = 100.0, architecture: str | None = None) -> list[int]:
    """Stage starts (unit indices) that minimise the slowest stage under `memory_gib` per device, from FLOPs and
    bytes counted on a copy of `model` on the meta device (`sample` and `conditions`: one micro-batch, any device)."""
    from .planner.costs import count_unit_costs
    from .pipeline.schedules import ScheduleChoice
    from .planner.partition import Hardware, partition
    from .planner.plan import boundary_bytes

    with torch.device("meta"):
        copy = type(model).from_config(model.config)
    meta = describe(copy, architecture)
    inputs = {meta.inputs[0]: sample}
    costs = count_unit_costs(meta, inputs, conditions)
    hw = Hardware(tflops=tflops, link_gbps=link_gbps, memory_bytes=memory_gib * 2**30 if memory_gib else None)
    bounds = boundary_bytes(meta, costs, {k: v.to("meta") for k, v in inputs.items()})
    found = partition(costs, bounds, stages, microbatches or stages, ScheduleChoice.named(schedule), hw)
    return [s.first for s in found.stages[1:]]


def stage_modules(backbone: Backbone, starts: list[int], autocast: torch.dtype | None = None,
                  checkpointed: frozenset[int] = frozenset()) -> list[StageModule]:
    """One module per stage: positional arguments are the tensors it receives (`module.spec.receives`), keyword
    arguments the conditions; it returns what it sends (`module.spec.sends`), the last stage the prediction."""
    return build_stage_modules(backbone, stage_specs(backbone, starts), autocast, checkpointed)

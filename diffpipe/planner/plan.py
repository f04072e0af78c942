"""Plans for a config: unit costs, the optimal split, the parameter-count split beside it, and the search over
stages x data parallel x micro-batches for a world size (as DiffusionPipe, Tian et al., MLSys 2024), charging
data parallelism its gradient all-reduce."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..build import build_backbone, example_inputs, sample_shape, text_length
from ..config import PipelineConfig, RunConfig
from ..models.materialise import is_meta
from ..models.storage import FrozenStorage
from ..models.units import Backbone
from ..precision import AUTOCAST_DTYPES, element_bytes, frozen_storage, optimizer_state_bytes
from ..pipeline.split import (balanced_by_parameters, balanced_partition, check_stage_count, live_after,
                              stage_specs)
from ..pipeline.block_swap import holds_frozen
from ..pipeline.schedules import choice_of
from ..pipeline.exchange import heads_padded
from ..pipeline.sequence import sample_tokens, sequence_problem
from ..pipeline.traffic import trace_shapes
from .costs import UnitCost, count_unit_costs, load_profile
from .levers import (MemoryChoice, choose, fewest_swapped, holding, leaves_any, most_saving, plan_memory,
                     suggestions, unchanged)
from .partition import (BYTES_PER_WEIGHT, Hardware, Infeasible, Partition, Recomputed, Replicas, estimate_stages,
                        partition)

__all__ = ["Plan", "unit_costs", "boundary_bytes", "hardware", "planning_device", "make_plan", "resolve_stages",
           "take_stages", "planned_figures", "resolve_memory", "search_layouts", "profile_key", "scaled"]


@dataclass
class Plan:
    stages: int
    data_parallel: int
    microbatches: int
    micro_batch_size: int
    planned: Partition
    by_parameters: Partition
    trainable: list[int]  # trainable parameters of each unit
    link_gbps: float
    replicas: Replicas = Replicas()
    sequence_parallel: int = 1  # processes sharing each sample's tokens (pipeline/sequence.py)

    def allreduce_s(self, part: Partition) -> float:
        """The replicas' collectives in a step, none overlapped with compute (an upper bound): a ring all-reduce of
        the fp32 gradients moves 2 (dp - 1) / dp x the largest stage's bytes; sharded replicas move as much in a
        pipeline (a reduce-scatter of the gradients, an all-gather of the weights), and a stage alone (ZeRO-3) half
        as much again per micro-batch (weights gathered for its forward and its backward, gradients reduced)."""
        count = self.replicas.count  # data parallel x sequence parallel: every process holding the stage
        if count == 1:
            return 0.0
        largest = max(sum(self.trainable[s.first:s.last]) for s in part.stages) * 4
        rounds = 1.5 * self.microbatches if self.replicas.sharded and self.replicas.gathered_per_unit else 1
        return rounds * 2 * (count - 1) / count * largest / (self.link_gbps * 1e9)

    def step_s(self, part: Partition) -> float:
        return part.step_s + self.allreduce_s(part)

    def samples_per_s_of(self, part: Partition) -> float:
        return self.micro_batch_size * self.microbatches * self.data_parallel / self.step_s(part)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_s_of(self.planned)


def profile_key(config: RunConfig, micro_batch: int, device: str) -> dict:
    return {"model": config.model.model_dump(mode="json"), "micro_batch": micro_batch,
            "precision": config.train.precision, "device": device}


def scaled(costs: list[UnitCost], factor: float) -> list[UnitCost]:
    """Costs at `factor` times the micro-batch they were measured at (FLOPs, bytes, times: linear; the copies of
    trained weights and the outputs a micro-batch's samples share are one per micro-batch, whatever its size)."""
    def t(x):
        return None if x is None else x * factor

    def outputs(c: UnitCost) -> dict[str, int]:
        shared = c.shared_output_bytes
        return {k: shared.get(k, 0) + int((v - shared.get(k, 0)) * factor) for k, v in c.output_bytes.items()}
    return [replace(c, forward_flops=int(c.forward_flops * factor), backward_flops=int(c.backward_flops * factor),
                    activation_bytes=int(c.activation_bytes * factor), output_bytes=outputs(c),
                    forward_s=t(c.forward_s), backward_s=t(c.backward_s),
                    weight_pass_bytes=int(c.weight_pass_bytes * factor), working_bytes=int(c.working_bytes * factor),
                    attention_bytes=int(c.attention_bytes * factor), attention_flops=int(c.attention_flops * factor),
                    fp8_product_flops=int(c.fp8_product_flops * factor))
            for c in costs]


def with_padded_heads(costs: list[UnitCost], meta: Backbone, sequence_parallel: int) -> list[UnitCost]:
    """Costs where the degree does not divide the model's heads: attention runs on heads padded to the next multiple
    (pipeline/sequence.py), so its FLOPs (forward, a backward of twice them, the forward again in backward) and the
    all-to-alls' bytes grow by padded/real heads; what the padded attention holds meanwhile is not counted."""
    heads = getattr(meta.model.config, "num_attention_heads", None)
    padded = heads_padded(heads, sequence_parallel) if sequence_parallel > 1 else None
    if padded is None:
        return costs
    grow = padded / heads - 1
    return [replace(c, forward_flops=c.forward_flops + int(c.attention_flops * grow),
                    backward_flops=c.backward_flops + int(2 * c.attention_flops * grow),
                    attention_flops=int(c.attention_flops * (1 + grow)),
                    attention_bytes=int(c.attention_bytes * (1 + grow))) for c in costs]


def planned_storage(config: RunConfig) -> FrozenStorage:
    """How the planned run stores its frozen weights: plans are for GPUs unless train.device = "cpu"."""
    return frozen_storage(config, "cpu" if config.train.device == "cpu" else "cuda")


def unit_costs(config: RunConfig, meta: Backbone, micro_batch: int) -> list[UnitCost]:
    """Per-unit costs at `micro_batch`: profiled times when `plan.profile` exists, FLOP counts otherwise."""
    counted = count_unit_costs(meta, *example_inputs(config, meta, 1), AUTOCAST_DTYPES[config.train.precision],
                               planned_storage(config).dtype)
    for cost, shared in zip(counted, shared_outputs(config, meta)):
        cost.shared_output_bytes = {k: cost.output_bytes[k] for k in shared}
    profile = config.plan.profile
    if profile and Path(profile).is_file():
        saved_batch = json.loads(Path(profile).read_text())["key"]["micro_batch"]
        device = planning_device(config).type
        measured = load_profile(profile, profile_key(config, saved_batch, device))
        for m, c in zip(measured, counted):  # counted for one sample; the profile is scaled from its micro-batch
            m.shared_output_bytes = c.shared_output_bytes
            m.weight_pass_bytes = c.weight_pass_bytes * saved_batch  # counted, never measured
            m.working_bytes, m.trained_copy_bytes = c.working_bytes * saved_batch, c.trained_copy_bytes
            m.attention_bytes, m.attention_flops = c.attention_bytes * saved_batch, c.attention_flops * saved_batch
            m.fp8_product_flops = c.fp8_product_flops * saved_batch
            if device == "cpu":  # CPU memory is not measured per unit: keep the counted activation bytes
                m.activation_bytes = c.activation_bytes * saved_batch
        return scaled(measured, micro_batch / saved_batch)
    return scaled(counted, micro_batch)


def shared_outputs(config: RunConfig, meta: Backbone) -> list[set[str]]:
    """The names each unit writes that a micro-batch's samples share: the same size at micro-batches 1 and 2 (traced
    on the meta device, shapes only)."""
    one, two = (trace_shapes(meta, *example_inputs(config, meta, b)) for b in (1, 2))
    return [{k for k in unit.writes if a[k].numel() == b[k].numel()} for unit, a, b in zip(meta.units, one, two)]


def boundary_bytes(meta: Backbone, costs: list[UnitCost], inputs: dict[str, torch.Tensor]) -> list[int]:
    """Bytes crossing the boundary after each unit (the last entry, after the output, is 0)."""
    latest = {k: v.numel() * v.element_size() for k, v in inputs.items()}
    out = []
    for k, cost in enumerate(costs):
        latest.update(cost.output_bytes)
        out.append(sum(latest[n] for n in live_after(meta, k)) if k < len(costs) - 1 else 0)
    return out


# Defaults where the config gives no figure: an H200 reaches ~300 TFLOP/s on the SDXL UNet in eager bf16
# (bench/reference); one 2-core CPU process reaches ~0.05 TFLOP/s on small convolutions.
_DEFAULTS = {"cuda": (300.0, 100.0), "cpu": (0.05, 2.0)}


def planning_device(config: RunConfig) -> torch.device:
    """The device the plan is for, and that `diffpipe plan --profile` / `--probe` measure: a GPU when there is one,
    unless train.device = "cpu"."""
    return torch.device("cuda" if config.train.device != "cpu" and torch.cuda.is_available() else "cpu")


def hardware(config: RunConfig) -> Hardware:
    """What the plan may use of a device: its speed, its link, and its memory less plan.memory_headroom."""
    kind = planning_device(config).type
    tflops, link = _DEFAULTS[kind]
    memory = config.plan.memory_gib * 2**30 if config.plan.memory_gib else None
    if memory is None and kind == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
    if memory is not None:
        memory *= 1 - config.plan.memory_headroom
    return Hardware(config.plan.device_tflops or tflops, config.plan.link_gbps or link, config.plan.host_gbps, memory)


def _explain(config: RunConfig, costs, bounds_bytes, stages: int, m: int, hw: Hardware, replicas: Replicas) -> str:
    """Why nothing fits, and which single change would make it fit."""
    p = config.pipeline
    schedule = choice_of(p)
    loose = estimate_stages(costs, bounds_bytes, balanced_partition([c.params for c in costs], stages), m, schedule,
                            hw, checkpointing_mode(p), replicas)
    peaks = loose.process_memory_bytes  # a process's stages must fit its device together
    rank = peaks.index(max(peaks))
    mine = loose.by_process()[rank]
    needs = [(f"stage {s.index} (units {costs[s.first].name}..{costs[s.last - 1].name})", s.memory_bytes / 2**30)
             for s in mine]
    if len(needs) == 1:
        who = f"{needs[0][0]} needs {needs[0][1]:.1f} GiB"
    else:
        who = (f"process {rank} needs {sum(gib for _, gib in needs):.1f} GiB for "
               + ", ".join(f"{words} {gib:.1f} GiB" for words, gib in needs))
    headroom = config.plan.memory_headroom
    lines = [f"no split into {stages} stages fits {hw.memory_bytes / 2**30:.1f} GiB per device ({1 - headroom:.0%} of "
             f"its memory; plan.memory_headroom = {headroom:g} keeps the rest free): {who} with the parameter-count "
             "split."]
    fixes = []
    more = stages + schedule.per_rank  # one more process, running as many stages as each of the others
    if more <= len(costs):
        try:
            partition(costs, bounds_bytes, more, m, schedule, hw, checkpointing_mode(p), replicas)
            fixes.append(f"more stages (pipeline.stages = {schedule.ranks(more)} fits)")
        except Infeasible:
            fixes.append("more stages")
    if checkpointing_mode(p) not in ("all", "auto"):  # "auto" was tried: it checkpoints every stage that needs it
        try:
            partition(costs, bounds_bytes, stages, m, schedule, hw, "auto", replicas)
            fixes.append("activation checkpointing (pipeline.checkpointing = \"auto\" fits)")
        except Infeasible:
            fixes.append("activation checkpointing (not enough alone)")
    levers = suggestions(costs, replicas, adamw=config.train.optimizer == "adamw")
    fits = _fits(costs, bounds_bytes, stages, m, schedule, hw, checkpointing_mode(p))
    # not with data-parallel replicas (config.py refuses it)
    swap = fewest_swapped(replicas, fits, holding(costs)) if replicas.count == replicas.sequence else None
    if swap is not None:
        fixes.append(f"frozen weights of {swap} units per stage in host memory (memory.block_swap = {swap} fits)")
    for words, held in levers:
        try:
            partition(costs, bounds_bytes, stages, m, schedule, hw, checkpointing_mode(p), held)
            fixes.append(f"{words} fits")
        except Infeasible:
            fixes.append(f"{words} (not enough alone)")
    if levers:  # the smallest of each at once, checkpointed where needed (the last base dtype listed is smallest)
        frozen = next((h.frozen for _, h in reversed(levers) if h.frozen != replicas.frozen), replicas.frozen)
        together = replace(replicas, frozen=frozen, moment_bytes=min(h.moment_bytes for _, h in levers))
        try:
            partition(costs, bounds_bytes, stages, m, schedule, hw, "auto", together)
            fixes.append("those memory settings together with pipeline.checkpointing = \"auto\" fits")
        except Infeasible:
            pass
    micro = config.micro_batch_size
    if micro > 1:  # costs scale linearly with the micro-batch; one sample cannot be halved
        try:
            partition(scaled(costs, (micro // 2) / micro), bounds_bytes, stages, m, schedule, hw, checkpointing_mode(p),
                      replicas)
            fixes.append(f"a smaller micro-batch ({micro // 2} instead of {micro} fits: lower train.batch_size or "
                         "raise pipeline.microbatches)")
        except Infeasible:
            fixes.append(f"a smaller micro-batch than {micro}")
    if not fixes:
        fixes.append("a device with more memory (nothing else tried here fits)")
    return "\n".join(lines + ["what would help: " + "; ".join(fixes)])


def _replicas(config: RunConfig, stages: int, data_parallel: int, sequence_parallel: int = 1) -> Replicas:
    """How the layout's replicas hold a stage's state: a stage alone gathers each unit as it computes when sharded
    (pipeline/data_parallel.py, where the processes of a pipeline decide the same)."""
    frozen = planned_storage(config)
    autocast = AUTOCAST_DTYPES[config.train.precision]
    held = unchanged(config)  # each "auto" at its unchanged value: the planner changes it only where needed
    state, factored = optimizer_state_bytes(config.train, held.optimizer_state)
    # the processes of a sample alone average their gradients without cutting anything (pipeline/sequence.py)
    return Replicas(data_parallel * sequence_parallel, config.pipeline.data_parallel_shard and data_parallel > 1,
                    gathered_per_unit=stages == 1, sequence=sequence_parallel,
                    frozen=frozen, autocast_bytes=0 if autocast is None else element_bytes(autocast),
                    moment_bytes=state, factored=factored, block_swap=held.block_swap,
                    average_bytes=BYTES_PER_WEIGHT if config.train.ema_decay > 0 else 0.0)


def make_plan(config: RunConfig, meta: Backbone, stages: int, data_parallel: int, microbatches: int,
              hw: Hardware, per_sample: list[UnitCost] | None = None, sequence_parallel: int = 1) -> Plan:
    """The plan for one layout; `per_sample` (costs at micro-batch 1) saves recounting across layouts. With
    `sequence_parallel` N each process computes 1/N of every sample's tokens (and of its attention's heads, padded
    where N does not divide them): its costs are those of 1/N of the micro-batch, plus the all-to-alls
    (partition.Replicas.exchange_s)."""
    check_stage_count(meta, stages)  # before any memory reasoning: too many stages is no question of memory
    micro = config.train.batch_size // (microbatches * data_parallel)
    costs = scaled(per_sample if per_sample is not None else unit_costs(config, meta, 1), micro / sequence_parallel)
    costs = with_padded_heads(costs, meta, sequence_parallel)
    bb = boundary_bytes(meta, costs, example_inputs(config, meta, micro)[0])
    p = config.pipeline
    schedule = choice_of(p)
    replicas = _replicas(config, stages, data_parallel, sequence_parallel)
    try:
        planned = partition(costs, bb, stages, microbatches, schedule, hw, checkpointing_mode(p), replicas)
    except Infeasible:
        # the memory settings left to the planner ("auto"), in planner/levers.py's order
        fits = _fits(costs, bb, stages, microbatches, schedule, hw, checkpointing_mode(p))
        chosen = choose(config, replicas, fits, holding(costs)) if leaves_any(config.memory) else None
        if chosen is None:
            raise Infeasible(_explain(config, costs, bb, stages, microbatches, hw, replicas)) from None
        replicas = chosen[1]
        planned = partition(costs, bb, stages, microbatches, schedule, hw, checkpointing_mode(p), replicas)
    params = estimate_stages(costs, bb, balanced_by_parameters(meta, stages), microbatches, schedule, hw,
                             checkpointing_mode(p), replicas)
    return Plan(stages, data_parallel, microbatches, micro, planned, params,
                [c.trainable_params for c in costs], hw.link_gbps, replicas, sequence_parallel)


def search_layouts(config: RunConfig, meta: Backbone, world_size: int, hw: Hardware) -> list[Plan]:
    """Every (stages, data parallel, micro-batches) with stages x dp = world size that fits, fastest first."""
    return sorted((plan for plan, _ in layouts_tried(config, meta, world_size, hw) if plan is not None),
                  key=lambda p: -p.samples_per_s)


def layouts_tried(config: RunConfig, meta: Backbone, world_size: int, hw: Hardware) -> list[tuple[Plan | None, str]]:
    """Each (stages, data parallel, sequence parallel, micro-batches) with stages x dp x sp = world size: its plan,
    or None and why it does not fit (the first line of the planner's reason). Sequence parallel degrees where the
    family splits its tokens and each sample's tokens divide by them or are padded (pipeline/sequence.py)."""
    tried, per_sample = [], unit_costs(config, meta, 1)
    choice = choice_of(config.pipeline)
    unshardable = config.whole_tensors if config.pipeline.data_parallel_shard else None  # config.py says why
    tokens = sample_tokens(meta, sample_shape(config, meta), text_length(config))
    for ranks in range(1, world_size + 1):
        stages = ranks * choice.per_rank if ranks > 1 else 1  # a lone process runs the model as one stage
        if world_size % ranks or stages > len(meta.units):
            continue
        for sp in range(1, world_size // ranks + 1):
            if (world_size // ranks) % sp or sequence_problem(meta, sp, tokens) is not None:
                continue
            dp = world_size // (ranks * sp)
            for m in range(1, config.train.batch_size // dp + 1):
                if config.train.batch_size % (m * dp) or choice.schedule.problem(ranks, choice.virtual_stages, m):
                    continue
                split = f" x {sp} sharing each sample's tokens" if sp > 1 else ""
                layout = f"{ranks} process(es) x {dp} replica(s){split}, {m} micro-batch(es)"
                if dp > 1 and unshardable:
                    tried.append((None, f"{layout}: sharded replicas (pipeline.data_parallel_shard) cannot cut "
                                        f"{unshardable}"))
                    continue
                try:
                    tried.append((make_plan(config, meta, stages, dp, m, hw, per_sample, sp), ""))
                except Infeasible as exc:
                    tried.append((None, f"{layout}: does not fit: {str(exc).splitlines()[0]}"))
    return tried


def checkpointing_mode(p: PipelineConfig):
    """pipeline.recomputed_units where given (`Recomputed`), else pipeline.checkpointing: what the partition takes."""
    return Recomputed(p.recomputed_units) if p.recomputed_units is not None else p.checkpointing


def take_stages(p: PipelineConfig, split: list[int], recomputed: Recomputed) -> None:
    """The resolved split and checkpointed units written into `p` (the run's config.toml holds them, so a resume
    plans nothing): pipeline.recomputed_units, and pipeline.checkpointing as the stages recomputing any unit."""
    p.split, p.recomputed_units, p.checkpointing = split, list(recomputed), recomputed.stages


def resolve_stages(config: RunConfig, backbone: Backbone) -> tuple[list[int], Recomputed]:
    """Stage starts and how many of each stage's last units run checkpointed, as the runtime takes them."""
    p = config.pipeline
    stages = p.stages * p.virtual_stages
    check_stage_count(backbone, stages)
    meta = backbone if is_meta(backbone.model) else build_backbone(config, "meta")
    hw = hardware(config)
    # one stage, its checkpointing set and no device memory known to warn of: the plan could only say [] (counting
    # the units costs seconds a run, on a CPU; a GPU's memory is known, so it still warns where it would not fit)
    mode = checkpointing_mode(p)
    decided = stages == 1 and mode != "auto" and hw.memory_bytes is None
    if p.split == "auto" and not decided:
        try:
            plan = make_plan(config, meta, stages, p.data_parallel, p.microbatches, hw,
                             sequence_parallel=p.sequence_parallel)
        except Infeasible as exc:
            # the memory model is an estimate (10-20 % either way on the GPUs measured): say so, and plan for
            # time alone rather than refuse a run that may fit
            print(f"warning: the planner's memory estimate says {exc}\nplanning for speed alone; "
                  "the run may run out of memory", file=sys.stderr, flush=True)
            plan = make_plan(config, meta, stages, p.data_parallel, p.microbatches, replace(hw, memory_bytes=None),
                             sequence_parallel=p.sequence_parallel)
        return plan.planned.starts, Recomputed(s.recomputed for s in plan.planned.stages)
    if p.split == "auto":
        starts = []
    else:
        starts = balanced_by_parameters(backbone, stages) if p.split == "parameters" else list(p.split)
    specs = stage_specs(backbone, starts)  # validates
    if mode == "auto":
        return starts, Recomputed(s.recomputed for s in planned_figures(config, meta, starts, "auto").stages)
    counts = [s.last - s.first for s in specs]
    if isinstance(mode, Recomputed):
        return starts, Recomputed(min(k, units) for k, units in zip(mode, counts))
    return starts, Recomputed(units if mode == "all" or (isinstance(mode, list) and i in mode) else 0
                              for i, units in enumerate(counts))


def planned_figures(config: RunConfig, meta: Backbone, starts: list[int], checkpointing: list[int] | str) -> Partition:
    """The planner's figures for a split and its checkpointing (stage indices, or "auto" to choose them), as a run
    takes them (`resolve_stages`): per stage and, through `Partition.process_memory_bytes`, the peak memory it
    expects of each pipeline process."""
    p = config.pipeline
    stages = len(starts) + 1
    costs = unit_costs(config, meta, config.micro_batch_size / p.sequence_parallel)  # this process's share
    bounds = boundary_bytes(meta, costs, example_inputs(config, meta, config.micro_batch_size)[0])
    return estimate_stages(costs, bounds, starts, p.microbatches, choice_of(p), hardware(config), checkpointing,
                           _replicas(config, stages, p.data_parallel, p.sequence_parallel))


def _fits(costs, bounds_bytes, stages: int, m: int, schedule, hw: Hardware, checkpointing):
    """Whether the layout's partition fits with its state held as a given `Replicas` says."""
    def fits(held: Replicas) -> bool:
        try:
            partition(costs, bounds_bytes, stages, m, schedule, hw, checkpointing, held)
            return True
        except Infeasible:
            return False

    return fits


def resolve_memory(config: RunConfig, backbone: Backbone) -> MemoryChoice:
    """The [memory] settings as the runtime takes them, those left to the planner ("auto") chosen in
    planner/levers.py's order for the configured layout (pipeline.split "auto": the planner's split, checkpointing
    chosen first; a given split: its figures). Unchanged where the layout fits as configured or the device's memory
    is unknown (a CPU without plan.memory_gib); where nothing fits, the settings that save the most (resolve_stages
    then warns)."""
    first = unchanged(config)
    hw = hardware(config)
    p = config.pipeline
    check_stage_count(backbone, p.stages * p.virtual_stages)
    if not leaves_any(config.memory) or hw.memory_bytes is None:
        return first
    meta = backbone if is_meta(backbone.model) else build_backbone(config, "meta")
    stages = p.stages * p.virtual_stages
    if p.split == "auto":
        try:
            return plan_memory(config, make_plan(config, meta, stages, p.data_parallel, p.microbatches, hw,
                                                 sequence_parallel=p.sequence_parallel))
        except Infeasible:
            return most_saving(config, sum(holds_frozen(meta.units)))
    starts = balanced_by_parameters(meta, stages) if p.split == "parameters" else list(p.split)
    costs = unit_costs(config, meta, config.micro_batch_size / p.sequence_parallel)  # this process's share
    bounds = boundary_bytes(meta, costs, example_inputs(config, meta, config.micro_batch_size)[0])

    def fits(held: Replicas) -> bool:
        figures = estimate_stages(costs, bounds, starts, p.microbatches, choice_of(p), hw, checkpointing_mode(p), held)
        return max(figures.process_memory_bytes) <= hw.memory_bytes

    chosen = choose(config, _replicas(config, stages, p.data_parallel, p.sequence_parallel), fits, holding(costs))
    return chosen[0] if chosen is not None else most_saving(config, sum(holds_frozen(meta.units)))

"""Optimal contiguous partition of the units into stages, by dynamic programming.

The pipeline's step time is the slowest stage's time per micro-batch (forward + backward + sending its boundary
tensors and receiving their gradients) x the micro-batches each process runs, over 1 - the schedule's ideal
bubble (pipeline/schedules.py; for GPipe and 1F1B that is (micro-batches + stages - 1) x the slowest stage). So
the partition minimises the slowest stage subject to every stage fitting its device's memory: weights,
gradients, AdamW state, and the activations of the micro-batches its schedule keeps in flight (all of them
under GPipe; stages - s for stage s under 1F1B; counted from the schedule's order of actions). Checkpointing a
stage keeps only its inputs per micro-batch and pays one more forward.
The DP over (stages, units) is exact for this objective: tests compare it with brute force.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pipeline.schedules import ScheduleChoice
from .costs import UnitCost

__all__ = ["Hardware", "Replicas", "StageEstimate", "Partition", "Infeasible", "partition", "estimate_stages",
           "unit_times", "BYTES_PER_TRAINABLE", "BYTES_PER_WEIGHT"]

BYTES_PER_WEIGHT = 4  # fp32 master weights (autocast computes in bf16/fp16)
BYTES_PER_TRAINABLE = 4 + 8  # fp32 gradient + AdamW's two moments


@dataclass(frozen=True)
class Hardware:
    tflops: float = 200.0  # sustained TFLOP/s, used where units are not profiled
    link_gbps: float = 50.0  # GB/s between neighbouring stages
    memory_bytes: float | None = None  # per device; None: unlimited


@dataclass(frozen=True)
class Replicas:
    """A stage's data-parallel replicas: `sharded` (pipeline.data_parallel_shard) cuts its fp32 weights, gradients
    and AdamW moments across them (pipeline/data_parallel.py). In a pipeline, whole copies of the weights and of
    the gradients being summed are held from a step's first forward to its reduction (torch's schedules); a stage
    alone (`gathered_per_unit`) holds a unit whole only while it computes, with the next one gathered ahead."""

    count: int = 1
    sharded: bool = False
    gathered_per_unit: bool = False

    def state_bytes(self, units: list[UnitCost]) -> float:
        """Weights, gradients and AdamW state of a stage of these units, per device."""
        params, trainable = sum(c.params for c in units), sum(c.trainable_params for c in units)
        whole = params * BYTES_PER_WEIGHT + trainable * BYTES_PER_TRAINABLE
        if not self.sharded or self.count == 1:
            return whole
        if self.gathered_per_unit:
            return whole / self.count + 2 * max(c.params * BYTES_PER_WEIGHT + c.trainable_params * 4 for c in units)
        return params * BYTES_PER_WEIGHT + trainable * 4 + whole / self.count


@dataclass(frozen=True)
class StageEstimate:
    index: int
    first: int
    last: int
    forward_s: float
    backward_s: float  # includes the recomputed forward when checkpointed
    send_s: float
    memory_bytes: float
    checkpointed: bool

    @property
    def busy_s(self) -> float:
        return self.forward_s + self.backward_s + self.send_s


@dataclass(frozen=True)
class Partition:
    stages: tuple[StageEstimate, ...]
    microbatches: int
    schedule: ScheduleChoice

    @property
    def slowest_s(self) -> float:
        return max(s.busy_s for s in self.stages)

    @property
    def step_s(self) -> float:
        stages = len(self.stages)
        ranks = self.schedule.ranks(stages)
        per_process = self.microbatches * (stages / ranks) * self.slowest_s
        return per_process / (1 - self.schedule.bubble(stages, self.microbatches))

    @property
    def bubble_fraction(self) -> float:
        """Share of device time idle: 1 - (work done) / (devices x step time)."""
        work = self.microbatches * sum(s.busy_s for s in self.stages)
        return 1 - work / (self.schedule.ranks(len(self.stages)) * self.step_s)

    @property
    def starts(self) -> list[int]:
        return [s.first for s in self.stages[1:]]


class Infeasible(ValueError):
    """No partition fits memory; the message names the stage, its need and what would help."""


def unit_times(cost: UnitCost, hw: Hardware) -> tuple[float, float]:
    if cost.forward_s is not None and cost.backward_s is not None:
        return cost.forward_s, cost.backward_s
    rate = hw.tflops * 1e12
    return cost.forward_flops / rate, cost.backward_flops / rate


def _stage(costs, boundary_bytes, first, last, index, stages, microbatches, schedule, hw, checkpointed,
           replicas: Replicas = Replicas()):
    times = [unit_times(c, hw) for c in costs[first:last]]
    forward = sum(t[0] for t in times)
    backward = sum(t[1] for t in times) + (forward if checkpointed else 0.0)
    received = boundary_bytes[first - 1] if first > 0 else 0
    sent = boundary_bytes[last - 1] if last < len(costs) else 0
    send = 2 * sent / (hw.link_gbps * 1e9)  # activations forward, their gradients back
    static = replicas.state_bytes(costs[first:last])
    held = schedule.in_flight(index, stages, microbatches)
    if checkpointed:  # per micro-batch in flight: the stage's inputs and every unit's outputs (the next units'
        # inputs); in backward one unit's activations, recomputed
        kept = received + sum(sum(c.output_bytes.values()) for c in costs[first:last])
        dynamic = held * kept + max(c.activation_bytes for c in costs[first:last])
    else:
        dynamic = held * (received + sum(c.activation_bytes for c in costs[first:last]))
    return StageEstimate(index, first, last, forward, backward, send, static + dynamic, checkpointed)


def _options(mode, index: int) -> tuple[bool, ...]:
    if mode == "none":
        return (False,)
    if mode == "all":
        return (True,)
    if mode == "auto":
        return (False, True)
    return (index in mode,)


def _fits(est: StageEstimate, hw: Hardware, stages_per_process: int) -> bool:
    """Within the device's memory, shared equally by the stages of a process (interleaved and V-shaped schedules
    run 2 or more on each): a stage may use its share."""
    return hw.memory_bytes is None or est.memory_bytes <= hw.memory_bytes / stages_per_process


def _best_stage(costs, boundary_bytes, first, last, index, stages, m, schedule, hw, mode,
                replicas: Replicas = Replicas()) -> StageEstimate | None:
    """The stage as configured; under "auto" without checkpointing when that fits, else with it."""
    for ckpt in _options(mode, index):
        est = _stage(costs, boundary_bytes, first, last, index, stages, m, schedule, hw, ckpt, replicas)
        if _fits(est, hw, stages // schedule.ranks(stages)):
            return est
    return None


def estimate_stages(costs, boundary_bytes, starts: list[int], microbatches: int, schedule: ScheduleChoice,
                    hw: Hardware, checkpointing="none", replicas: Replicas = Replicas()) -> Partition:
    """Figures for a given split (no memory check), e.g. the parameter-count split."""
    bounds = [0, *starts, len(costs)]
    stages = len(bounds) - 1
    out = []
    for i in range(stages):
        args = (costs, boundary_bytes, bounds[i], bounds[i + 1], i, stages, microbatches, schedule, hw)
        est = _best_stage(*args, checkpointing, replicas)
        if est is None:  # nothing fits: report the most frugal option allowed, whose memory is the one to beat
            est = _stage(*args, _options(checkpointing, i)[-1], replicas)
        out.append(est)
    return Partition(tuple(out), microbatches, schedule)


def partition(costs: list[UnitCost], boundary_bytes: list[int], stages: int, microbatches: int,
              schedule: ScheduleChoice, hw: Hardware, checkpointing="none", replicas: Replicas = Replicas()) -> Partition:
    """The partition into `stages` that minimises the slowest stage while every stage fits memory."""
    n = len(costs)
    if stages > n:
        raise Infeasible(f"{stages} stages but only {n} units; use at most {n} stages")
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice: list[list[StageEstimate | None]] = [[None] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                est = _best_stage(costs, boundary_bytes, j, i, s - 1, stages, microbatches, schedule, hw,
                                  checkpointing, replicas)
                if est is not None and max(best[s - 1][j], est.busy_s) < best[s][i]:
                    best[s][i], choice[s][i] = max(best[s - 1][j], est.busy_s), est
    if best[stages][n] == inf:
        raise Infeasible("no split into {} stages fits {:.1f} GiB per device".format(
            stages, (hw.memory_bytes or 0) / 2**30))
    out, i = [], n
    for s in range(stages, 0, -1):
        est = choice[s][i]
        out.append(est)
        i = est.first
    return Partition(tuple(reversed(out)), microbatches, schedule)

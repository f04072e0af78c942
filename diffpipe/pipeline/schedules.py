"""The pipeline schedules diffpipe offers, described once: the torch class that runs each, where its stages sit,
what it requires, and (from the order of its actions) its ideal bubble and the micro-batches a stage holds.

The planner, the config checks, the runtime and the observer all read this module. The order of actions of the
multi-stage schedules is torch's own (`torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`
builds it from the schedule class, as the schedule itself does); GPipe and 1F1B have one textbook order each.

Ideal bubble: the actions of a step run on ranks with equal stages, a forward F, an input-gradient I and a
weight-gradient W taking one unit of time each (backward = 2 x forward; a full backward B = I + W), sends
free; a stage waits for its neighbour's result. The bubble is the share of rank-time idle within the step.
That is what `observe` compares measured bubbles with, and what the planner's step time divides by.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..torch_support import schedule_actions

__all__ = ["Schedule", "SCHEDULES", "schedule_named", "ScheduleChoice", "choice_of", "Action", "rank_actions",
           "ideal_bubble", "in_flight", "awaiting_weights"]

_COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # time units of one stage's action on one micro-batch


@dataclass(frozen=True)
class Schedule:
    name: str  # as `pipeline.schedule` spells it
    torch_class: str  # in torch.distributed.pipelining
    placement: str  # "loop": rank r holds stages r, r + ranks, ...; "v": r and 2 ranks - 1 - r
    virtual: str  # stages per rank: "one", "two" (V-shaped) or "chosen" (pipeline.virtual_stages >= 2)
    zero_bubble: bool  # splits each backward into input and weight gradients
    min_microbatches: str = "none"  # "stages": at least as many micro-batches as stages in all

    @property
    def torch_type(self):
        import torch.distributed.pipelining as pipelining  # here: the config checks read this module without torch
        return getattr(pipelining, self.torch_class)

    @property
    def multi_stage(self) -> bool:
        return self.virtual != "one"

    def stages_per_rank(self, virtual_stages: int) -> int:
        return {"one": 1, "two": 2, "chosen": virtual_stages}[self.virtual]

    def stage_indices(self, rank: int, ranks: int, virtual_stages: int = 1) -> list[int]:
        """The stages `rank` holds, in the order handed to torch's schedule."""
        if self.placement == "v":
            return [rank, 2 * ranks - 1 - rank]
        return [rank + k * ranks for k in range(self.stages_per_rank(virtual_stages))]

    def rank_of(self, stage: int, ranks: int) -> int:
        """The process (in the pipeline's group) holding `stage`."""
        if self.placement == "v":
            return stage if stage < ranks else 2 * ranks - 1 - stage
        return stage % ranks

    def problem(self, ranks: int, virtual_stages: int, microbatches: int) -> str | None:
        """What makes this schedule impossible for the layout, in the config's words; None when it runs."""
        key = f"pipeline.schedule = {self.name!r}"
        if self.virtual == "one" and virtual_stages > 1:
            return (f"pipeline.virtual_stages = {virtual_stages} needs a schedule with several stages per process "
                    f"(interleaved_1f1b, zb1p); {key} runs one: set pipeline.virtual_stages = 1")
        if self.virtual == "two" and virtual_stages != 2:
            return f"{key} places exactly 2 stages on each process (V-shaped): set pipeline.virtual_stages = 2"
        if self.virtual == "chosen" and virtual_stages < 2:
            return f"{key} needs pipeline.virtual_stages >= 2 (stages per process); set it to 2, or use 1f1b"
        stages = ranks * self.stages_per_rank(virtual_stages)
        if self.min_microbatches == "stages" and microbatches < stages:
            return (f"{key} needs pipeline.microbatches >= its {stages} stages, got {microbatches}; "
                    f"set pipeline.microbatches to {stages} or more (and train.batch_size to a multiple)")
        if self.virtual == "chosen" and ranks > 1:
            rounds = max(1, microbatches // ranks)
            if microbatches % rounds:
                return (f"{key} with {ranks} processes needs pipeline.microbatches to be a multiple of {ranks} "
                        f"(or fewer than it); got {microbatches}")
        return None


SCHEDULES = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", "loop", "one", zero_bubble=False),
    Schedule("1f1b", "Schedule1F1B", "loop", "one", zero_bubble=False, min_microbatches="stages"),
    Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", "chosen", zero_bubble=False),
    Schedule("zb1p", "ScheduleInterleavedZeroBubble", "loop", "chosen", zero_bubble=True),
    Schedule("zbv", "ScheduleZBVZeroBubble", "v", "two", zero_bubble=True),
    Schedule("dualpipev", "ScheduleDualPipeV", "v", "two", zero_bubble=True, min_microbatches="stages"),
)}


def schedule_named(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule = {name!r}: choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


@dataclass(frozen=True)
class ScheduleChoice:
    """A schedule with its stages per process, as configured: what the planner and the observer reason about."""

    schedule: Schedule
    virtual_stages: int = 1

    @classmethod
    def named(cls, name: str, virtual_stages: int = 1) -> "ScheduleChoice":
        schedule = schedule_named(name)
        return cls(schedule, virtual_stages if schedule.multi_stage else 1)

    @property
    def per_rank(self) -> int:
        return self.schedule.stages_per_rank(self.virtual_stages)

    def ranks(self, stages: int) -> int:
        """Processes of one pipeline running `stages` stages in all."""
        return max(1, stages // self.per_rank)

    def stages_by_process(self, stages: int) -> list[list[int]]:
        """The stage indices each process of one pipeline runs, in order."""
        ranks = self.ranks(stages)
        out: list[list[int]] = [[] for _ in range(ranks)]
        for k in range(stages):
            out[self.schedule.rank_of(k, ranks)].append(k)
        return out

    def bubble(self, stages: int, microbatches: int) -> float:
        return ideal_bubble(self.schedule.name, self.ranks(stages), microbatches, self.virtual_stages)

    def in_flight(self, stage: int, stages: int, microbatches: int) -> int:
        return in_flight(self.schedule.name, stage, self.ranks(stages), microbatches, self.virtual_stages)

    def awaiting_weights(self, stage: int, stages: int, microbatches: int) -> int:
        return awaiting_weights(self.schedule.name, stage, self.ranks(stages), microbatches, self.virtual_stages)


def choice_of(pipeline) -> ScheduleChoice:
    """The configured schedule of a `PipelineConfig` (or anything with `schedule` and `virtual_stages`)."""
    return ScheduleChoice.named(pipeline.schedule, pipeline.virtual_stages)


@dataclass(frozen=True)
class Action:
    kind: str  # F, B (full backward), I (input gradients), W (weight gradients)
    stage: int
    microbatch: int


@lru_cache(maxsize=64)
def rank_actions(name: str, ranks: int, microbatches: int,
                 virtual_stages: int = 1) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Each rank's compute actions in the order it runs them, and the stage count."""
    schedule = schedule_named(name)
    per_rank = schedule.stages_per_rank(virtual_stages)
    stages = ranks * per_rank
    if not schedule.multi_stage:
        return tuple(_single_stage_order(name, r, ranks, microbatches) for r in range(ranks)), stages
    orders = []
    for ops in schedule_actions(schedule.torch_type, ranks, microbatches, per_rank):  # torch's own order
        order = []
        for op in ops:
            for part in (op.sub_actions or (op,)) if op is not None else ():
                kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
                    part.computation_type.name if part.computation_type is not None else "", "")
                if kind:
                    order.append(Action(kind, part.stage_index, part.microbatch_index))
        orders.append(tuple(order))
    return tuple(orders), stages


def _single_stage_order(name: str, rank: int, ranks: int, microbatches: int) -> tuple[Action, ...]:
    if name == "gpipe":
        return tuple(Action("F", rank, i) for i in range(microbatches)) + tuple(
            Action("B", rank, i) for i in range(microbatches))
    warmup = min(microbatches, ranks - rank)  # 1F1B: fill, then one forward per backward, then drain
    order = [Action("F", rank, i) for i in range(warmup)]
    for i in range(microbatches):
        order.append(Action("B", rank, i))
        if warmup + i < microbatches:
            order.append(Action("F", rank, warmup + i))
    return tuple(order)


def _step_length(orders, stages: int) -> float:
    """When the last action ends, each rank running its actions in order as soon as their inputs exist."""
    done: dict[tuple[str, int, int], float] = {}
    position, clock = [0] * len(orders), [0.0] * len(orders)

    def ready_at(a: Action) -> float | None:
        if a.kind == "F":
            needs = [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
        elif a.kind in ("B", "I"):
            needs = ([("F", a.stage, a.microbatch)] if a.stage == stages - 1
                     else [("grad", a.stage + 1, a.microbatch)])
        else:  # W after this stage's own I
            needs = [("I", a.stage, a.microbatch)]
        times = [done.get(n) for n in needs]
        return None if any(t is None for t in times) else max(times, default=0.0)

    while any(p < len(o) for p, o in zip(position, orders)):
        moved = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                ready = ready_at(a)
                if ready is None:
                    break
                clock[r] = max(clock[r], ready) + _COST[a.kind]
                done[(a.kind, a.stage, a.microbatch)] = clock[r]
                if a.kind in ("B", "I"):
                    done[("grad", a.stage, a.microbatch)] = clock[r]
                position[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule's actions wait on each other (no action can run)")
    return max(clock)


def ideal_bubble(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of rank-time idle in one step with equal stages (the module docstring's model); 0 for one rank."""
    if ranks <= 1:
        return 0.0
    orders, stages = rank_actions(name, ranks, microbatches, virtual_stages)
    step = _step_length(orders, stages)
    busy = sum(_COST[a.kind] for order in orders for a in order)
    return 1.0 - busy / (ranks * step)


def in_flight(name: str, stage: int, ranks: int, microbatches: int, virtual_stages: int = 1) -> int:
    """The most micro-batches whose activations `stage` holds at once: forwarded, their backward (the weight
    gradients, for zero-bubble schedules) not yet done."""
    return max(_most_held(name, stage, ranks, microbatches, virtual_stages, "F"), 1)


def awaiting_weights(name: str, stage: int, ranks: int, microbatches: int, virtual_stages: int = 1) -> int:
    """The most micro-batches of `stage` at once between their input-gradient pass (I) and their weight pass (W):
    0 for schedules whose backward is whole. Torch keeps the gradients of every weight's op output for W, and a
    checkpointed stage's micro-batch then holds about its whole activations, not only its inputs."""
    return _most_held(name, stage, ranks, microbatches, virtual_stages, "I")


def _most_held(name: str, stage: int, ranks: int, microbatches: int, virtual_stages: int, start: str) -> int:
    """The most micro-batches of `stage` at once past action `start` ("F" or "I") and before their backward ends
    (B, or W for a split one)."""
    orders, _ = rank_actions(name, ranks, microbatches, virtual_stages)
    held, most = set(), 0
    for order in orders:
        for a in order:
            if a.stage != stage:
                continue
            if a.kind == start:
                held.add(a.microbatch)
                most = max(most, len(held))
            elif a.kind in ("B", "W"):
                held.discard(a.microbatch)
    return most

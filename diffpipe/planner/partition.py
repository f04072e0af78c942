"""Optimal contiguous partition of the units into stages, by dynamic programming.

The pipeline's step time is the slowest stage's time per micro-batch (forward + backward + sending its boundary
tensors and receiving their gradients) x the micro-batches each process runs, over 1 - the schedule's ideal
bubble (pipeline/schedules.py; for GPipe and 1F1B that is (micro-batches + stages - 1) x the slowest stage). So
the partition minimises the slowest stage subject to every stage fitting its device's memory: weights,
gradients, AdamW state, and the activations of the micro-batches its schedule keeps in flight (all of them
under GPipe; stages - s for stage s under 1F1B; counted from the schedule's order of actions; zero-bubble
schedules also hold the gradients of the weights' op outputs between a micro-batch's input-gradient and weight
passes). Checkpointing a stage keeps only its inputs per micro-batch and pays one more forward (zero-bubble
schedules hold its whole activations again between those two passes); under "auto" a stage recomputes only its last
units, the fewest with which it fits (`Recomputed`), so memory left over keeps the others' activations.
The DP over (stages, units) is exact for this objective: tests compare it with brute force.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..pipeline.block_swap import last_holding
from ..pipeline.schedules import ScheduleChoice
from ..models.storage import FrozenStorage
from ..errors import Infeasible
from ..precision import element_bytes
from ..pipeline.split import balanced_partition
from .costs import UnitCost

__all__ = ["Hardware", "Replicas", "StageEstimate", "Partition", "Infeasible", "Recomputed", "partition",
           "estimate_stages", "unit_times", "BYTES_PER_GRADIENT", "BYTES_PER_WEIGHT"]

BYTES_PER_WEIGHT = 4  # fp32 master weights (autocast computes in bf16/fp16)
BYTES_PER_GRADIENT = 4


@dataclass(frozen=True)
class Hardware:
    tflops: float = 200.0  # sustained TFLOP/s, used where units are not profiled
    link_gbps: float = 50.0  # GB/s between neighbouring stages
    host_gbps: float = 25.0  # GB/s from pinned host memory to the device (memory.block_swap)
    memory_bytes: float | None = None  # per device; None: unlimited


@dataclass(frozen=True)
class Replicas:
    """A stage's data-parallel replicas: `sharded` (pipeline.data_parallel_shard) cuts its fp32 weights, gradients
    and AdamW moments across them (pipeline/data_parallel.py). In a pipeline, whole copies of the weights and of
    the gradients being summed are held from a step's first forward to its reduction (torch's schedules); a stage
    alone (`gathered_per_unit`) holds a unit whole only while it computes, with the next one gathered ahead.
    With sequence parallelism (`sequence` processes sharing each sample's tokens, pipeline/sequence.py) those
    processes are replicas too: `count` is data parallel x sequence parallel, and every attention pays its
    all-to-alls."""

    count: int = 1
    sharded: bool = False
    gathered_per_unit: bool = False
    frozen: FrozenStorage = FrozenStorage()  # how frozen weights are held (memory.base_dtype)
    autocast_bytes: int = 0  # an element in the autocast dtype (2 for bf16/fp16); 0 for fp32 compute
    moment_bytes: float = 8.0  # the optimizer's state per trained parameter (precision.optimizer_state_bytes)
    factored: bool = False  # and Adafactor's factored second moment (UnitCost.factored_state_params, fp32)
    average_bytes: float = 0.0  # train.ema_decay's moving average per trained parameter (fp32; sharded like moments)
    block_swap: int = 0  # units of each stage whose frozen weights live in host memory (pipeline/block_swap.py)
    sequence: int = 1  # processes sharing each sample's tokens (pipeline.sequence_parallel)

    def weight_bytes(self, unit: UnitCost) -> float:
        """A unit's weights as held: trained ones in fp32, frozen ones as memory.base_dtype stores them (fp8, int8,
        nf4: its linear layers' weights as storage.LINEAR_FORMATS counts them)."""
        rest = unit.params - unit.trainable_params
        linear = unit.frozen_linear_params if self.frozen.linear else 0
        return (unit.trainable_params * BYTES_PER_WEIGHT + (rest - linear) * element_bytes(self.frozen.dtype)
                + self.frozen.linear_bytes(linear))

    def unit_times(self, unit: UnitCost, hw: Hardware) -> tuple[float, float]:
        """A unit's (forward, backward) seconds: measured ones as measured; else from its FLOPs, each pass with the
        time a quantised base (memory.base_dtype fp8, int8, nf4) spends turning its weights back into bf16, or less
        what fp8 compute saves on the frozen linear products (train.fp8_compute: forward and input gradient alike)."""
        forward, backward = unit_times(unit, hw)
        exchange = self.exchange_s(unit, hw)
        # split over a sample's processes, attention's backward computes its forward again (diffusers' native op)
        again = unit.attention_flops / (hw.tflops * 1e12) if self.sequence > 1 else 0.0
        if unit.forward_s is not None and unit.backward_s is not None:
            return forward + exchange, backward + exchange + again
        extra = (self.frozen.dequantise_flops(unit.frozen_linear_params)
                 - self.frozen.fp8_saved_flops(unit.fp8_product_flops)) / (hw.tflops * 1e12) + exchange
        return forward + extra, backward + extra + again

    def exchange_s(self, unit: UnitCost, hw: Hardware) -> float:
        """Seconds of one pass's all-to-alls (forward's, and as many in backward) of the unit's attentions: each
        process sends all but its own 1/N of its queries, keys, values and outputs (their bytes are this process's,
        the costs having been scaled to its share of the tokens), none overlapped with compute."""
        if self.sequence == 1:
            return 0.0
        return unit.attention_bytes * (self.sequence - 1) / self.sequence / (hw.link_gbps * 1e9)

    def frozen_bytes(self, unit: UnitCost) -> float:
        return self.weight_bytes(unit) - unit.trainable_params * BYTES_PER_WEIGHT

    def swapped(self, units: list[UnitCost]) -> list[UnitCost]:
        """The units of a stage whose frozen weights swap (as pipeline/block_swap.swapped_units picks them)."""
        return [units[i] for i in self.swapped_positions(units)]

    def swapped_positions(self, units: list[UnitCost]) -> list[int]:
        """Where those units are in the stage's list."""
        return last_holding([c.params > c.trainable_params for c in units], self.block_swap)

    def kept_copies_bytes(self, unit: UnitCost) -> float:
        """Per micro-batch in flight, under autocast: the bf16/fp16 copies of the unit's trained weights that its
        backward keeps (counted, precision/autocast.py), and of its frozen fp32 weights that a linear or convolution
        layer's backward keeps (autocast caches no copy of a frozen weight; a bf16, fp8, int8 or nf4 base needs
        none)."""
        trained = unit.trained_copy_bytes
        if self.frozen.dtype != torch.float32 or self.frozen.linear:
            return trained
        return trained + unit.frozen_product_params * self.autocast_bytes

    def state_bytes(self, units: list[UnitCost], held: list[float] | None = None) -> float:
        """Weights, gradients, optimizer state and any moving average of a stage of these units, per device (`held`:
        their weight_bytes, where already worked out)."""
        held = [self.weight_bytes(c) for c in units] if held is None else held
        weights, trainable = sum(held), sum(c.trainable_params for c in units)
        factored = 4 * sum(c.factored_state_params for c in units) if self.factored else 0
        whole = weights + trainable * (BYTES_PER_GRADIENT + self.moment_bytes + self.average_bytes) + factored
        if not self.sharded or self.count == 1:
            return whole
        if self.gathered_per_unit:
            gathered = max(w + c.trainable_params * BYTES_PER_GRADIENT for w, c in zip(held, units))
            return whole / self.count + 2 * gathered
        return weights + trainable * BYTES_PER_GRADIENT + whole / self.count


class Recomputed(tuple):
    """How many units of each stage run checkpointed, counted from the stage's end, one number per stage (a stage's
    unit count: the whole stage): a checkpointing mode of its own, beside "none", "all", "auto" and a list of stage
    indices (pipeline.recomputed_units). Its last units, because block swap's units are a stage's last too."""

    @property
    def stages(self) -> list[int]:
        """The stages that recompute any unit."""
        return [i for i, count in enumerate(self) if count]


@dataclass(frozen=True)
class StageEstimate:
    index: int
    first: int
    last: int
    forward_s: float
    backward_s: float  # includes the recomputed forward of its checkpointed units
    send_s: float
    memory_bytes: float
    recomputed: int  # its last units that run checkpointed (last - first: the whole stage)
    exchange_s: float = 0.0  # of forward_s + backward_s: sequence parallelism's all-to-alls (Replicas.exchange_s)

    @property
    def busy_s(self) -> float:
        return self.forward_s + self.backward_s + self.send_s

    @property
    def checkpointed(self) -> bool:
        """Whether any of its units recompute their activations."""
        return self.recomputed > 0

    @property
    def checkpointed_words(self) -> str:
        """'yes' (every unit), 'no', or how many of its units ('12/59')."""
        units = self.last - self.first
        return "yes" if self.recomputed == units else "no" if not self.recomputed else f"{self.recomputed}/{units}"


@dataclass(frozen=True)
class Partition:
    stages: tuple[StageEstimate, ...]
    microbatches: int
    schedule: ScheduleChoice

    @property
    def slowest_s(self) -> float:
        return max(s.busy_s for s in self.stages)

    def by_process(self) -> list[list[StageEstimate]]:
        """The stages each pipeline process runs (interleaved and V-shaped schedules several; GPipe and 1F1B one)."""
        return [[self.stages[k] for k in mine] for mine in self.schedule.stages_by_process(len(self.stages))]

    @property
    def busiest_process_s(self) -> float:
        """Work per micro-batch of the process with the most: the sum of its stages' (for one stage per process,
        the slowest stage)."""
        return max(sum(s.busy_s for s in mine) for mine in self.by_process())

    @property
    def process_memory_bytes(self) -> list[float]:
        """Each process's planned peak: the sum of its stages' (as if all peaked at once)."""
        return [sum(s.memory_bytes for s in mine) for mine in self.by_process()]

    @property
    def step_s(self) -> float:
        per_process = self.microbatches * self.busiest_process_s
        return per_process / (1 - self.schedule.bubble(len(self.stages), self.microbatches))

    @property
    def bubble_fraction(self) -> float:
        """Share of device time idle: 1 - (work done) / (devices x step time)."""
        work = self.microbatches * sum(s.busy_s for s in self.stages)
        return 1 - work / (self.schedule.ranks(len(self.stages)) * self.step_s)

    @property
    def starts(self) -> list[int]:
        return [s.first for s in self.stages[1:]]


def unit_times(cost: UnitCost, hw: Hardware) -> tuple[float, float]:
    if cost.forward_s is not None and cost.backward_s is not None:
        return cost.forward_s, cost.backward_s
    rate = hw.tflops * 1e12
    return cost.forward_flops / rate, cost.backward_flops / rate


class _Counted(list):
    """The units, with each one's figures under one Replicas and Hardware worked out once: a search asks for them
    once for every stage that holds the unit (a Wan 14B world-size-8 plan: millions of times). Its (forward,
    backward) seconds, weights as held, activations as a unit not checkpointed keeps them a micro-batch (with the
    autocast copies its backward keeps), outputs, and one pass's all-to-alls."""

    def __init__(self, costs: list[UnitCost], replicas: Replicas, hw: Hardware):
        super().__init__(costs)
        self.times = [replicas.unit_times(c, hw) for c in costs]
        self.held = [replicas.weight_bytes(c) for c in costs]
        self.whole = [c.activation_bytes + replicas.kept_copies_bytes(c) for c in costs]
        self.outputs = [sum(c.output_bytes.values()) for c in costs]
        self.exchange = [replicas.exchange_s(c, hw) for c in costs]


def _stage(costs: list[UnitCost], boundary_bytes, first, last, index, stages, microbatches, schedule, hw,
           recomputed: int, replicas: Replicas = Replicas()):
    """A stage of units first..last whose last `recomputed` units run checkpointed (and its swapped units, which
    always do). `costs` as partition() passes it: _Counted with these replicas and hardware."""
    if not isinstance(costs, _Counted):
        costs = _Counted(costs, replicas, hw)
    units = costs[first:last]
    times = costs.times[first:last]
    again = range(last - recomputed, last)  # checkpointed: their forward runs twice
    forward = sum(t[0] for t in times)
    backward = sum(t[1] for t in times) + sum(t[0] for t in times[len(units) - len(again):])
    received = boundary_bytes[first - 1] if first > 0 else 0
    sent = boundary_bytes[last - 1] if last < len(costs) else 0
    send = 2 * sent / (hw.link_gbps * 1e9)  # activations forward, their gradients back
    static = replicas.state_bytes(units, costs.held[first:last])
    swapped = [first + i for i in replicas.swapped_positions(units)]
    if swapped:
        saved, waits = _swap_costs([costs[k] for k in swapped], replicas, hw, {id(costs[k]) for k in again})
        static -= saved
        forward, backward = forward + waits[0], backward + waits[1]
    held = schedule.in_flight(index, stages, microbatches)
    # a checkpointed unit keeps its outputs (the next units' inputs) a micro-batch; a swapped one runs checkpointed
    kept_whole = {*swapped, *again}
    whole = costs.whole

    def per_microbatch(k: int) -> float:
        return costs.outputs[k] if k in kept_whole else whole[k]

    kept = received + sum(per_microbatch(k) for k in range(first, last))
    # Between a split backward's input and weight passes a micro-batch also holds the gradients of its weights'
    # op outputs. Not on the first stage: torch runs its whole backward in the weight pass (its inputs need none).
    awaiting = schedule.awaiting_weights(index, stages, microbatches) if index > 0 else 0
    weight_pass = sum(c.weight_pass_bytes for c in units)
    if len(again) == len(units):  # per micro-batch in flight: the stage's inputs and every unit's outputs; in
        # backward one unit's activations, recomputed, which a micro-batch awaiting its weight pass keeps whole
        # (measured: zbv ran out of memory when they were not counted)
        recomputed_whole = received + sum(costs.outputs[k] if k in swapped else whole[k] for k in range(first, last))
        dynamic = (held * kept + awaiting * (recomputed_whole + weight_pass)
                   + max(whole[first + i] + c.working_bytes for i, c in enumerate(units)))
    else:  # and, once, the most any unit holds at once beyond what it keeps (its intermediates), and a
        # recomputed unit's activations in its backward (which a micro-batch awaiting its weight pass keeps)
        recomputed_whole = received + sum(whole[k] for k in again) if again else 0
        dynamic = (held * kept + awaiting * (recomputed_whole + weight_pass)
                   + max((costs[k].activation_bytes for k in swapped), default=0)
                   + max((whole[k] for k in again), default=0) + max(c.working_bytes for c in units))
    # forward, backward, and the recomputed forward of the checkpointed units
    exchange = sum(costs.exchange[first:last]) * 2 + sum(costs.exchange[k] for k in again)
    return StageEstimate(index, first, last, forward, backward, send, static + dynamic, len(again), exchange)


def _swap_costs(swapped: list[UnitCost], replicas: Replicas, hw: Hardware,
                recomputed: set[int]) -> tuple[float, tuple[float, float]]:
    """Block swap's (bytes of device memory saved, (forward, backward) seconds added) for a stage's swapped units.
    Their frozen weights are in host memory but for two at a time (one computing, the next copied in); each is copied
    in twice a micro-batch, for its forward and its recomputation, and compute waits for what of a copy its unit's own
    time does not hide. Those not among the stage's checkpointed units (ids in `recomputed`, whose recomputation the
    stage counts) add their recomputation, an extra forward each."""
    frozen = [replicas.frozen_bytes(c) for c in swapped]
    copy = [b / (hw.host_gbps * 1e9) for b in frozen]
    times = [replicas.unit_times(c, hw) for c in swapped]
    forward = sum(max(0.0, s - t[0]) for s, t in zip(copy, times))
    backward = sum(max(0.0, s - t[1]) for s, t in zip(copy, times))
    backward += sum(t[0] for c, t in zip(swapped, times) if id(c) not in recomputed)
    return sum(frozen) - 2 * max(frozen), (forward, backward)


def _options(mode, index: int, units: int) -> tuple[int, ...]:
    """The counts of a stage's last units that may run checkpointed, fewest first (the last saves the most)."""
    if mode == "none":
        return (0,)
    if mode == "all":
        return (units,)
    if mode == "auto":
        return (0, units)
    if isinstance(mode, Recomputed):
        return (min(mode[index], units),)
    return (units if index in mode else 0,)


def _fits(est: StageEstimate, hw: Hardware, share: float) -> bool:
    """Within 1/share of the device's memory."""
    return hw.memory_bytes is None or est.memory_bytes <= hw.memory_bytes / share


def _best_stage(costs, boundary_bytes, first, last, index, stages, m, schedule, hw, mode,
                replicas: Replicas = Replicas(), share: float = 1) -> StageEstimate | None:
    """The stage as configured; under "auto" without checkpointing when that fits, else with the fewest of its last
    units checkpointed that fit (memory falls as more are: found by bisection)."""
    def stage(recomputed: int) -> StageEstimate:
        return _stage(costs, boundary_bytes, first, last, index, stages, m, schedule, hw, recomputed, replicas)

    options = _options(mode, index, last - first)
    fitting = next((est for est in map(stage, options) if _fits(est, hw, share)), None)
    if mode != "auto" or fitting is None or fitting.recomputed == 0:
        return fitting
    low, high = 0, fitting.recomputed  # low does not fit, high does
    while high - low > 1:
        middle = (low + high) // 2
        est = stage(middle)
        if _fits(est, hw, share):
            high, fitting = middle, est
        else:
            low = middle
    return fitting


def estimate_stages(costs, boundary_bytes, starts: list[int], microbatches: int, schedule: ScheduleChoice,
                    hw: Hardware, checkpointing="none", replicas: Replicas = Replicas()) -> Partition:
    """Figures for a given split (no memory check), e.g. the parameter-count split; where processes run several
    stages, checkpointed process by process when they can fit (`_fitted`)."""
    costs = _Counted(costs, replicas, hw)
    bounds = [0, *starts, len(costs)]
    stages = len(bounds) - 1
    if schedule.ranks(stages) < stages:
        fitted = _fitted(starts, costs, boundary_bytes, stages, microbatches, schedule, hw, checkpointing, replicas)
        if fitted is not None:
            return fitted
    out = []
    for i in range(stages):
        args = (costs, boundary_bytes, bounds[i], bounds[i + 1], i, stages, microbatches, schedule, hw)
        est = _best_stage(*args, checkpointing, replicas, share=stages // schedule.ranks(stages))
        if est is None:  # nothing fits: report the most frugal option allowed, whose memory is the one to beat
            est = _stage(*args, _options(checkpointing, i, bounds[i + 1] - bounds[i])[-1], replicas)
        out.append(est)
    return Partition(tuple(out), microbatches, schedule)


def partition(costs: list[UnitCost], boundary_bytes: list[int], stages: int, microbatches: int,
              schedule: ScheduleChoice, hw: Hardware, checkpointing="none", replicas: Replicas = Replicas()) -> Partition:
    """The partition into `stages` that minimises the slowest stage while every stage fits memory: exact with one
    stage per process. Where a process runs several stages, its time is their sum and its memory holds them all,
    which no split minimising stage by stage captures: the splits by stage within shares of the device from an
    equal share to the whole device, and by parameter count, are made to fit process by process
    (`_fitted`), and the one with the shortest step is improved by moving one boundary by one unit at a time
    while the step gets shorter (a local search, not exact)."""
    if stages > len(costs):
        raise Infeasible(f"{stages} stages but only {len(costs)} units; use at most {len(costs)} stages")
    costs = _Counted(costs, replicas, hw)
    args = (costs, boundary_bytes, stages, microbatches, schedule, hw, checkpointing, replicas)
    per_process = stages // schedule.ranks(stages)
    exact = _split(*args, share=per_process)
    if per_process == 1:
        if exact is None:
            raise Infeasible("no split into {} stages fits {:.1f} GiB per device".format(
                stages, (hw.memory_bytes or 0) / 2**30))
        return Partition(tuple(exact), microbatches, schedule)
    # between the two, stages within a part of the device: more memory must never lose a split that fits less
    # (the roomiest split alone packs stages that fit one by one but not as processes)
    roomier = [_split(*args, share=1 + (per_process - 1) * k / _SHARES) for k in range(_SHARES)]
    candidates = [[s.first for s in split[1:]] for split in (exact, *roomier) if split is not None]
    candidates.append(balanced_partition([c.params for c in costs], stages))
    fitted = [part for part in (_fitted(starts, *args) for starts in candidates) if part is not None]
    if not fitted:
        raise Infeasible("no split into {} stages fits {:.1f} GiB per device, the stages of a process together".format(
            stages, (hw.memory_bytes or 0) / 2**30))
    best = min(fitted, key=lambda part: part.step_s)
    while True:
        moved = [_fitted(starts, *args) for starts in _neighbours(best.starts, len(costs))]
        shorter = min((part for part in moved if part is not None), key=lambda part: part.step_s, default=None)
        if shorter is None or shorter.step_s >= best.step_s:
            return best
        best = shorter


_SHARES = 8  # splits tried per process memory, from each stage within all of a device to within 1/stages per process


def _neighbours(starts: list[int], units: int) -> list[list[int]]:
    """The splits with one boundary moved by one unit, every stage keeping a unit."""
    out = []
    for i in range(len(starts)):
        for delta in (-1, 1):
            moved = starts[:i] + [starts[i] + delta] + starts[i + 1:]
            bounds = [0, *moved, units]
            if all(a < b for a, b in zip(bounds, bounds[1:])):
                out.append(moved)
    return out


def _fitted(starts: list[int], costs, boundary_bytes, stages: int, microbatches: int, schedule: ScheduleChoice,
            hw: Hardware, checkpointing, replicas: Replicas) -> Partition | None:
    """The split at `starts` for processes that run several stages each (interleaved and V-shaped schedules): each
    process's stages must fit its device together (the sum of their peaks, as if all peaked at once), and under
    checkpointing "auto" each stage's choice (none, all, or the fewest of its last units that fit an equal share of
    the device) is the one that makes its process's work least. None if a process cannot fit."""
    bounds = [0, *starts, len(costs)]

    def estimate(k: int, recomputed: int) -> StageEstimate:
        return _stage(costs, boundary_bytes, bounds[k], bounds[k + 1], k, stages, microbatches, schedule, hw,
                      recomputed, replicas)

    def options(k: int, share: int) -> tuple[int, ...]:
        """Under "auto": none, all, and the fewest last units with which the stage fits its share of the device."""
        whole = _options(checkpointing, k, bounds[k + 1] - bounds[k])
        if checkpointing != "auto":
            return whole
        fewest = _best_stage(costs, boundary_bytes, bounds[k], bounds[k + 1], k, stages, microbatches, schedule, hw,
                             "auto", replicas, share)
        return tuple(sorted({*whole, *([fewest.recomputed] if fewest is not None else [])}))

    if hw.memory_bytes is None:
        return Partition(tuple(estimate(k, options(k, 1)[0]) for k in range(stages)), microbatches, schedule)
    chosen: dict[int, StageEstimate] = {}
    for mine in schedule.stages_by_process(stages):
        best = None
        for flags in itertools.product(*(options(k, len(mine)) for k in mine)):
            ests = [estimate(k, ckpt) for k, ckpt in zip(mine, flags)]
            held = sum(e.memory_bytes for e in ests)
            key = (sum(e.busy_s for e in ests), held)  # the process's work: it runs all its stages
            if held <= hw.memory_bytes and (best is None or key < best[0]):
                best = (key, ests)
        if best is None:
            return None
        chosen.update({e.index: e for e in best[1]})
    return Partition(tuple(chosen[k] for k in range(stages)), microbatches, schedule)


def _split(costs, boundary_bytes, stages: int, microbatches: int, schedule: ScheduleChoice, hw: Hardware,
           checkpointing, replicas: Replicas, share: float) -> list[StageEstimate] | None:
    """The split minimising the slowest stage, each stage within 1/share of the device; None if none fits.
    Exact by dynamic programming (tests compare it with brute force)."""
    n = len(costs)
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
                                  checkpointing, replicas, share)
                if est is not None and max(best[s - 1][j], est.busy_s) < best[s][i]:
                    best[s][i], choice[s][i] = max(best[s - 1][j], est.busy_s), est
    if best[stages][n] == inf:
        return None
    out, i = [], n
    for s in range(stages, 0, -1):
        est = choice[s][i]
        out.append(est)
        i = est.first
    return out[::-1]

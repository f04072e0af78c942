"""Stage boundaries from the unit dataflow: which named tensors cross each boundary (liveness).

A tensor crosses the boundary after unit k when a later unit reads the version written at or before k.
A skip produced and consumed inside one stage never crosses; one consumed three stages later passes
through every stage in between. Boundaries come from the user (`pipeline.split`) or are balanced by
parameter count (`balanced_by_parameters`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models.units import Backbone
from ..errors import SplitError

__all__ = ["StageSpec", "SplitError", "stage_specs", "balanced_by_parameters", "balanced_partition", "live_after",
           "check_stage_count"]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: units [first, last) and the names it receives and sends, in order."""

    index: int
    first: int
    last: int
    receives: tuple[str, ...]
    sends: tuple[str, ...]


def _producers(backbone: Backbone) -> list[dict[str, int]]:
    """For each unit, the index of the unit that wrote each non-condition name it reads (-1: a model input)."""
    latest = {name: -1 for name in backbone.inputs}
    out = []
    for j, unit in enumerate(backbone.units):
        reads = {}
        for name in unit.reads:
            if name in backbone.conditions:
                continue
            if name not in latest:
                raise SplitError(f"unit {unit.name} reads {name!r}, which no earlier unit writes")
            reads[name] = latest[name]
        out.append(reads)
        latest.update({name: j for name in unit.writes})
    return out


def _name_order(backbone: Backbone) -> dict[str, int]:
    order = {name: i for i, name in enumerate(backbone.inputs)}
    for unit in backbone.units:
        for name in unit.writes:
            order.setdefault(name, len(order))
    return order


def live_after(backbone: Backbone, k: int) -> tuple[str, ...]:
    """Names that must cross the boundary after unit k (0-based), in production order."""
    producers = _producers(backbone)
    live = {name for j in range(k + 1, len(backbone.units)) for name, p in producers[j].items() if p <= k}
    order = _name_order(backbone)
    return tuple(sorted(live, key=order.__getitem__))


def stage_specs(backbone: Backbone, starts: list[int]) -> list[StageSpec]:
    """Specs for stages beginning at unit indices `[0, *starts]`."""
    n = len(backbone.units)
    if any(not 0 < s < n for s in starts) or sorted(set(starts)) != list(starts):
        raise SplitError(f"pipeline.split={list(starts)} must be strictly increasing unit indices in 1..{n - 1} "
                         f"(the model has {n} units: {', '.join(u.name for u in backbone.units)})")
    bounds = [0, *starts, n]
    specs = []
    for i in range(len(bounds) - 1):
        first, last = bounds[i], bounds[i + 1]
        receives = backbone.inputs if first == 0 else live_after(backbone, first - 1)
        sends = (backbone.output,) if last == n else live_after(backbone, last - 1)
        specs.append(StageSpec(i, first, last, receives, sends))
    return specs


def check_stage_count(backbone: Backbone, stages: int) -> None:
    """Every stage needs a unit: more stages than units is refused, naming them (every planner entry asks first)."""
    n = len(backbone.units)
    if stages > n:
        names = ", ".join(u.name for u in backbone.units[:12]) + (f" and {n - 12} more" if n > 12 else "")
        raise SplitError(f"pipeline.stages x pipeline.virtual_stages = {stages} stages, but the model has only {n} "
                         f"units ({names}); use at most {n} stages")


def balanced_by_parameters(backbone: Backbone, stages: int) -> list[int]:
    """Stage starts that minimise the largest stage's parameter count (contiguous partition, exact DP)."""
    n = len(backbone.units)
    check_stage_count(backbone, stages)
    return balanced_partition([backbone.unit_parameters(i) for i in range(n)], stages)


def balanced_partition(weights: list[float], stages: int) -> list[int]:
    """Starts of `stages` contiguous groups minimising the largest group's total weight."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: smallest max-stage size splitting units[:i] into s stages; cut[s][i] the last stage's start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return sorted(starts)[1:]

"""The memory settings a config leaves to the planner: memory.block_swap = "auto", memory.optimizer_state = "auto", and
memory.base_dtype = "auto" with the formats of memory.quantise_if_needed.

Where a layout does not fit as configured (checkpointing already chosen where "auto"), the planner tries settings that
change less of what is computed first, keeping each change once made:
  1. nothing more (each "auto" at its unchanged value: no swap, fp32 moments, the base as "auto" holds it);
  2. 8-bit AdamW moments (optimizer_state "auto"): the optimizer's arithmetic changes slightly;
  3. each format of quantise_if_needed, in the user's order (base_dtype "auto"): the model itself changes;
and at each of these, first without swapped units, then with the fewest that fit (block_swap "auto": swapping
changes nothing computed, and was measured at 0.99x the unswapped speed on Flux.1-dev: docs/benchmarks.md).
The first that fits is the choice; none fitting leaves the layout infeasible.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from ..config import MemoryConfig, RunConfig
from ..models.storage import LINEAR_FORMATS, FrozenStorage
from ..precision import moment_bytes
from .costs import UnitCost
from .partition import Replicas

__all__ = ["MemoryChoice", "choose", "fewest_swapped", "leaves_any", "unchanged", "most_saving", "plan_memory",
           "suggestions", "holding"]


@dataclass(frozen=True)
class MemoryChoice:
    """The [memory] settings a run takes, "auto" resolved (base_dtype "auto" stays: precision.frozen_storage holds
    its meaning, bf16 or fp32 by device)."""

    base_dtype: str
    optimizer_state: str
    block_swap: int

    def changes(self, memory: MemoryConfig) -> dict:
        """The settings that differ from `memory`'s, by key."""
        return {k: v for k, v in vars(self).items() if getattr(memory, k) != v}

    def words(self, held: str) -> str:
        """The settings in config words; `held`: how "auto" frozen weights are stored (FrozenStorage.name)."""
        base = f'"{self.base_dtype}"' + (f" ({held})" if self.base_dtype == "auto" else "")
        return (f'memory.base_dtype = {base}, memory.optimizer_state = "{self.optimizer_state}", '
                f"memory.block_swap = {self.block_swap}")


def _swap_allowed(config: RunConfig, replicas: int) -> bool:
    """Whether the planner may swap blocks: block_swap "auto", one replica, no stage compiled whole (config.py
    says why)."""
    return config.memory.block_swap == "auto" and replicas == 1 and config.pipeline.compile is not True


def _whole_tensors(sharded: bool, replicas: int) -> bool:
    """Whether state may be held as whole tensors, as 8-bit moments (bitsandbytes' kernels) and a quantised base
    (a scale per row beside each weight) are: not across sharded replicas (config.py says why)."""
    return not (sharded and replicas > 1)


def leaves_any(memory: MemoryConfig) -> bool:
    """Whether the planner chooses any memory setting of this config."""
    return "auto" in (memory.block_swap, memory.optimizer_state) or bool(
        memory.base_dtype == "auto" and memory.quantise_if_needed)


def unchanged(config: RunConfig) -> MemoryChoice:
    """The settings as configured, each "auto" at its unchanged value."""
    m = config.memory
    return MemoryChoice(m.base_dtype, "fp32" if m.optimizer_state == "auto" else m.optimizer_state,
                        0 if m.block_swap == "auto" else m.block_swap)


def _settings(config: RunConfig, replicas: Replicas) -> Iterator[tuple[MemoryChoice, Replicas]]:
    """Steps 1-3 of the module's docstring, each with swap as configured (0 where "auto")."""
    m = config.memory
    choice = unchanged(config)
    yield choice, replicas
    whole = _whole_tensors(replicas.sharded, replicas.count)  # the layout's replicas, not only the config's
    if m.optimizer_state == "auto" and whole:
        choice = replace(choice, optimizer_state="8bit")
        replicas = replace(replicas, moment_bytes=moment_bytes("8bit"))
        yield choice, replicas
    # a full fine-tune has no frozen base to quantise; sharded replicas cannot cut a quantised one (config.py)
    if m.base_dtype == "auto" and config.adapter.type != "none" and whole:
        rest = torch.bfloat16 if config.train.precision != "fp32" else torch.float32
        for format in m.quantise_if_needed:
            yield replace(choice, base_dtype=format), replace(replicas, frozen=FrozenStorage(rest, format))


def choose(config: RunConfig, replicas: Replicas, fits: Callable[[Replicas], bool],
           holding: int) -> tuple[MemoryChoice, Replicas] | None:
    """The first settings of the module's order with which `fits` holds (`replicas`: the layout as configured, each
    "auto" unchanged; `holding`: units holding frozen weights, the most block swap can take); None if none do."""
    swap_auto = _swap_allowed(config, replicas.count // replicas.sequence)  # the data-parallel ones
    for choice, held in _settings(config, replicas):
        if fits(held):
            return choice, held
        count = fewest_swapped(held, fits, holding) if swap_auto else None
        if count is not None:
            return replace(choice, block_swap=count), replace(held, block_swap=count)
    return None


def fewest_swapped(replicas: Replicas, fits: Callable[[Replicas], bool], holding: int) -> int | None:
    """The fewest units per stage, more than `replicas` swaps already, whose frozen weights kept in host memory make
    `fits` hold (at most `holding`, the units holding frozen weights); None if none do."""
    for count in range(replicas.block_swap + 1, holding + 1):
        if fits(replace(replicas, block_swap=count)):
            return count
    return None


def suggestions(costs: list[UnitCost], replicas: Replicas, adamw: bool) -> list[tuple[str, Replicas]]:
    """The [memory] settings not in use that would hold the same layout's state in less memory (8-bit moments are
    AdamW's alone)."""
    levers = []
    frozen, autocast = any(c.params > c.trainable_params for c in costs), replicas.autocast_bytes > 0
    if frozen and autocast and replicas.frozen.dtype == torch.float32 and not replicas.frozen.linear:
        levers.append(('memory.base_dtype = "bf16"', replace(replicas, frozen=FrozenStorage(torch.bfloat16))))
    rest = torch.bfloat16 if autocast else torch.float32
    # int8 holds what fp8 holds in as many bytes: one suggestion for both
    words = {"fp8": '"fp8" or "int8" (changes the model slightly)', "nf4": '"nf4" (changes the model more)'}
    can_quantise = frozen and _whole_tensors(replicas.sharded, replicas.count)
    for format in (f for f in words if LINEAR_FORMATS[f] < replicas.frozen.linear_bytes(1)) if can_quantise else []:
        levers.append((f"memory.base_dtype = {words[format]}", replace(replicas, frozen=FrozenStorage(rest, format))))
    if adamw and any(c.trainable_params for c in costs) and replicas.moment_bytes > moment_bytes("8bit") and (
            _whole_tensors(replicas.sharded, replicas.count)):
        levers.append(('memory.optimizer_state = "8bit"', replace(replicas, moment_bytes=moment_bytes("8bit"))))
    return levers


def holding(costs: list[UnitCost]) -> int:
    """Units holding frozen weights: the most block swap can take."""
    return sum(c.params > c.trainable_params for c in costs)


def plan_memory(config: RunConfig, plan) -> MemoryChoice:
    """The [memory] settings a plan (planner/plan.py's `Plan`) holds its stages' state with: the config's, with what
    the planner chose where it left them to it."""
    held = plan.replicas
    return MemoryChoice(held.frozen.linear or unchanged(config).base_dtype,
                        "8bit" if config.memory.optimizer_state != "fp32" and held.moment_bytes < moment_bytes("fp32")
                        else "fp32", held.block_swap)


def most_saving(config: RunConfig, holding: int) -> MemoryChoice:
    """Where nothing fits: every setting left to the planner at its most saving (the nearest to fitting); `holding`:
    the units holding frozen weights."""
    m, p, choice = config.memory, config.pipeline, unchanged(config)
    return MemoryChoice(
        min(m.quantise_if_needed, key=LINEAR_FORMATS.get)
        if m.base_dtype == "auto" and m.quantise_if_needed and config.adapter.type != "none" else choice.base_dtype,
        "8bit" if m.optimizer_state == "auto" and _whole_tensors(p.data_parallel_shard, p.data_parallel)
        else choice.optimizer_state,
        holding if _swap_allowed(config, p.data_parallel) else choice.block_swap)

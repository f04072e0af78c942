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
from ..models.storage import FrozenStorage
from ..precision import moment_bytes
from .partition import Replicas

__all__ = ["MemoryChoice", "choose", "fewest_swapped", "leaves_any", "unchanged"]


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
    m, p = config.memory, config.pipeline
    choice = unchanged(config)
    yield choice, replicas
    if m.optimizer_state == "auto" and not (p.data_parallel_shard and p.data_parallel > 1):  # config.py says why
        choice = replace(choice, optimizer_state="8bit")
        replicas = replace(replicas, moment_bytes=moment_bytes("8bit"))
        yield choice, replicas
    if m.base_dtype == "auto" and config.adapter.type != "none":  # a full fine-tune has no frozen base to quantise
        rest = torch.bfloat16 if config.train.precision != "fp32" else torch.float32
        for format in m.quantise_if_needed:
            yield replace(choice, base_dtype=format), replace(replicas, frozen=FrozenStorage(rest, format))


def choose(config: RunConfig, replicas: Replicas, fits: Callable[[Replicas], bool],
           holding: int) -> tuple[MemoryChoice, Replicas] | None:
    """The first settings of the module's order with which `fits` holds (`replicas`: the layout as configured, each
    "auto" unchanged; `holding`: units holding frozen weights, the most block swap can take); None if none do."""
    swap_auto = config.memory.block_swap == "auto" and replicas.count == 1 and not config.pipeline.compile
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

"""Block swap (memory.block_swap = N): the frozen weights of N units of each stage live in host memory and come to
the device only while the unit computes, so a stage holds two units' frozen weights instead of all of them.

A swapped unit runs checkpointed (pipeline/stage.py): its forward keeps only its inputs, and backward runs it again,
so its weights are needed at two moments per micro-batch: the forward, and the recomputation just before its
backward. Each time, the weights are copied in from pinned host memory on a side stream, the compute stream waits for
that copy alone, and the unit computes on the copies (the parameters themselves always point at host memory): a
copy is freed when nothing holds it (after the forward at once; after the recomputation, when the unit's backward has
used what it saved). Copies are started ahead: in forward, the next swapped unit's while this one computes; in
backward, the previous one's when this one's backward begins (a hook on its outputs' gradients), so the copy overlaps
with compute whenever the host link is fast enough (the planner charges what does not overlap: `plan.host_gbps`).

Only frozen weights swap (a LoRA base, or the frozen part of any unit): trained ones stay on the device, where the
optimizer updates them. On a CPU, "device" and host are the same memory: the logic runs (tests), nothing is saved.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["SwappedWeights", "swapped_units", "last_holding", "holds_frozen"]


class SwappedWeights:
    """The frozen parameters of one unit, held in host memory; `run` computes the unit on device copies of them.

    The copies are passed in for the call (torch.func.functional_call), never put into the parameters: autograd
    keeps what an op saved, so a backward reads the copy it was given even after the parameter's data changed (a
    parameter pointed at host memory again after its forward left the recomputation on the wrong device)."""

    def __init__(self, module: nn.Module, device: torch.device, side_stream=None):
        named = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        self.device, self.side_stream = device, side_stream
        pin = device.type == "cuda"
        self.host = [p.data.to("cpu").pin_memory() if pin else p.data for p in self.params]
        self._pending: tuple[list[torch.Tensor], object] | None = None  # device copies on their way, and their event
        self.to_host()
        self.fetches = 0  # copies made (the tests count them)

    def prefetch(self) -> None:
        """Start copying the weights to the device (on the side stream) unless a copy is already on its way."""
        if self._pending is not None:
            return
        self.fetches += 1
        if self.side_stream is None:  # a CPU: copies in the same memory, so that what computes is still a copy
            self._pending = ([h.clone() for h in self.host], None)
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))  # host copies are never written: safe
        with torch.cuda.stream(self.side_stream):
            copies = [h.to(self.device, non_blocking=True) for h in self.host]
            done = self.side_stream.record_event()
        self._pending = (copies, done)

    def fetch(self) -> dict[str, torch.Tensor]:
        """The device copies by parameter name, once their copy has ended (the device waits, not the host)."""
        self.prefetch()
        copies, done = self._pending
        self._pending = None
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            for copy in copies:  # made on the side stream, used on this one: freed only after this one's use
                copy.record_stream(stream)
        return dict(zip(self.names, copies))

    def hide(self) -> None:
        """Point the parameters at empty tensors, so that moving the module moves nothing of these weights."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype)

    def to_host(self) -> None:
        """Point the parameters at the host copies (where they stay)."""
        for p, host in zip(self.params, self.host):
            p.data = host

    def run(self, unit, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unit on `inputs` (the tensors it reads), computed on copies of its frozen weights brought in; they are
        freed when nothing holds them."""
        return torch.func.functional_call(unit.module, self.fetch(), args=(), kwargs=inputs, strict=False)


def last_holding(holds_frozen: list[bool], count: int) -> list[int]:
    """Indices of the last `count` of a stage's units that hold frozen weights (all of them if fewer): those whose
    frozen weights swap. The runtime (`swapped_units`) and the planner (partition.Replicas.swapped) both pick so."""
    holding = [i for i, holds in enumerate(holds_frozen) if holds]
    return holding[max(0, len(holding) - count):] if count else []


def holds_frozen(units: list) -> list[bool]:
    """Whether each unit holds frozen weights: the units block swap can take."""
    return [any(not p.requires_grad for p in unit.module.parameters()) for unit in units]


def swapped_units(units: list, count: int) -> list[int]:
    """Indices of the stage's units whose frozen weights swap."""
    return last_holding(holds_frozen(units), count)

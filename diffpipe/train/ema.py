"""An exponential moving average of the trained weights (`train.ema_decay`), as diffusers' `EMAModel` keeps it: after
optimizer step n the average moves 1 - d_n of the way toward the weights, d_n = min(decay, (1 + k) / (10 + k)) with
k = n - 1 (the first step copies the weights, the next ones average over a window that widens up to 1 / (1 - decay)
steps).

Each process averages the weights it trains (a sharded replica its shard). The average is checkpointed beside them
(`ema.NAME`, with the count of steps it has seen), so a run resumes it on any layout; the run's outputs (samples
during and after training, the final weights, exports of a checkpoint or every N steps) are the averaged model, and
the eval loss is the trained weights' own.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..pipeline.data_parallel import local
from ..torch_support import lerp_in_place

__all__ = ["MovingAverage"]


class MovingAverage:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.averages = [p.detach().clone() for p in params]  # DTensors stay DTensors: checkpoints shard them alike
        self.steps = torch.zeros((), dtype=torch.int64)  # optimizer steps seen (a tensor: checkpointed as one)

    def weight(self, steps: int) -> float:
        """1 - d_n for the n-th step (1: the first copies the weights)."""
        k = steps - 1
        return 1.0 - (min(self.decay, (1 + k) / (10 + k)) if k > 0 else 0.0)

    @torch.no_grad()
    def update(self, skipped: torch.Tensor | None = None) -> None:
        """After an optimizer step; `skipped` (0-d on the device, 1 where the step was skipped for non-finite
        gradients) leaves the average where it was without the host waiting for it. A skipped step is still counted
        (the host does not read it), so the decay schedule moves on one step where diffusers' EMAModel, not called
        for a skipped step, would not."""
        self.steps += 1
        weight = torch.tensor(self.weight(int(self.steps)), device=self.averages[0].device if self.averages else None)
        if skipped is not None:
            weight = weight * (1 - skipped)
        lerp_in_place([local(a) for a in self.averages], [local(p.detach()) for p in self.params], weight)

    @contextmanager
    def swapped_in(self):
        """The averaged weights in the parameters while inside (the trained ones put back after)."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, average in zip(self.params, self.averages):
                p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, kept in zip(self.params, trained):
                    p.copy_(kept)

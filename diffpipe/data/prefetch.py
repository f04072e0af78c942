"""The next step's batch, made while the device works on this one.

Making a batch reads the dataset, draws noise and timesteps and runs the text encoder; a host copy or a mask
check inside it (transformers' attention-mask handling) waits for the device. Done in the training thread,
each such wait would drain the queued forward and backward and leave the GPU idle while the host catches up.
A background thread with its own CUDA stream makes the batch instead: its waits cover only its own work.
On a CPU there is no device queue to keep fed and a thread would only compete for the cores: the batch is
made when it is taken.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from .batches import StepBatch

__all__ = ["BatchPrefetcher"]


class BatchPrefetcher:
    """`ask(step)` starts making a batch in the background; `take(step)` returns it, ready for the device."""

    def __init__(self, make: Callable[[int], StepBatch], device: torch.device):
        self.make, self.device = make, device
        background = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if background else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffpipe-batches") if background else None
        self.asked: dict[int, Future] = {}

    def _make(self, step: int) -> StepBatch:
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.stream):
            batch = self.make(step)
        self.stream.synchronize()  # waits for the batch's own kernels only
        return batch

    def ask(self, step: int) -> None:
        if self.pool is not None and step not in self.asked:
            self.asked[step] = self.pool.submit(self._make, step)

    def take(self, step: int) -> StepBatch:
        if self.pool is None:
            return self.make(step)
        self.ask(step)
        batch = self.asked.pop(step).result()  # re-raises what went wrong while making it
        # made on the side stream, used on this one: its memory must not be reused before this stream is done
        current = torch.cuda.current_stream(self.device)
        for tensor in (batch.noisy, batch.target, *batch.conditions.values()):
            tensor.record_stream(current)
        return batch

    def close(self) -> None:
        for future in self.asked.values():
            future.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

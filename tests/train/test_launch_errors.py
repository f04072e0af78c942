"""When one process fails, the launcher names its error, not the lost connections the others then meet."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from diffpipe.distributed import WorkerFailed, launch


def _rank_zero_fails_first() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        raise ValueError("planted failure on rank 0")
    time.sleep(1.0)  # rank 1 then waits for rank 0 in a collective, whose connection closes
    dist.all_reduce(torch.ones(1))


def test_the_first_real_error_is_named_not_the_knock_on_ones():
    with pytest.raises(WorkerFailed, match=r"ValueError: planted failure on rank 0 \(process 0\)"):
        launch(_rank_zero_fails_first, (), 2)


def _a_stage_runs_out_of_memory() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        try:  # as torch's pipelining reports a failure inside a stage: the cause chained under a list of inputs
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("[Stage 1] failed to run forward:\nargs: ('Tensor(...)',)\nkwargs: {}") from exc
    time.sleep(1.0)
    dist.all_reduce(torch.ones(1))


def test_a_failure_inside_a_stage_is_named_by_its_cause():
    with pytest.raises(WorkerFailed, match=r"OutOfMemoryError: CUDA out of memory.*\(planted\) \(process 1\)"):
        launch(_a_stage_runs_out_of_memory, (), 2)

"""The stage clock sees a zero-bubble schedule's split backward: the input-gradient pass as "backward" (ended by the
received tensors' gradients) and the later weight pass as "weight", run through torch's own split-backward functions."""
from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from diffpipe.pipeline.timing import Mark, StageClock


def test_input_and_weight_passes_are_timed_apart():
    device = torch.device("cpu")
    layer = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    clock = StageClock(1, device, split_backward=True)
    clock.watch_parameters(layer)
    clock.start_step(Mark(device))
    received = torch.randn(3, 4, requires_grad=True)
    clock.forward_started()
    clock.watch_inputs((received,))
    out = clock.watch_outputs((layer(received),))[0].clone()  # as StageModule sends them: the schedule detaches in place
    clock.forward_ended()
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [received], layer.parameters())
    kinds = [iv.kind for iv in clock.intervals()]
    assert kinds == ["forward", "backward"]  # no weight gradient yet
    stage_backward_weight(layer.parameters(), groups)
    intervals = clock.intervals()
    assert [iv.kind for iv in intervals] == ["forward", "backward", "weight"]
    assert intervals[1].end_s <= intervals[2].start_s  # the weight pass after the input pass, not inside it
    assert all(p.grad is not None for p in layer.parameters())

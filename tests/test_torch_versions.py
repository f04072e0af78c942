"""The torch versions diffpipe promises: the version check, the one door to torch's private APIs, and the split
backward that torch 2.11 runs differently from 2.13. `.ci/run` runs every test marked `torch_smoke` under each
tested torch besides the pinned one (README, "Supported torch versions")."""
from __future__ import annotations

import pytest
import torch

from diffpipe import torch_support
from diffpipe.torch_support import TorchVersionError, check_torch, split_backward_input, split_backward_weight

pytestmark = pytest.mark.torch_smoke


def test_versions_older_than_the_oldest_tested_are_refused_and_newer_ones_warned():
    with pytest.raises(TorchVersionError, match=r"needs torch 2\.11 or newer.*pip install"):
        check_torch("2.10.1+cu128")
    assert check_torch("2.11.0+cu130") is None
    assert check_torch("2.13.0+cpu") is None
    assert "newer than the versions diffpipe is tested on" in check_torch("2.99.0")
    assert check_torch() is None, f"the suite runs on an untested torch {torch.__version__}"


def test_a_missing_private_api_is_one_sentence_naming_it_and_the_fix():
    with pytest.raises(TorchVersionError) as caught:
        torch_support._private("torch.distributed.pipelining", "_no_such_function", "testing")
    message = str(caught.value)
    assert "torch.distributed.pipelining._no_such_function" in message and "pip install" in message
    assert "\n" not in message


def test_every_private_api_diffpipe_uses_is_there():
    """What a user's torch must have, checked on the torch running the suite (each tested version in .ci/run)."""
    wrappers = torch_support.data_parallel_wrappers()
    assert set(wrappers) == {"ddp_replicate", "DDPModule", "fsdp_replicate", "ReplicateModule"}
    with torch_support.recompile_limit(64):
        pass
    torch_support.scale_in_place([torch.ones(2)], 0.5)
    assert torch_support.non_persistent_buffers(torch.nn.BatchNorm1d(2)) == set()
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    assert torch_support.schedule_actions(ScheduleZBVZeroBubble, 2, 2, 2)
    q = torch.randn(1, 2, 4, 8, device="meta")
    assert torch_support.fused_attention(q, q, q, 0.0, False, None).shape == q.shape


def test_the_split_backward_leaves_out_an_input_the_outputs_do_not_use():
    """torch 2.11's input pass raised 'One of the differentiated Tensors appears to not have been used in the
    graph' for a unit reading a tensor it does not differentiate through (every plan crashed on it)."""
    layer = torch.nn.Linear(4, 4)
    used = torch.randn(2, 4, requires_grad=True)
    unused = torch.randn(2, 4, requires_grad=True)
    only_shape = torch.randn(2, 4, requires_grad=True)
    out = layer(used) + only_shape.detach()  # a path that carries no gradient
    groups = split_backward_input([out], [torch.ones_like(out)], [used, unused, only_shape],
                                  iter(layer.parameters()))
    split_backward_weight(iter(layer.parameters()), groups)
    assert used.grad is not None and unused.grad is None and only_shape.grad is None
    expected = torch.ones(2, 4) @ layer.weight
    assert torch.allclose(used.grad, expected)
    assert torch.allclose(layer.weight.grad, torch.ones(4, 2) @ used.detach())


def test_v_shaped_schedules_on_cpu_are_refused_before_torch_2_13():
    """torch 2.11 + gloo failed deep inside torch ("Pair is not connected") at a zbv/dualpipev run's first step."""
    from diffpipe.torch_support import schedule_problem

    assert "needs torch 2.13 or newer" in schedule_problem("zbv", "v", "cpu", "2.11.0+cu130")
    assert schedule_problem("zbv", "v", "cuda", "2.11.0+cu130") is None  # NCCL sends to its own process
    assert schedule_problem("zbv", "v", "cpu", "2.13.0+cpu") is None
    assert schedule_problem("zb1p", "loop", "cpu", "2.11.0") is None

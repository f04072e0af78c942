"""Clipping inside the fused AdamW step (its `grad_scale`) updates the weights as clipping the gradients first."""
from __future__ import annotations

import pytest
import torch

from diffpipe.train.optim import clip_gradients, step_optimizer


def _weights_after_steps(fused: bool, max_norm: float, unscale: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(64, 32), (32,), (7, 3, 3)]]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * (10.0 if step == 1 else 0.01) / unscale  # one step clips, two do not
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # of the scaled gradients
        step_optimizer(opt, params, clip_gradients(params, norm, max_norm, unscale))
    return [p.detach() for p in params]


@pytest.mark.parametrize("max_norm,unscale", [(1.0, 1.0), (1.0, 1 / 1024), (0.0, 1 / 1024)],
                         ids=["clip", "clip-fp16-scale", "fp16-scale-only"])
def test_fused_step_clips_as_multiplying_first(max_norm, unscale):
    fused = _weights_after_steps(True, max_norm, unscale)
    multiplied = _weights_after_steps(False, max_norm, unscale)
    unclipped = _weights_after_steps(False, 0.0, 1.0)
    for a, b in zip(fused, multiplied):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if max_norm > 0:  # and clipping did change the result
        assert max((a - b).abs().max().item() for a, b in zip(fused, unclipped)) > 1e-4


def test_nothing_to_scale_gives_no_factor():
    params = [torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.ones(3)
    assert clip_gradients(params, None, 0.0, 1.0) is None

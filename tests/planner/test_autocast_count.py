"""The planner counts what a unit saves for backward in the dtypes CUDA's autocast gives each op (precision/autocast.py),
on the meta device. The expected bytes below are worked out by hand from torch's autocast lists for CUDA; the
per-unit figures of Flux.1-dev and Wan 14B blocks were checked against an H200 (bench/unit_memory.py, docs)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from diffpipe.planner.costs import count_unit_costs

from .lifted import lifted

B, T, D = 2, 8, 16  # batch, tokens, width
ROWS = B * T


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.trained = nn.Linear(D, D)
        self.rms = nn.RMSNorm(D)
        for module in (self.frozen, self.norm, self.rms):
            module.requires_grad_(False)

    def forward(self, h):
        a = self.frozen(h)  # nothing but the weight (its copy charged apart) is needed for h's gradient
        b = self.norm(a)  # fp32: its input upcast and saved, with per-row mean and reciprocal root
        # twice: a bf16 copy of b saved at each use (autocast caches no activation's cast), the trained weight's copy
        # once per micro-batch (cached)
        c = self.trained(b) + self.trained(b)
        d = self.rms(c)  # fused where its weight has c's dtype (bf16 base): c and an fp32 root per row
        return {"y": d.softmax(-1)}  # fp32: the output saved


def _composite_rms_norm_bytes() -> int:
    """What torch's rms_norm saves where it is not fused (a bf16 input, an fp32 weight): its own composition."""
    saved = {}
    x = torch.zeros(B, T, D, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(id(t), t), lambda t: t):
        torch.nn.functional.rms_norm(x, (D,), torch.ones(D, device="meta"))
    return sum(t.numel() * t.element_size() for t in saved.values() if t.dim() > 1)


def _count(frozen_dtype):
    backbone = lifted(_Block, D)
    return count_unit_costs(backbone, {"x": torch.zeros(B, T, D)}, {}, torch.bfloat16, frozen_dtype)[1]


@pytest.mark.parametrize("base", ["fp32", "bf16"])
def test_a_unit_is_counted_in_the_dtypes_cuda_autocast_saves(base):
    cost = _count(None if base == "fp32" else torch.bfloat16)
    bf16, fp32 = 2, 4
    layer_norm = ROWS * D * fp32 + 2 * ROWS * fp32
    trained_linear = 2 * ROWS * D * bf16
    # an fp32 weight meets a bf16 input: torch composes the norm of ops that keep fp32 copies; a bf16 weight takes
    # CUDA's fused kernel, which keeps the input as it is and an fp32 root per row
    rms = _composite_rms_norm_bytes() if base == "fp32" else ROWS * D * bf16 + ROWS * fp32
    softmax = ROWS * D * fp32
    assert cost.activation_bytes == layer_norm + trained_linear + rms + softmax
    assert cost.trained_copy_bytes == D * D * bf16
    assert cost.output_bytes == {"y": ROWS * D * fp32}


def test_fp32_compute_saves_fp32():
    backbone = lifted(_Block, D)
    cost = count_unit_costs(backbone, {"x": torch.zeros(B, T, D)}, {})[1]
    assert cost.trained_copy_bytes == 0
    assert cost.output_bytes == {"y": ROWS * D * 4}

"""`pipeline.compile`: a stage compiled by torch.compile (inductor), whole with activation checkpointing inside
the graph or only its repeated transformer blocks, computes what the eager stage computes: outputs, gradients
of its weights and of what it received."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from diffusers import UNet2DConditionModel

from diffpipe.models.families.unet.unet2d import UNet2DFamily
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.sampling import run_stages

from ..models.test_unet_units import SDXL_STYLE, _inputs


ROUNDING_RATIO = 8.0


def _backbone(unet: UNet2DConditionModel):
    return UNet2DFamily().backbone(unet, "layers")


def _rounding_ratio(have: torch.Tensor, want: torch.Tensor, truth: torch.Tensor) -> float:
    """How many times further from the float64 result the compiled fp32 tensor is than the eager fp32 one (each
    distance the largest over the tensor, floored at one fp32 rounding of its largest element). Up to 8: another
    order of summing the same terms; a real error (a missing term, a wrong scale) is orders of magnitude more."""
    floor = torch.finfo(torch.float32).eps * truth.abs().max().item()
    eager_error = max((want.double() - truth).abs().max().item(), floor)
    return (have.double() - truth).abs().max().item() / eager_error if floor > 0 else 0.0


def _run_middle_stage(stage, received, conditions):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in received]
    out = stage(*inputs, **conditions)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    grads = {n: p.grad.clone() for n, p in stage.full_named_parameters() if p.grad is not None}
    return outs, [t.grad for t in inputs], grads


@pytest.mark.parametrize("compiled", [True, "blocks"], ids=["whole-stage", "repeated-blocks"])
def test_compiled_checkpointed_stage_matches_eager(compiled):
    torch._dynamo.reset()
    torch.manual_seed(0)
    backbone = _backbone(UNet2DConditionModel(**SDXL_STYLE).train())
    starts = [6, 12]
    eager_stages = build_stage_modules(backbone, stage_specs(backbone, starts))
    sample, conditions = _inputs(SDXL_STYLE)
    with torch.no_grad():  # what the first stage sends: the middle stage's inputs
        first = eager_stages[0](sample, **conditions)
    received = first if isinstance(first, tuple) else (first,)

    compiled_backbone = _backbone(copy.deepcopy(backbone.model))
    compiled_stage = build_stage_modules(compiled_backbone, stage_specs(compiled_backbone, starts),
                                         checkpointed=frozenset({1}), compiled=compiled)[1]
    expected = _run_middle_stage(eager_stages[1], received, conditions)
    torch._dynamo.utils.counters.clear()
    got = _run_middle_stage(compiled_stage, received, conditions)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile

    # the exact answer: the eager stage in float64. Compiled kernels fuse and reorder sums, so the compiled fp32
    # result is another rounding of the same computation: it must be about as close to float64 as eager fp32 is
    exact = _run_middle_stage(copy.deepcopy(eager_stages[1]).double(), [t.double() if t.is_floating_point() else t
                                                                         for t in received],
                              {k: v.double() for k, v in conditions.items()})
    worst = {}
    assert len(got[1]) == len(expected[1]) and all(g is not None for g in got[1])
    assert got[2].keys() == expected[2].keys() and len(got[2]) > 10
    pairs = [(f"output {i}", i, 0) for i in range(len(expected[0]))] + \
            [(f"input gradient {i}", i, 1) for i in range(len(expected[1]))] + [(n, n, 2) for n in expected[2]]
    for name, key, part in pairs:
        want, have, truth = expected[part][key], got[part][key], exact[part][key]
        worst[name] = _rounding_ratio(have, want, truth)
    print({k: round(v, 2) for k, v in sorted(worst.items(), key=lambda kv: -kv[1])[:5]})
    assert max(worst.values()) <= ROUNDING_RATIO, max(worst.items(), key=lambda kv: kv[1])
    # and the compiled stage chains with the others like the eager one (sampling runs stages in order)
    with torch.no_grad():
        chained = run_stages([eager_stages[0], compiled_stage, eager_stages[2]], sample, conditions)
        torch.testing.assert_close(chained, run_stages(eager_stages, sample, conditions), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compiled", [True, "blocks"], ids=["whole-stage", "repeated-blocks"])
def test_passes_without_gradients_run_eager(compiled):
    """Samples, and torch 2.11's shape inference of a pipeline stage, would otherwise compile a second graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    backbone = _backbone(UNet2DConditionModel(**SDXL_STYLE).train())
    eager = build_stage_modules(backbone, stage_specs(backbone, [6]))[0]
    stage = build_stage_modules(backbone, stage_specs(backbone, [6]), compiled=compiled)[0]
    sample, conditions = _inputs(SDXL_STYLE)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        got, want = stage(sample, **conditions), eager(sample, **conditions)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_every_bucket_runs_compiled_past_dynamos_eight_shapes():
    """Aspect-ratio buckets give a compiled stage (and each class of compiled block) a graph per shape, and dynamo
    keeps 8 per code object by default: each of 9 buckets must still run compiled (none falls back to eager)."""
    torch._dynamo.reset()
    backbone = _backbone(UNet2DConditionModel(**SDXL_STYLE).train())
    stage = build_stage_modules(backbone, stage_specs(backbone, [2]), compiled=True)[0]  # time embedding, conv_in
    torch._dynamo.utils.counters.clear()
    for side in range(16, 16 + 9 * 4, 4):
        sample, conditions = _inputs(SDXL_STYLE, batch=1, size=(side, 16))
        sum(t.square().mean() for t in stage(sample.requires_grad_(), **conditions)).backward()
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["total"] == frames["ok"], dict(frames)  # a frame past the limit is counted, not compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 9


def test_the_header_says_how_many_graphs_the_buckets_compile_and_warns_past_the_limit():
    """Issue 54: recompiles bounded and said in the run's header: a graph per bucket shape (and text length, where
    the family cuts each batch's text), and a warning where that passes dynamo's limit (the rest would run eager)."""
    from diffpipe.pipeline.stage import _COMPILED_SHAPES, compiled_shapes_words

    words = compiled_shapes_words("blocks", 3, 5)
    assert "each repeated block class compiles once per input shape" in words
    assert "3 bucket shape(s) x up to 5 text lengths, at most 15 graph(s)" in words and "warning" not in words
    assert "each stage" in compiled_shapes_words(True, 1) and "text lengths" not in compiled_shapes_words(True, 1)
    assert "warning: past the limit" in compiled_shapes_words("blocks", _COMPILED_SHAPES + 1)
    assert "warning" not in compiled_shapes_words("blocks", _COMPILED_SHAPES)

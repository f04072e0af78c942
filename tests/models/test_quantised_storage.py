"""memory.base_dtype = "int8" / "nf4" (the backward test: fp8 too): a frozen linear layer's weight quantised through
bitsandbytes (or stored in fp8) computes within the format's rounding of the original, its backward is the gradient of the weight it holds and keeps the stored
weight (not a bf16 copy), and the rest of the model sees an ordinary Linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffpipe.models.quantised import NF4_BLOCK, NF4_HALF_GAP, Int8Linear, Nf4Linear, nf4_dequantise
from diffpipe.models.storage import FrozenStorage


def _frozen_linear(seed: int = 0, rows: int = 48, columns: int = 96) -> tuple[nn.Linear, nn.Linear]:
    """A layer (rows not a multiple of 64 long) whose rows differ in size by 10^4 (a zero row among them), and its
    fp32 twin."""
    torch.manual_seed(seed)
    layer = nn.Linear(columns, rows)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-2, 2, rows).unsqueeze(1))
        layer.weight[7] = 0
    twin = nn.Linear(columns, rows)
    twin.load_state_dict(layer.state_dict())
    return layer.requires_grad_(False), twin.requires_grad_(False)


def _block_scales(layer: Nf4Linear) -> torch.Tensor:
    """Each weight's block scale, in the weight's shape (blocks of 64 in row-major order)."""
    shape = (layer.out_features, layer.in_features)
    return layer.weight_scales.repeat_interleave(NF4_BLOCK)[:shape[0] * shape[1]].view(shape)


def _per_weight_bound(layer) -> torch.Tensor:
    """How far each stored weight may be from its original: half a step of the format."""
    if isinstance(layer, Int8Linear):
        return 0.5 * layer.weight_scale.expand(layer.out_features, layer.in_features) * (1 + 1e-6)
    return NF4_HALF_GAP * _block_scales(layer)


def _within(y: torch.Tensor, reference: torch.Tensor, x: torch.Tensor, per_weight: torch.Tensor,
            weight: torch.Tensor) -> bool:
    bound = x.abs() @ per_weight.T + 1e-5 * (x.abs() @ weight.abs().T)  # plus fp32 summation noise
    return bool(((y - reference).abs() <= bound).all())


@pytest.mark.parametrize("format", ["int8", "nf4"])
def test_a_quantised_layer_computes_within_its_formats_rounding_and_a_wrong_scale_is_caught(format):
    layer, twin = _frozen_linear()
    FrozenStorage(torch.float32, format).store(layer)
    assert isinstance(layer, Int8Linear if format == "int8" else Nf4Linear)
    assert layer.weight.dtype == (torch.int8 if format == "int8" else torch.uint8)
    per_weight = _per_weight_bound(layer)
    error = (layer.dequantised() - twin.weight).abs()
    assert (error <= per_weight).all()
    assert (error / per_weight)[per_weight > 0].max() > 0.5  # it rounds (to the nearest step)
    x = torch.randn(16, 96)
    reference = F.linear(x, twin.weight)
    assert _within(layer(x) - layer.bias, reference, x, per_weight, twin.weight)
    # planted: the weights turned back with another scale (every row's doubled; NF4: each block its neighbour's)
    if format == "int8":
        wrong = layer.weight.float() * layer.weight_scale * 2
    else:
        wrong = nf4_dequantise(layer.weight, layer.weight_scales.roll(1), twin.weight.shape, torch.float32)
    assert not _within(F.linear(x, wrong), reference, x, per_weight, twin.weight)


def test_nf4_weights_turn_back_right_where_rows_are_not_a_multiple_of_64_long():
    """Blocks of 64 run across rows of 96 here. bitsandbytes 0.50.2's CPU dequantize_4bit, given the weight's 2-D
    shape, read blocks per row on the development machine (weights scaled by the wrong blocks' scales) but not on
    the GPU machine's CPU: the layer hands it one flat row, read the same way everywhere."""
    for seed, columns in ((1, 96), (2, 80), (3, 33)):
        layer, twin = _frozen_linear(seed, rows=9, columns=columns)
        FrozenStorage(torch.float32, "nf4").store(layer)
        error = (layer.dequantised() - twin.weight).abs()
        assert (error <= _per_weight_bound(layer)).all()


@pytest.mark.parametrize("format,stored", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8), ("nf4", torch.uint8)])
def test_the_backward_is_the_held_weights_and_keeps_the_stored_weight_not_a_copy(format, stored):
    layer, _ = _frozen_linear(2)
    FrozenStorage(torch.bfloat16, format).store(layer)
    assert layer.bias.dtype == torch.bfloat16
    x = torch.randn(4, 8, 96, requires_grad=True)
    plain = x.detach().clone().requires_grad_(True)
    layer(x).square().sum().backward()
    F.linear(plain, layer.dequantised(), layer.bias.float()).square().sum().backward()
    assert torch.allclose(x.grad, plain.grad, rtol=1e-5, atol=1e-5 * plain.grad.abs().max().item())

    def kept_by_backward(step) -> list[torch.Tensor]:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                step(torch.randn(4, 96, requires_grad=True))
        return [t for t in kept if t.numel() in (layer.weight.numel(), 48 * 96)]  # as saved: maybe transposed

    assert [t.dtype for t in kept_by_backward(layer)] == [stored]
    # planted: the product of the turned-back weight, which keeps a bf16 copy of the whole weight per micro-batch
    assert [t.dtype for t in kept_by_backward(lambda x: F.linear(x, layer.dequantised(torch.bfloat16)))] == [
        torch.bfloat16]


@pytest.mark.parametrize("format", ["int8", "nf4"])
def test_a_quantised_layer_is_a_linear_to_its_holders_and_refuses_a_state_dict_load(format):
    layer, twin = _frozen_linear(3)
    holder = nn.Sequential(layer)
    FrozenStorage(torch.float32, format).store(layer)
    assert holder[0] is layer and isinstance(layer, nn.Linear)
    state = holder.state_dict()
    assert list(state) == ["0.weight", "0.bias"] and state["0.weight"].dtype == torch.float32
    assert state["0.weight"].shape == twin.weight.shape and torch.equal(state["0.weight"], layer.dequantised())
    with pytest.raises(RuntimeError, match=f"held in {format}"):
        layer.load_state_dict(twin.state_dict())

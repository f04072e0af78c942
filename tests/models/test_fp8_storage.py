"""memory.base_dtype = "fp8": a frozen linear layer's weight stored in fp8 with a scale per output row computes
within fp8's rounding of the original, its backward is the gradient of the weight it holds and keeps the fp8 weight (not a
bf16 copy), and the rest of the model sees an ordinary Linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffpipe.models.storage import FrozenStorage
from diffpipe.models.stored_linear import Fp8Linear, dequantise, quantise


def _frozen_linear(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    """A layer whose rows differ in size by 10^6 (a zero row among them), and its fp32 twin."""
    torch.manual_seed(seed)
    layer = nn.Linear(96, 48)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-4, 2, 48).unsqueeze(1))
        layer.weight[7] = 0
    twin = nn.Linear(96, 48)
    twin.load_state_dict(layer.state_dict())
    return layer.requires_grad_(False), twin.requires_grad_(False)


def _rounding_bound(weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y - y_fp32| at most: each weight within 2^-4 of itself (e4m3's 3 mantissa bits), or within 2^-10 of its
    row's scale where it is subnormal in fp8, plus fp32 summation noise."""
    per_weight = 2.0 ** -4 * weight.abs() + 2.0 ** -10 * scale
    return x.abs() @ per_weight.T + 1e-5 * (x.abs() @ weight.abs().T)


def _within_bound(y: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor) -> bool:
    return bool(((y - reference).abs() <= bound).all())


def test_an_fp8_layer_computes_within_fp8_rounding_of_the_original_and_a_dropped_scale_is_caught():
    layer, twin = _frozen_linear()
    FrozenStorage(torch.float32, linear="fp8").store(layer)
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(16, 96)
    reference = F.linear(x, twin.weight)
    bound = _rounding_bound(twin.weight, layer.weight_scale, x)
    assert _within_bound(layer(x) - layer.bias, reference, bound)
    assert (layer(x) - layer.bias - reference).abs().max() > 0  # it does round
    # each weight rounded to nearest: within 2^-4 of itself, and no bias (a scale 1 % off would be one)
    normal = twin.weight.abs() >= 2.0 ** -6 * layer.weight_scale
    relative = ((layer.dequantised() - twin.weight) / twin.weight)[normal]
    assert relative.abs().max() <= 2.0 ** -4 and abs(relative.mean()) < 2e-3
    # planted: the scale dropped, or applied twice
    assert not _within_bound(F.linear(x, layer.weight.float()), reference, bound)
    assert not _within_bound(F.linear(x, dequantise(layer.weight, layer.weight_scale ** 2, torch.float32)), reference,
                             bound)


def test_quantising_uses_each_rows_whole_range_and_never_makes_nan():
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-30, 3e38, -3e38]])
    stored, scale = quantise(weight)
    assert stored.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    assert scale[1].item() == 1.0 and torch.isfinite(dequantise(stored, scale, torch.float32)).all()


def test_an_fp8_layer_is_a_linear_to_its_holders_and_refuses_a_state_dict_load():
    layer, twin = _frozen_linear(2)
    holder = nn.Sequential(layer)
    FrozenStorage(torch.float32, linear="fp8").store(layer)
    assert holder[0] is layer and isinstance(layer, nn.Linear)
    state = holder.state_dict()  # as a Linear's: the weight held, in fp32; the scale is no entry of its own
    assert list(state) == ["0.weight", "0.bias"] and state["0.weight"].dtype == torch.float32
    assert torch.equal(state["0.weight"], layer.dequantised())
    with pytest.raises(RuntimeError, match="held in fp8"):
        layer.load_state_dict(twin.state_dict())


def test_trained_layers_and_other_layers_are_not_stored_in_fp8():
    trained = nn.Linear(8, 8)
    conv = nn.Conv2d(4, 4, 3).requires_grad_(False)
    storage = FrozenStorage(torch.bfloat16, linear="fp8")
    storage.store(trained)
    storage.store(conv)
    assert type(trained) is nn.Linear and trained.weight.dtype == torch.float32
    assert type(conv) is nn.Conv2d and conv.weight.dtype == torch.bfloat16

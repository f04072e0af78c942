"""How frozen weights are held in memory (memory.base_dtype): as they came, in bf16, or the linear layers' weights
in fp8 with a scale per output row.

fp8 ("e4m3": 4 exponent bits, 3 mantissa bits, largest value 448) halves a bf16 base again: Flux.1-dev's 11.9 B
weights, almost all in linear layers, take 11 GiB instead of 22. It is storage only, as kohya's `fp8_base` and
musubi-tuner's `fp8_scaled`: each layer's weight is turned back into the compute dtype (bf16 under autocast) when
the layer runs, and the matrix product runs in that dtype. Each output row r of a weight W is stored as
q[r] = fp8(W[r] / s[r]) with s[r] = max|W[r]| / 448, so every row uses the whole fp8 range; a weight's relative
error is at most 2^-4 (half of fp8's mantissa step; tiny values, below 2^-6 s[r], lose more, absolutely at most
2^-10 s[r]). This changes the model: train and compare (docs/benchmarks.md gives the loss difference measured).

The layer keeps its class's identity to the outside: an `Fp8Linear` is an `nn.Linear` (peft wraps it as one), its
parameter names are a Linear's, and its state dict holds the weight as a Linear's would (in fp32, the stored fp8 value
times its scale), so saving, merging and exporting see an ordinary layer. Its backward keeps the fp8 weight, not the
bf16 copy the product used (which for Flux would be 22 GiB per micro-batch in flight), and makes the copy again.
Convolutions, norms, embeddings and biases stay in the dtype of the rest of the base.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FrozenStorage", "Fp8Linear", "FP8", "FP8_MAX", "quantise", "dequantise", "fp8_storable", "PRODUCT_LAYERS"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


# layers whose weights enter a matrix product or convolution: autocast computes them in bf16/fp16
PRODUCT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def fp8_storable(module: nn.Module) -> bool:
    """A plain linear layer with every weight frozen: memory.base_dtype = "fp8" stores its weight in fp8."""
    return type(module) is nn.Linear and not any(p.requires_grad for p in module.parameters(recurse=False))


def quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per output row) of a 2-D weight; a row of zeros gets scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale  # clamped: fp8 has no infinity, 449 would be NaN


def dequantise(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` (the product in that dtype: one kernel over the weight, no fp32 copy)."""
    return stored.to(dtype) * scale.to(dtype)  # fp8 values are exact in bf16 and fp32


class _Fp8Product(torch.autograd.Function):
    """x @ (q s).T + b for a frozen weight q s: the product with q alone (an fp8 value is exact in bf16), then each
    output column times its row's scale, so the weight is converted once and never multiplied (one pass over it
    fewer, in forward and in backward); saves the fp8 weight for backward, not a converted copy."""

    @staticmethod
    def forward(ctx, x, stored, scale, bias):
        ctx.save_for_backward(stored, scale)
        y = F.linear(x, stored.to(x.dtype)) * scale.view(-1).to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        stored, scale = ctx.saved_tensors
        return (grad * scale.view(-1).to(grad.dtype)).matmul(stored.to(grad.dtype)), None, None, None


class Fp8Linear(nn.Linear):
    """A frozen linear layer whose weight is stored in fp8 with a scale per output row (`weight_scale`)."""

    @classmethod
    def store(cls, linear: nn.Linear) -> "Fp8Linear":
        """Turn `linear` (frozen, weights real) into an Fp8Linear in place: the same object, so every holder of it
        (a unit, peft's LoRA layer) sees the change; the same way torch's FSDP2 gives a module its wrapped class."""
        stored, scale = quantise(linear.weight)
        linear.weight.data = stored
        linear.register_buffer("weight_scale", scale.to(stored.device), persistent=False)
        linear.__class__ = cls
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        return _Fp8Product.apply(x.to(dtype), self.weight, self.weight_scale, self.bias)

    def dequantised(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantise(self.weight, self.weight_scale, dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dequantised().detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "weight" in state_dict:  # a Linear's would copy fp32 values into the fp8 weight, unscaled
            raise RuntimeError(f"{prefix}weight is held in fp8 (memory.base_dtype); its weights are given when the "
                               "model is built and cannot be loaded into it")
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weight in fp8 (e4m3) with a scale per output row"


@dataclass(frozen=True)
class FrozenStorage:
    """How a run holds its frozen weights: `dtype` for all of them, except frozen linear layers' weights in fp8
    when `linear_fp8`. Trained weights are fp32 whatever this says."""

    dtype: torch.dtype = torch.float32
    linear_fp8: bool = False

    @property
    def name(self) -> str:
        """memory.base_dtype's word for it."""
        if self.linear_fp8:
            return "fp8"
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]

    def store(self, module: nn.Module) -> None:
        """Hold `module`'s own frozen weights (just given, real) this way."""
        frozen = [p for p in module.parameters(recurse=False)
                  if not p.requires_grad and p.is_floating_point() and not p.is_meta]
        for parameter in frozen:
            if parameter.dtype != self.dtype and parameter.dtype != FP8:
                parameter.data = parameter.data.to(self.dtype)
        if self.linear_fp8 and fp8_storable(module) and frozen:
            Fp8Linear.store(module)

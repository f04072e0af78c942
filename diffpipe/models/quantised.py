"""Frozen linear weights quantised through bitsandbytes (memory.base_dtype = "int8" or "nf4"), for LoRA bases on
cards too small for fp8's byte a weight.

- int8: each output row r of a weight W stored as q[r] = round(127 W[r] / max|W[r]|), LLM.int8's vector-wise
  format (bitsandbytes' `int8_vectorwise_quant`, the CB/SCB pair its Linear8bitLt holds). Each weight is within half
  a step, max|W[r]| / 254, of itself: finer than fp8 for a row's large weights, coarser for its small ones.
- nf4: 4-bit NormalFloat (QLoRA's format; bitsandbytes' `quantize_4bit` / `dequantize_4bit`): the weight cut into
  blocks of 64 in row-major order, each block's values divided by its largest magnitude and rounded to the nearest
  of 16 levels placed for normally distributed weights; 0.5625 bytes a weight with the fp32 scale per block. Each
  weight is within half the widest gap between levels (0.152) times its block's scale of itself.

Both compute weight-only, as fp8 does: the stored weight is turned back into the compute dtype (bf16 under
autocast) when the layer runs, the matrix product runs in that dtype, and backward keeps the stored weight, not the
copy. Activations are never quantised (bitsandbytes' own int8 product, `Linear8bitLt`, quantises them too: a
larger change to the model, and its int8 kernels train slower than a bf16 product on GPUs with fast bf16). Why
bitsandbytes, not torchao or optimum-quanto: it is already a dependency (8-bit AdamW, train/optim.py), its wheels
work with any torch of ours (torchao's releases each pin one torch), its NF4 format is the one QLoRA and peft use,
and its 4-bit dequantisation is a CUDA kernel.

bitsandbytes' CPU kernel for dequantize_4bit reads blocks per row and mis-scales weights whose rows are not a
multiple of 64 long (bitsandbytes 0.50.2; its CUDA kernel and its quantize_4bit use blocks across the flattened
weight). The weight is therefore quantised and turned back as one flat row: the same format, read correctly on both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .stored_linear import ScaledProduct, StoredLinear, compute_dtype

__all__ = ["Int8Linear", "Nf4Linear", "NF4_BLOCK", "NF4_HALF_GAP", "nf4_quantise", "nf4_dequantise"]

NF4_BLOCK = 64
NF4_HALF_GAP = 0.152  # half the widest gap between NF4's levels (-1 and -0.6962), in units of the block's scale


def _bnb_functional():
    import bitsandbytes.functional as bnb_functional

    return bnb_functional


class Int8Linear(StoredLinear):
    """A frozen linear layer whose weight is stored in int8 with a scale per output row (`weight_scale`, the row's
    largest magnitude over 127)."""

    format = "int8"

    @staticmethod
    def _hold(linear: nn.Linear) -> None:
        stored, row_max, _ = _bnb_functional().int8_vectorwise_quant(linear.weight.detach())
        linear.weight.data = stored
        scale = (row_max.float() / 127).unsqueeze(1)
        linear.register_buffer("weight_scale", torch.where(scale > 0, scale, torch.ones_like(scale)),
                               persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledProduct.apply(x.to(compute_dtype(x)), self.weight, self.weight_scale, self.bias)

    def dequantised(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # where the weight is (a swapped unit's: in host memory, its scale on the device); int8 is exact in bf16
        return self.weight.to(dtype) * self.weight_scale.to(self.weight.device, dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weight in int8 with a scale per output row"


def nf4_quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed NF4 codes, fp32 scale per block of 64) of a weight, as bitsandbytes makes them."""
    packed, state = _bnb_functional().quantize_4bit(weight.detach().reshape(1, -1), blocksize=NF4_BLOCK,
                                                      quant_type="nf4", compress_statistics=False)
    return packed, state.absmax.float()


def nf4_dequantise(packed: torch.Tensor, scales: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The weight of `shape` in `dtype`, turned back by bitsandbytes from its flat blocks."""
    bnb_functional = _bnb_functional()
    state = bnb_functional.QuantState(absmax=scales, shape=torch.Size((1, shape.numel())), blocksize=NF4_BLOCK,
                                      quant_type="nf4", dtype=dtype,
                                      code=bnb_functional.get_4bit_type("nf4", device=packed.device))
    return bnb_functional.dequantize_4bit(packed, state).view(shape)


class _Nf4Product(torch.autograd.Function):
    """x @ W.T + b for a frozen NF4 weight W: turned back in the compute dtype for the product, again for backward;
    saves the packed codes, not the copy."""

    @staticmethod
    def forward(ctx, x, packed, scales, bias, shape):
        ctx.save_for_backward(packed, scales)
        ctx.shape = shape
        return F.linear(x, nf4_dequantise(packed, scales, shape, x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        packed, scales = ctx.saved_tensors
        return grad.matmul(nf4_dequantise(packed, scales, ctx.shape, grad.dtype)), None, None, None, None


class Nf4Linear(StoredLinear):
    """A frozen linear layer whose weight is stored as packed NF4 codes (uint8, two a byte) with an fp32 scale per
    block of 64 (`weight_scales`)."""

    format = "nf4"

    @staticmethod
    def _hold(linear: nn.Linear) -> None:
        packed, scales = nf4_quantise(linear.weight)
        linear.weight.data = packed
        linear.register_buffer("weight_scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Nf4Product.apply(x.to(compute_dtype(x)), self.weight, self.weight_scales, self.bias, self._shape)

    @property
    def _shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def dequantised(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return nf4_dequantise(self.weight, self.weight_scales.to(self.weight.device), self._shape, dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", weight in NF4 with a scale per block of {NF4_BLOCK}"

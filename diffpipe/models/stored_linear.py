"""Frozen linear layers that hold their weight in another format than they compute in: the base class
(`StoredLinear`) and fp8 (`Fp8Linear`); int8 and nf4 are models/quantised.py's. models/storage.py decides which a run
uses.

fp8 ("e4m3": 4 exponent bits, 3 mantissa bits, largest value 448) halves a bf16 base again: Flux.1-dev's 11.9 B
weights, almost all in linear layers, take 11 GiB instead of 22. It is storage only, as kohya's `fp8_base` and
musubi-tuner's `fp8_scaled`: each layer's weight is turned back into the compute dtype (bf16 under autocast) when
the layer runs, and the matrix product runs in that dtype. Each output row r of a weight W is stored as
q[r] = fp8(W[r] / s[r]) with s[r] = max|W[r]| / 448, so every row uses the whole fp8 range; a weight's relative
error is at most 2^-4 (half of fp8's mantissa step; tiny values, below 2^-6 s[r], lose more, absolutely at most
2^-10 s[r]). This changes the model: train and compare (docs/benchmarks.md gives the loss difference measured).

Every such layer keeps its class's identity to the outside (`StoredLinear`): it is an `nn.Linear` (peft wraps it as
one), its parameter names are a Linear's, and its state dict holds the weight as a Linear's would (in fp32, the stored
value turned back), so saving, merging and exporting see an ordinary layer. Its backward keeps the stored weight, not
the bf16 copy the product used (which for Flux would be 22 GiB per micro-batch in flight), and makes the copy again.
Convolutions, norms, embeddings and biases stay in the dtype of the rest of the base.

With train.fp8_compute the fp8 weight is not turned back: the layer's forward and input-gradient products run on
fp8 tensor cores (`Fp8Product`), the activation quantised per row (token) as it enters, the gradient per row as it
comes back, in what a compiled block fuses into one pass ahead of each product. That changes the arithmetic once
more (each operand within 2^-4): measured in docs/benchmarks.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_support import scaled_matmul

__all__ = ["StoredLinear", "Fp8Linear", "ScaledProduct", "FP8", "FP8_MAX", "quantise", "dequantise", "compute_dtype",
           "Fp8Product", "fp8_computable", "fp8_forward"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per output row) of a 2-D weight; a row of zeros gets scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale  # clamped: fp8 has no infinity, 449 would be NaN


def dequantise(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` (the product in that dtype: one kernel over the weight, no fp32 copy), where the stored
    weight is: a swapped unit's lies in host memory while its scale is on the device (pipeline/block_swap.py)."""
    return stored.to(dtype) * scale.to(stored.device, dtype)  # fp8 values are exact in bf16 and fp32


class ScaledProduct(torch.autograd.Function):
    """x @ (q s).T + b for a frozen weight q (fp8 or int8) with a scale s per row: the product with q alone (fp8
    and int8 values are exact in bf16), then each output column times its row's scale, so the weight is converted
    once and never multiplied (one pass over it fewer, in forward and in backward); saves the stored weight for
    backward, not a converted copy."""

    @staticmethod
    def forward(ctx, x, stored, scale, bias):
        ctx.save_for_backward(stored, scale)
        y = F.linear(x, stored.to(x.dtype)) * scale.view(-1).to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        stored, scale = ctx.saved_tensors
        return (grad * scale.view(-1).to(grad.dtype)).matmul(stored.to(grad.dtype)), None, None, None


def fp8_forward(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x @ (q s).T in `dtype` on fp8 tensor cores: x quantised per row (token) as it enters, the fp8 weight q with its
    scale per output row (`Fp8Product`'s forward, without the bias)."""
    x8, x_scale = quantise(x.reshape(-1, x.shape[-1]))
    return scaled_matmul(x8, stored.t(), x_scale, scale.view(1, -1), dtype).view(*x.shape[:-1], stored.shape[0])


class Fp8Product(torch.autograd.Function):
    """x @ (q s).T + b with both products on fp8 tensor cores, for a frozen weight q in fp8 with a scale s per output
    row (torch_support.scaled_matmul: a scale per row of the left operand, per column of the right):
    - forward: x quantised per row (xq, sx): y = (xq sx) @ (q s).T, in `dtype` (bf16);
    - input gradient: dx = g @ (q s) = (g s) @ q: the gradient times each output's scale, quantised per row, times q
      (a column-major copy of it: the product's right operand must be), each column of q scaled by 1.
    Saves the stored weight for backward, nothing of x (the frozen weight needs no gradient)."""

    @staticmethod
    def forward(ctx, x, stored, scale, bias, dtype):
        ctx.save_for_backward(stored, scale)
        y = fp8_forward(x, stored, scale, dtype)
        return y if bias is None else y + bias.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        stored, scale = ctx.saved_tensors
        g8, g_scale = quantise(grad.reshape(-1, grad.shape[-1]).float() * scale.view(1, -1))
        columns = torch.ones(1, stored.shape[1], device=stored.device)
        dx = scaled_matmul(g8, stored.t().contiguous().t(), g_scale, columns, grad.dtype)
        return dx.view(*grad.shape[:-1], stored.shape[1]), None, None, None, None


def fp8_computable(linear: nn.Linear) -> bool:
    """Whether fp8 tensor cores take this layer's products: both sides multiples of 16 (the kernels' tiles)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def fp8_share_words(fp8: list[nn.Linear], among: list[nn.Linear], kind: str) -> str:
    """'N of M {kind} linear layers (x% of their weights)': those of `among` that fp8 tensor cores take (`fp8`), for
    a run's header."""
    weights = sum(m.weight.numel() for m in among)
    share = sum(m.weight.numel() for m in fp8) / weights if weights else 0.0
    return f"{len(fp8)} of {len(among)} {kind} linear layers ({share:.1%} of their weights)"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product on `x` runs in: autocast's where it is on, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class StoredLinear(nn.Linear):
    """A frozen linear layer whose `weight` holds another format (a subclass says which); made from a Linear in place
    (`store`): the same object, so every holder of it (a unit, peft's LoRA layer) sees the change, the same way
    torch's FSDP2 gives a module its wrapped class. Its state dict gives the weight as a Linear's, in fp32."""

    format = ""  # memory.base_dtype's word

    @classmethod
    def store(cls, linear: nn.Linear, work_device: torch.device | None = None) -> "StoredLinear":
        """Turn `linear` (frozen, weights real) into this class in place, quantising on `work_device` when given
        (the run's GPU: bitsandbytes' CPU NF4 quantiser took over two minutes for a 12 B base); it stays where it was."""
        home = linear.weight.device
        if work_device is not None and torch.device(work_device) != home:
            cls._hold(linear.to(work_device))
            linear.to(home)
        else:
            cls._hold(linear)
        linear.__class__ = cls
        return linear

    @staticmethod
    def _hold(linear: nn.Linear) -> None:
        """Replace linear.weight's data by the stored format and register what turns it back (buffers)."""
        raise NotImplementedError

    def dequantised(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dequantised().detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "weight" in state_dict:  # a Linear's would copy fp32 values into the stored weight, unconverted
            raise RuntimeError(f"{prefix}weight is held in {self.format} (memory.base_dtype); its weights are given "
                               "when the model is built and cannot be loaded into it")
        super()._load_from_state_dict(state_dict, prefix, *args)


class Fp8Linear(StoredLinear):
    """A frozen linear layer whose weight is stored in fp8 with a scale per output row (`weight_scale`)."""

    format = "fp8"
    fp8_compute = False  # set per layer by `compute_in_fp8`: its products on fp8 tensor cores

    @staticmethod
    def _hold(linear: nn.Linear) -> None:
        stored, scale = quantise(linear.weight)
        linear.weight.data = stored
        linear.register_buffer("weight_scale", scale.to(stored.device), persistent=False)

    def compute_in_fp8(self) -> None:
        """Run this layer's products on fp8 tensor cores from now on, where its sides allow (`fp8_computable`)."""
        self.fp8_compute = fp8_computable(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        if self.fp8_compute:
            return Fp8Product.apply(x, self.weight, self.weight_scale, self.bias, dtype)
        return ScaledProduct.apply(x.to(dtype), self.weight, self.weight_scale, self.bias)

    def dequantised(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantise(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return (super().extra_repr() + ", weight in fp8 (e4m3) with a scale per output row"
                + (", computed in fp8" if self.fp8_compute else ""))

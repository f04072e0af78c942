"""How frozen weights are held in memory (memory.base_dtype): as they came, in bf16, or the linear layers' weights
in fp8 with a scale per output row, in int8 or in 4-bit NF4 (models/quantised.py, through bitsandbytes).

The layers that hold a weight in another format are models/stored_linear.py's (fp8) and models/quantised.py's
(int8, nf4); this module says which a run uses and what each costs (bytes a weight, time to turn it back).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .stored_linear import Fp8Linear, StoredLinear, fp8_computable, fp8_share_words

__all__ = ["FrozenStorage", "quantisable", "PRODUCT_LAYERS", "LINEAR_FORMATS", "DEQUANTISE_FLOPS", "linear_class",
           "element_bytes", "fp8_compute_words", "fp8_layers"]

# layers whose weights enter a matrix product or convolution: autocast computes them in bf16/fp16
PRODUCT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


# memory.base_dtype's formats for frozen linear weights -> bytes a weight takes (its scales included: an fp32 scale
# per row of thousands for fp8 and int8, counted as nothing; NF4's fp32 scale per block of 64: 4/64 of a byte)
LINEAR_FORMATS = {"fp8": 1.0, "int8": 1.0, "nf4": 0.5 + 4 / 64}
# -> the time a pass (a forward, a backward, a recomputation) spends turning one stored weight back into the compute
# dtype, in FLOPs of the device's matrix work (so it scales with plan.device_tflops). Measured on an H200 (taken at
# the planner's 300 TFLOP/s) with Flux.1-dev's LoRA, 11.8 B frozen linear weights (docs/benchmarks.md): fp8 against
# a bf16 base 1.42 against 1.72 samples/s uncheckpointed (2 passes), 5.2 ps a weight a pass; int8 as fp8 (0.956
# against 0.950 checkpointed); nf4 against fp8 0.782 against 0.950 checkpointed (3 passes), 6.4 ps more
DEQUANTISE_FLOPS = {"fp8": 1560.0, "int8": 1560.0, "nf4": 3480.0}
# train.fp8_compute: how many times faster a frozen linear layer's products (forward, input gradient) run in fp8 than
# the same products in bf16, quantising the activation and the gradient included, compiled (pipeline.compile) or
# eager. Measured on an H200 with Flux.1-dev's LoRA r16 at 1024^2, one stage (docs/benchmarks.md, thirty-third
# session): compiled blocks 0.3768 s a step against the bf16 base's 0.414 s, the 118 TFLOP of those products a step
# at the 394 TFLOP/s the planner's count of that step gives: 1.14x. Eager is not measured on a whole model yet: its
# separate quantisation kernels cost about what the fp8 product saves (bench/fp8_matmul.py: 0.53-1.18x bf16 per
# product, thirty-second session), so it is counted as no faster
FP8_PRODUCT_SPEEDUP = {"compiled": 1.14, "eager": 1.0}


def quantisable(module: nn.Module) -> bool:
    """A plain linear layer with every weight frozen: memory.base_dtype = "fp8", "int8" or "nf4" stores its
    weight so."""
    return type(module) is nn.Linear and not any(p.requires_grad for p in module.parameters(recurse=False))


@dataclass(frozen=True)
class FrozenStorage:
    """How a run holds its frozen weights: `dtype` for all of them, except frozen linear layers' weights when
    `linear` names a format of LINEAR_FORMATS. Trained weights are fp32 whatever this says."""

    dtype: torch.dtype = torch.float32
    linear: str | None = None
    fp8_compute: bool = False  # train.fp8_compute: fp8 linear layers compute on fp8 tensor cores
    fp8_speedup: float = 1.0  # and how much faster than bf16 (FP8_PRODUCT_SPEEDUP)
    quantise_on: torch.device | None = field(default=None, compare=False)  # where linear weights are quantised

    @property
    def name(self) -> str:
        """memory.base_dtype's word for it."""
        return self.linear or {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]

    def linear_bytes(self, weights: int) -> float:
        """Bytes that many frozen linear weights take as held."""
        return weights * (LINEAR_FORMATS[self.linear] if self.linear else element_bytes(self.dtype))

    def dequantise_flops(self, weights: int) -> float:
        """The time a pass spends turning that many stored linear weights back into the compute dtype, as FLOPs of
        the device's matrix work (DEQUANTISE_FLOPS); none for weights held as they are computed."""
        return weights * DEQUANTISE_FLOPS[self.linear] if self.linear and not self.fp8_compute else 0.0

    def fp8_saved_flops(self, product_flops: float) -> float:
        """What fp8 compute saves on products of that many FLOPs (a pass's, of layers it computes), as FLOPs of the
        device's bf16 matrix work; none without it."""
        return product_flops * (1 - 1 / self.fp8_speedup) if self.fp8_compute else 0.0

    def store(self, module: nn.Module) -> None:
        """Hold `module`'s own frozen weights (just given, real) this way."""
        frozen = [p for p in module.parameters(recurse=False)
                  if not p.requires_grad and p.is_floating_point() and not p.is_meta]
        if isinstance(module, StoredLinear):
            return
        for parameter in frozen:
            if parameter.dtype != self.dtype:
                parameter.data = parameter.data.to(self.dtype)
        if self.linear and quantisable(module) and frozen:
            stored = linear_class(self.linear).store(module, self.quantise_on)
            if self.fp8_compute:
                stored.compute_in_fp8()


def fp8_layers(model: nn.Module) -> list[nn.Linear]:
    """The frozen linear layers of `model` whose products train.fp8_compute runs on fp8 tensor cores."""
    return [m for m in model.modules() if quantisable(m) and fp8_computable(m)]


def fp8_compute_words(model: nn.Module) -> str:
    """What train.fp8_compute computes in fp8 in `model` (built, on any device): the frozen linear layers whose sides
    the fp8 kernels take, and the share of those layers' weights they hold; for the run's header."""
    layers = [m for m in model.modules() if quantisable(m)]
    fp8 = fp8_layers(model)
    rest = len(layers) - len(fp8)
    return (f"train.fp8_compute: {fp8_share_words(fp8, layers, 'frozen')} compute on fp8 tensor cores" + (f"; the other {rest} (sides not multiples of 16) turn their fp8 weight "
                                             "back first" if rest else ""))


def linear_class(format: str) -> type[StoredLinear]:
    """The StoredLinear class of a format of LINEAR_FORMATS (int8 and nf4 import bitsandbytes only when asked)."""
    if format == "fp8":
        return Fp8Linear
    from .quantised import Int8Linear, Nf4Linear

    return {"int8": Int8Linear, "nf4": Nf4Linear}[format]


def element_bytes(dtype: torch.dtype) -> int:
    """Bytes an element of `dtype` takes (the planner asks millions of times a layout search: no tensor made)."""
    return dtype.itemsize

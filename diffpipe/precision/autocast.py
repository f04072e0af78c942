"""CUDA's autocast, as the planner counts it on the meta device (where torch has no autocast): each op runs in the
dtype autocast would give it on a GPU, so that every tensor saved for backward has the dtype it has in training.

Under bf16 autocast, matrix products and convolutions compute in bf16 from bf16 copies of their inputs, while norms,
softmax, exponentials, powers and interpolation compute in fp32 from fp32 copies; every other op keeps its inputs'
dtype. Which ops go which way is torch's list for CUDA (`torch/csrc/autograd/autocast_mode.cpp`), taken here by the
name of the function or tensor method a model calls (`F.linear`, `x @ w`, `x.softmax`), which is where a model meets
it. Two things the saved bytes depend on are kept as autocast has them: a trained weight's copy is made once per
autocast region (cached) and a frozen one at each use. Both kinds of copy are told apart from activations
(`frozen_copies`, `trained_copies`): a copy is made once per micro-batch whatever its size, and the planner charges
a frozen weight's copies only where the base is stored in fp32.

One kernel choice changes what is saved and is made here as CUDA makes it: `rms_norm` whose input and weight share a
dtype runs torch's fused kernel, which saves the input as it is and the per-row reciprocal root (measured on an H200,
torch 2.11: Wan's and Flux's query and key norms); elsewhere torch composes it of ops that save an fp32 copy.

A composite op whose parts autocast would cast one by one (say, a Python function calling `torch.bmm` on reshaped
inputs) is cast at its outer call here: the same bytes, in a different place.
"""
from __future__ import annotations

import warnings

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CountedAutocast"]

# run in the autocast dtype (CUDA's lower-precision list, by the names models call them by)
_REDUCED = frozenset({
    "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
    "prelu", "matmul", "__matmul__", "__rmatmul__", "mm", "mv", "bmm", "baddbmm", "addmm", "addmv", "addr", "addbmm",
    "einsum", "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "scaled_dot_product_attention"})
# run in fp32 (CUDA's fp32 list and the ops it runs with an fp32 dtype argument)
_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "cosine_similarity", "dist", "cdist",
    "pdist", "renorm", "logsumexp", "interpolate", "upsample", "grid_sample", "softmax", "log_softmax", "cumsum",
    "cumprod", "prod", "sum", "norm", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss", "kl_div",
    "binary_cross_entropy_with_logits"})


class CountedAutocast(TorchFunctionMode):
    """Inside it, ops on meta tensors take the dtypes CUDA's autocast to `dtype` gives them.

    weights: the tensors of the module being counted (parameters); the ids of their casts are recorded in
    `frozen_copies` and `trained_copies`, so a saved-tensor hook can tell them from activations."""

    def __init__(self, dtype: torch.dtype, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.dtype = dtype
        self.frozen = {id(w) for w in weights if not w.requires_grad}
        self.trained = {id(w) for w in weights if w.requires_grad}
        self.frozen_copies: set[int] = set()
        self.trained_copies: set[int] = set()
        self._cached: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._copies: list[torch.Tensor] = []  # every weight's copy held: no later tensor takes its id

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "rms_norm":
            return _rms_norm(func, *args, **kwargs)
        target = self.dtype if name in _REDUCED else torch.float32 if name in _FP32 else None
        if target is None:
            return func(*args, **kwargs)
        return func(*(self._cast(a, target) for a in args), **{k: self._cast(v, target) for k, v in kwargs.items()})

    def _cast(self, value, target: torch.dtype):
        """`value` as autocast hands it to the op: a floating-point tensor in `target`, each of a list's too."""
        if isinstance(value, (list, tuple)):  # einsum's and chain_matmul's operands
            return type(value)(self._cast(v, target) for v in value)
        eligible = isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64
        if not eligible or value.dtype == target:
            return value
        key = (id(value), target)
        if key in self._cached:
            return self._cached[key]
        copy = value.to(target)
        if value.is_leaf and value.requires_grad:  # autocast keeps one copy of a trained weight per region
            self._cached[key] = copy
        kind = (self.frozen_copies if id(value) in self.frozen
                else self.trained_copies if id(value) in self.trained else None)
        if kind is not None:
            kind.add(id(copy))
            self._copies.append(copy)
        return copy


def _rms_norm(func, input, normalized_shape, weight=None, eps=None):
    """torch's rms_norm as CUDA runs it: fused where the weight (if any) has the input's dtype."""
    if weight is not None and weight.dtype != input.dtype:
        with warnings.catch_warnings():  # torch says it cannot fuse: that is what is being counted here
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            return func(input, normalized_shape, weight, eps)
    return _FusedRmsNorm.apply(input, tuple(normalized_shape), weight)


class _FusedRmsNorm(torch.autograd.Function):
    """What CUDA's fused rms_norm saves for backward (its input and an fp32 reciprocal root per row), with outputs
    of the right shape and dtype (meta tensors: nothing is computed)."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight):
        rows = input.shape[:input.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
        rstd = input.new_empty(rows, dtype=torch.float32)
        ctx.save_for_backward(input, rstd, weight)
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx, grad):
        input, _, weight = ctx.saved_tensors
        weight_grad = torch.zeros_like(weight) if weight is not None and ctx.needs_input_grad[2] else None
        return torch.empty_like(input), None, weight_grad

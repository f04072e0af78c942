"""What each unit costs at a given micro-batch: FLOPs, time, parameter and activation memory, output bytes.

Counted mode runs the real units on the meta device (no memory, no compute): FLOPs from
`torch.utils.flop_counter`, activation bytes from the tensors autograd saves for backward, and the backward as
torch's zero-bubble schedules split it, which tells the gradients kept for the weight pass (its FLOPs are within
1 % of a whole backward's on the SDXL UNet: attention's backward counts a little more). On the meta device
torch decomposes attention into matrix products that save the whole (tokens x tokens) probability matrix, which no
fused kernel holds (at 32,760 video tokens that alone is 86 GB per Wan 14B block); attention without a mask is
therefore counted as the fused (memory-efficient) kernel runs it, saving queries, keys, values, output and the
log-sum-exp, with that kernel's FLOPs (its backward recomputes the scores). Under bf16/fp16 training each op runs in
the dtype CUDA's autocast gives it (precision/autocast.py), so saved tensors are counted in their training dtypes, the
copies of trained weights apart (once per micro-batch); and each unit's working memory, what it holds at once beyond
what it keeps, is counted as its tensors live and die (planner/live_bytes.py). A unit alike in every way that
decides its costs to one counted before it (a DiT's repeated blocks: `twin_key`) takes that one's costs. Profiled
mode runs them on the real device and times forward and backward, and on CUDA also measures the memory a
forward leaves alive; its result is saved as JSON that later plans reuse (`diffpipe plan --profile`).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ..precision.autocast import CountedAutocast
from .live_bytes import LiveBytes
from ..models.storage import PRODUCT_LAYERS, fp8_layers, quantisable
from ..models.units import Backbone, twin_key
from ..pipeline.exchange import exchanged_bytes
from ..torch_support import (fused_attention, kept_storage_key, split_backward_input, split_backward_weight,
                             view_base)

__all__ = ["UnitCost", "count_unit_costs", "needs_grad", "kept_for_weight_pass", "profile_unit_costs", "save_profile",
           "load_profile"]


def _factored(shape: torch.Size) -> int:
    """Elements of Adafactor's second moment of a weight of this shape (transformers' Adafactor)."""
    if len(shape) < 2:
        return shape.numel()
    return shape[:-1].numel() + (shape[:-2] + shape[-1:]).numel()


@dataclass
class UnitCost:
    """Costs of one unit for one micro-batch. Times are seconds; None until profiled or derived from FLOPs."""

    name: str
    params: int
    trainable_params: int
    forward_flops: int
    backward_flops: int
    activation_bytes: int  # kept for backward, per micro-batch
    output_bytes: dict[str, int]  # bytes of each tensor the unit writes, per micro-batch
    forward_s: float | None = None
    backward_s: float | None = None
    # per micro-batch, what a split backward (zero-bubble schedules) keeps from its input-gradient pass to its
    # weight pass: the gradients of the outputs of the ops that use a trained weight
    weight_pass_bytes: int = 0
    # frozen weights of the unit's linear layers (memory.base_dtype fp8, int8 and nf4 store them so), and of its linear
    # and convolution layers (stored in fp32, autocast's bf16 copy of each is kept for backward per micro-batch)
    frozen_linear_params: int = 0
    frozen_product_params: int = 0
    # Adafactor's second moment of the unit's trained weights: a row and a column mean per matrix (the last two
    # dimensions), every element of a vector
    factored_state_params: int = 0
    # per micro-batch whatever its size: under autocast, the bf16/fp16 copies of trained weights that backward keeps
    # (made once per micro-batch's forward, precision/autocast.py)
    trained_copy_bytes: int = 0
    # per micro-batch: the most the unit holds at once beyond what it keeps, in its forward or its backward (its
    # intermediates; planner/live_bytes.py), charged once per stage
    working_bytes: int = 0
    # the part of output_bytes that does not grow with the micro-batch: a tensor that one micro-batch's samples share
    # (Flux's and Wan's rotary tables), by name (plan.py's `shared_outputs` finds them)
    shared_output_bytes: dict[str, int] = field(default_factory=dict)
    # per micro-batch: the bytes of the queries, keys, values and outputs of the unit's self and joint attentions,
    # which sequence parallelism's all-to-alls move between a sample's processes, in forward and again in backward;
    # and those attentions' forward FLOPs, which its backward (diffusers' native attention op) computes again
    attention_bytes: int = 0
    attention_flops: int = 0
    # one forward's FLOPs of the frozen linear layers whose products fp8 tensor cores take (train.fp8_compute runs
    # them, and as many for their input gradients, in fp8)
    fp8_product_flops: int = 0


class _FusedAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` without a mask as the fused memory-efficient kernel (its meta kernel), so
    counting sees what that kernel saves for backward, not the decomposition's probability matrix. Counts, for every
    attention over as many keys as queries (self or joint attention: what sequence parallelism splits,
    pipeline/sequence.py; a cross-attention to the text attends locally), the bytes of its queries, keys, values and
    output (`exchanged_bytes`, what the all-to-alls move) and its forward FLOPs (`exchanged_flops`, which the split
    attention's backward computes again)."""

    def __init__(self):
        super().__init__()
        self.exchanged_bytes = 0
        self.exchanged_flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args), **kwargs)
        query, key = named["query"], named["key"]
        if query.shape[-2] == key.shape[-2]:  # (batch, heads, tokens, head width)
            self.exchanged_bytes += exchanged_bytes(query, key, named["value"])
            self.exchanged_flops += 4 * query.numel() * key.shape[-2]  # scores, then their product with the values
        if named.get("attn_mask") is not None or named.get("enable_gqa", False):
            return func(*args, **kwargs)
        return fused_attention(named["query"], named["key"], named["value"], named.get("dropout_p", 0.0),
                               named.get("is_causal", False), named.get("scale"))


def needs_grad(backbone: Backbone) -> set[str]:
    """Names whose value depends on trainable parameters (their gradients flow back across boundaries)."""
    out = set()
    for unit in backbone.units:
        trainable = any(p.requires_grad for p in unit.module.parameters())
        if trainable or any(n in out for n in unit.reads):
            out |= set(unit.writes)
    return out


def _unit_inputs(named: dict[str, torch.Tensor], reads, grad_names: set[str]) -> dict[str, torch.Tensor]:
    return {k: named[k].detach().requires_grad_(k in grad_names and named[k].is_floating_point()) for k in reads}


def count_unit_costs(backbone: Backbone, inputs: dict[str, torch.Tensor], conditions: dict[str, torch.Tensor],
                     autocast_dtype: torch.dtype | None = None, frozen_dtype: torch.dtype | None = None,
                     twins: bool = True) -> list[UnitCost]:
    """Costs from running the units on meta tensors; `backbone` must be on the meta device. With `autocast_dtype`,
    each op runs in the dtype CUDA's autocast gives it (precision/autocast.py), so what is saved for backward is
    counted in the dtypes training saves it in; `frozen_dtype`: how frozen weights are stored (memory.base_dtype),
    which decides, for one, whether a norm meets its weight in its input's dtype and takes torch's fused kernel,
    which saves less. `twins`: a unit alike in every way that decides its costs to one counted before it
    (`twin_key`) takes that one's costs, not counted again (a Flux.1-dev plan counts 2 of its 57 blocks)."""
    named = {k: v.to("meta") for k, v in {**inputs, **conditions}.items()}
    grad_names = needs_grad(backbone)
    counted: dict[tuple, tuple[UnitCost, dict[str, torch.Tensor]]] = {}
    out = []
    for unit in backbone.units:
        key = twin_key(unit, named, grad_names) if twins else None
        if key in counted:  # a repeated block fed alike (a DiT's): its twin's costs, its twin's outputs' shapes
            cost, outputs = counted[key]
            out.append(replace(cost, name=unit.name, output_bytes=dict(cost.output_bytes)))
            named.update(outputs)
            continue
        out.append(_count_unit(unit, named, grad_names, autocast_dtype, frozen_dtype))
        if key is not None:
            counted[key] = out[-1], {k: named[k] for k in unit.writes}
    return out


def _stored(module: torch.nn.Module, frozen_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The module's parameters as a run holds them: frozen floating-point ones in `frozen_dtype` (meta tensors)."""
    return {name: (p.to(frozen_dtype) if frozen_dtype is not None and not p.requires_grad and p.is_floating_point()
                   else p)
            for name, p in module.named_parameters()}


class _Fp8Products:
    """Counts the forward FLOPs of a module's frozen linear layers that fp8 tensor cores can take (hooks)."""

    def __init__(self, module: torch.nn.Module):
        self.layers = fp8_layers(module)
        self.flops, self._hooks = 0, []

    def _count(self, layer, inputs, output) -> None:
        self.flops += 2 * inputs[0].numel() * layer.out_features

    def __enter__(self):
        self._hooks = [layer.register_forward_hook(self._count) for layer in self.layers]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()


def _count_unit(unit, named: dict[str, torch.Tensor], grad_names: set[str], autocast_dtype: torch.dtype | None,
                frozen_dtype: torch.dtype | None = None) -> UnitCost:
    """One unit's costs; its outputs join `named` for the units after it."""
    params = list(unit.module.parameters())
    stored = _stored(unit.module, frozen_dtype)
    own = {id(p) for p in stored.values()}
    autocast = CountedAutocast(autocast_dtype, list(stored.values())) if autocast_dtype is not None else None
    saved: dict[int, torch.Tensor] = {}  # by identity; holding each keeps its identity from being reused
    copies: dict[int, torch.Tensor] = {}  # trained weights' autocast copies, saved once per micro-batch

    def pack(t: torch.Tensor):
        base = view_base(t)
        if autocast is not None and id(base) in autocast.trained_copies:
            copies[id(base)] = base
        elif id(base) not in own and (autocast is None or id(base) not in autocast.frozen_copies):
            saved[id(base)] = base  # weights are counted as parameters, frozen ones' copies apart (partition.py)
        # a detached alias: the graph then holds no tensor that holds the graph (a saved output would, and the
        # parts the split backward's input pass retains would never be freed, nor the weights they saved)
        return t.detach()

    args = _unit_inputs(named, unit.reads, grad_names)
    trained = [p for p in params if p.requires_grad]
    live = LiveBytes(lambda: sum(p.grad.untyped_storage().nbytes() for p in trained if p.grad is not None))
    with FlopCounterMode(display=False) as forward, _FusedAttention() as attention, autocast or contextlib.nullcontext(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live, _Fp8Products(unit.module) as fp8:
        out = functional_call(unit.module, stored, args=(), kwargs=args)
    if set(out) != set(unit.writes):
        raise RuntimeError(f"unit {unit.name} wrote {sorted(out)}, declared {sorted(unit.writes)}")
    forward_working = live.peak - live.live
    live.restart()
    before_backward = live.live
    with FlopCounterMode(display=False) as backward, live:
        weight_pass = _split_backward(out, args, unit.module)
    # less the gradients the split input pass keeps for the weight pass (charged apart, and only to the zero-bubble
    # schedules that split: a whole backward frees each as it goes)
    backward_working = live.peak - before_backward - weight_pass
    layers = list(unit.module.modules())
    frozen_products = {id(m.weight): m.weight.numel() for m in layers
                       if isinstance(m, PRODUCT_LAYERS) and not m.weight.requires_grad}
    named.update({k: v.detach() for k, v in out.items()})
    return UnitCost(
        name=unit.name, params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        factored_state_params=sum(_factored(p.shape) for p in params if p.requires_grad),
        forward_flops=forward.get_total_flops(), backward_flops=backward.get_total_flops(),
        activation_bytes=sum(t.numel() * t.element_size() for t in saved.values()),
        output_bytes={k: v.numel() * v.element_size() for k, v in out.items()},
        weight_pass_bytes=weight_pass,
        frozen_linear_params=sum(m.weight.numel() for m in layers if quantisable(m)),
        frozen_product_params=sum(frozen_products.values()),
        trained_copy_bytes=sum(t.numel() * t.element_size() for t in copies.values()),
        working_bytes=max(forward_working, backward_working), attention_bytes=attention.exchanged_bytes,
        attention_flops=attention.exchanged_flops, fp8_product_flops=fp8.flops)


def _split_backward(out: dict[str, torch.Tensor], args: dict[str, torch.Tensor], module: torch.nn.Module) -> int:
    """The unit's backward as torch's zero-bubble schedules run it (`stage_backward_input`, then
    `stage_backward_weight`); returns the bytes of the gradients the input pass keeps for the weight pass.
    Without an input that needs a gradient torch finds no such gradients (a first stage runs its whole backward in
    the weight pass): 0, and a plain backward."""
    outputs = [o.clone() for o in out.values() if o.requires_grad]  # torch detaches them in place: no views
    if not outputs:
        return 0
    weights = [p for p in module.parameters() if p.requires_grad]
    inputs = [a for a in args.values() if a.requires_grad]
    if not (weights and inputs):
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        return 0
    groups = split_backward_input(outputs, [torch.ones_like(o) for o in outputs], inputs, iter(weights))
    kept = kept_for_weight_pass(groups)
    split_backward_weight(iter(weights), groups)
    return kept


def kept_for_weight_pass(param_groups: list[dict]) -> int:
    """Bytes of the gradients `stage_backward_input` keeps in its parameter groups for the weight pass, each
    storage once (one gradient often reaches several ops)."""
    kept = {kept_storage_key(g): g.untyped_storage().nbytes() for group in param_groups
            for grads in group.get("grads") or () for g in grads if g is not None}
    return sum(kept.values())


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA); a no-op on CPU, where work is done when the call returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_unit_costs(backbone: Backbone, costs: list[UnitCost], inputs: dict[str, torch.Tensor],
                       conditions: dict[str, torch.Tensor], device: torch.device,
                       autocast_dtype: torch.dtype | None, repeats: int = 9, warmup: int = 2) -> list[UnitCost]:
    """Time each unit's forward and backward on `device`: the fastest of `repeats` runs after `warmup` runs
    (the fastest is the least disturbed by other work on a shared machine)."""
    named = {k: v.to(device) for k, v in {**inputs, **conditions}.items()}
    grad_names = needs_grad(backbone)
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    for unit, cost in zip(backbone.units, costs):
        unit.module.to(device)
        fwd, bwd = [], []
        retained = []
        for _ in range(warmup + repeats):
            args = _unit_inputs(named, unit.reads, grad_names)
            sync(device)
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            with autocast:
                out = unit(args)
            sync(device)
            mid = time.perf_counter()
            if device.type == "cuda":  # what the forward leaves alive for backward: outputs and saved tensors
                retained.append(torch.cuda.memory_allocated(device) - before)
            grads_needed = [o for o in out.values() if o.requires_grad]
            if grads_needed:
                torch.autograd.backward(grads_needed, [torch.ones_like(o) for o in grads_needed])
            sync(device)
            fwd.append(mid - start)
            bwd.append(time.perf_counter() - mid)
            unit.module.zero_grad(set_to_none=True)
        cost.forward_s, cost.backward_s = min(fwd[warmup:]), min(bwd[warmup:])
        if retained:  # measured: the kernels actually used (flash attention keeps far less than the math path)
            cost.activation_bytes = int(min(retained[warmup:]))
        named.update({k: v.detach() for k, v in out.items()})
    return costs


def save_profile(costs: list[UnitCost], key: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"key": key, "units": [asdict(c) for c in costs]}, indent=1))


def load_profile(path: str | Path, key: dict) -> list[UnitCost]:
    data = json.loads(Path(path).read_text())
    if data.get("key") != key:
        raise ValueError(f"profile {path} was measured for {data.get('key')}, not for {key}; "
                         "run `diffpipe plan CONFIG --profile` again")
    return [UnitCost(**u) for u in data["units"]]

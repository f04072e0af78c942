"""A pipeline stage as one `nn.Module`: runs its units on the named tensors it receives, returns those it sends.

Positional arguments are the received tensors, in `StageSpec.receives` order; keyword arguments are the
conditions every stage gets (timestep, text embeddings). Outputs are in `StageSpec.sends` order.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError
from ..models.units import Backbone, Unit
from ..torch_support import recompile_limit
from .block_swap import SwappedWeights, swapped_units
from .split import StageSpec
from .zero_bubble import missed_parameters

__all__ = ["compiled_shapes_words", "StageModule", "build_stage_modules", "repeated_blocks"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    Gradients of skip tensors come out of torch.cat's backward as strided views; the pipeline would send them
    as-is, which gloo refuses and NCCL may corrupt (docs/pipelining-facts.md, pitfall 1).
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with the standard strides of its shape, as a stage sends it. `contiguous()` alone keeps the stride
    of a dimension of size 1: a Flux single block's image tokens, a view of its text + image tokens, kept the
    text + image stride at micro-batch 1, and torch 2.11's PipelineStage refused the step ("stride mismatch",
    PipeliningShapeError) when the timed step's output came back with the standard one (two H200s, issue 15)."""
    tensor = tensor.contiguous()
    standard, step = [], 1
    for size in reversed(tensor.shape):
        standard.append(step)
        step *= size
    if tensor.stride() != tuple(reversed(standard)):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


_COMPILED_SHAPES = 64  # graphs dynamo may compile per code object (a stage, or a class of blocks): input shapes


def compiled_shapes_words(compile: bool | str, shapes: int, text_lengths: int = 1) -> str:
    """What pipeline.compile compiles for data of `shapes` bucket shapes whose text is cut to up to `text_lengths`
    lengths (models/tokens.TEXT_LENGTHS): a graph per input shape, at most `_COMPILED_SHAPES` per block class (or
    stage compiled whole); past that a shape runs eager. For the run's header."""
    what = "each repeated block class" if compile == "blocks" else "each stage"
    texts = f" x up to {text_lengths} text lengths" if text_lengths > 1 else ""
    graphs = shapes * text_lengths
    words = (f"pipeline.compile = {compile!r}: {what} compiles once per input shape, its shapes fixed (not dynamic): "
             f"{shapes} bucket shape(s){texts}, at most {graphs} graph(s) (limit {_COMPILED_SHAPES})")
    if graphs > _COMPILED_SHAPES:
        words += ("; warning: past the limit the other shapes run eager: fewer buckets (data.bucket_step, "
                  "data.max_aspect) keep them all compiled")
    return words


class StageModule(nn.Module):
    def __init__(self, spec: StageSpec, units: list[Unit], parameter_names: dict[int, str],
                 autocast_dtype: torch.dtype | None = None, recomputed: int = 0,
                 compiled: bool | str = False, repeated_blocks: tuple[str, ...] = ()):
        super().__init__()
        self.spec = spec
        self.recomputed_from = len(units) - recomputed  # units from this index on run checkpointed
        self.clock = None  # a StageClock while the runtime times this stage
        # set by the runtime for zero-bubble schedules: outputs cloned (the schedule detaches them in place) and the
        # first forward with gradients checked for parameters the split backward would miss (zero_bubble.py)
        self.split_backward: str | None = None
        self._split_backward_checked = False
        self.unit_list = units
        self.swaps: dict[int, SwappedWeights] = {}  # unit index -> its frozen weights in host memory (`to_device`)
        self.units = nn.ModuleList(u.module for u in units)  # registers the parameters
        self.autocast_dtype = autocast_dtype
        self._full_names = {name: parameter_names[id(t)] for name, t in self._own_tensors()}
        self.compiled = bool(compiled)
        if compiled == "blocks":  # each repeated block a graph of its own, compiled once per shape for all alike
            for module in self.units.modules():
                if type(module).__name__ in repeated_blocks:
                    module.compile(dynamic=False)
        # true: the units (and their checkpointing) as one graph; received tensors and the clock stay outside it
        self._compute = torch.compile(self._compute_units, dynamic=False) if compiled is True else self._compute_units

    def to_device(self, device: torch.device, block_swap: int = 0) -> "StageModule":
        """The stage on `device`, the frozen weights of its last `block_swap` units holding them kept in host memory
        (pipeline/block_swap.py): they never all come to the device at once, not even while moving."""
        side_stream = torch.cuda.Stream(device) if device.type == "cuda" and block_swap else None
        self.swaps = {i: SwappedWeights(self.unit_list[i].module, device, side_stream)
                      for i in swapped_units(self.unit_list, block_swap)}
        for swap in self.swaps.values():
            swap.hide()  # `to` moves an empty tensor in their place
        self.to(device)
        for swap in self.swaps.values():
            swap.to_host()
        return self

    def _own_tensors(self):
        yield from self.named_parameters()
        yield from self.named_buffers()

    def forward(self, *received: torch.Tensor, **conditions: torch.Tensor):
        timing = self.clock is not None and self.clock.timing
        if timing:
            self.clock.forward_started()
            self.clock.watch_inputs(received)
            self.clock.watch_parameters(self)  # the whole copies a wrapped module computes with exist only now
        named = dict(conditions)
        for name, tensor in zip(self.spec.receives, received, strict=True):
            named[name] = _ContiguousGrad.apply(tensor) if tensor.requires_grad else tensor
        device_type = received[0].device.type
        autocast = (torch.autocast(device_type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                    else contextlib.nullcontext())
        # compiled code is for training; a pass without gradients (samples; torch 2.11's PipelineStage learning
        # output shapes) runs eager: compiling its own graph would cost a second compile of the whole stage
        eager = torch.compiler.set_stance("force_eager") if not torch.is_grad_enabled() else contextlib.nullcontext()
        # a graph per input shape, and dynamo keeps at most 8 per code object (all blocks of a class share one):
        # aspect-ratio buckets give each level of a UNet a shape, and past the limit the rest would run eager
        shapes = (recompile_limit(_COMPILED_SHAPES) if self.compiled
                  else contextlib.nullcontext())
        with autocast, eager, shapes:
            out = self._compute(named)
        if self.split_backward is not None and torch.is_grad_enabled() and not self._split_backward_checked:
            self._check_split_backward(out, received)
        if timing:
            self.clock.forward_ended()
            out = self.clock.watch_outputs(out)
        # no views, nothing saved by an op: zero-bubble schedules detach outputs in place; torch's data parallelism
        # warns of a view leaving a wrapped module (the clock's are: an in-place change would skip its gradient hook)
        if self.split_backward is not None or (timing and isinstance(self, FSDPModule)):
            out = tuple(t.clone() for t in out)
        return out[0] if len(out) == 1 else out

    def _run_swapped(self, index: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A swapped unit, checkpointed: its weights come in for the forward and again for the recomputation before
        its backward. The next swapped unit's copy starts while this one computes; in backward, the previous one's
        when this one's backward begins."""
        swap, unit = self.swaps[index], self.unit_list[index]
        swap.prefetch()  # on its way already, unless this is the first swapped unit of the stage
        later = [i for i in self.swaps if i > index]
        if later:
            self.swaps[later[0]].prefetch()
        if not torch.is_grad_enabled():
            return swap.run(unit, inputs)
        out = checkpoint(swap.run, unit, inputs, use_reentrant=False)
        earlier = [i for i in self.swaps if i < index]
        if earlier:
            previous = self.swaps[earlier[-1]]
            for tensor in out.values():
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, previous=previous: previous.prefetch())
        return out

    def _check_split_backward(self, out: tuple[torch.Tensor, ...], received: tuple[torch.Tensor, ...]) -> None:
        self._split_backward_checked = True
        if self.spec.index == 0:  # torch runs the first stage's backward whole
            return
        missed = missed_parameters(out, received, self.full_named_parameters())
        if missed:
            units = f"{self.unit_list[0].name}..{self.unit_list[-1].name}"
            raise ConfigError(
                f"pipeline.schedule = {self.split_backward!r} would compute wrong gradients for stage "
                f"{self.spec.index} (units {units}): {len(missed)} parameter(s), e.g. {', '.join(missed[:3])}, "
                "reach the stage's outputs "
                "without passing through a received tensor that requires a gradient, and torch's zero-bubble weight "
                "pass starts only from those (docs/pipelining-facts.md, pitfall 3). Use schedule 1f1b or "
                "interleaved_1f1b, or move pipeline.split so that this stage starts after these units")

    def _compute_units(self, named: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The units in order. Checkpointed (the stage's last `recomputed`), each unit keeps only its inputs and is
        recomputed alone in backward (as diffusers' gradient checkpointing does per block), so backward never holds
        more than one unit's activations; checkpointing the stage whole kept one micro-batch's activations of every
        unit at once while it was recomputed (a one-stage Wan 1.3B at 81 frames ran out of memory that way)."""
        checkpointed_from = self.recomputed_from if torch.is_grad_enabled() else len(self.unit_list)
        named = dict(named)
        for index, unit in enumerate(self.unit_list):
            if index in self.swaps:
                named.update(self._run_swapped(index, {name: named[name] for name in unit.reads}))
            elif index >= checkpointed_from:  # its own dict of its inputs, which backward recomputes from
                named.update(checkpoint(unit, {name: named[name] for name in unit.reads}, use_reentrant=False))
            else:
                named.update(unit(named))
        return tuple(_dense(named[name]) for name in self.spec.sends)

    def full_named_parameters(self):
        """(name in the whole model, parameter) pairs, as diffusers names them."""
        for name, p in self.named_parameters():
            yield self._full_names[name], p

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the names of the whole model (as diffusers saves them; buffers a constructor
        computes and does not save, such as Wan's rotary tables, left out)."""
        return {self._full_names[name]: t.detach() for name, t in self.state_dict(keep_vars=True).items()}


def repeated_blocks(backbone: Backbone, compiled: bool | str) -> tuple[str, ...]:
    """Class names of the blocks the model repeats, as diffusers declares them for regional compilation; refused
    for `pipeline.compile = "blocks"` when there are none (checked before launch, and here for direct callers)."""
    blocks = tuple(getattr(type(backbone.model), "_repeated_blocks", None) or ())
    if compiled == "blocks" and not blocks:
        raise ConfigError(f"pipeline.compile = \"blocks\": {type(backbone.model).__name__} declares no repeated "
                          "blocks to compile (diffusers' _repeated_blocks); use pipeline.compile = true "
                          "(the whole stage)")
    return blocks


def build_stage_modules(backbone: Backbone, specs: list[StageSpec], autocast_dtype: torch.dtype | None = None,
                        checkpointed: frozenset[int] = frozenset(), compiled: bool | str = False,
                        recomputed: list[int] | None = None) -> list[StageModule]:
    """The stages of `specs`; those in `checkpointed` run every unit checkpointed, or, where `recomputed` is given
    (a count per stage, pipeline.recomputed_units), their last that many units (none where the list is short)."""
    blocks = repeated_blocks(backbone, compiled)

    def count(s: StageSpec) -> int:
        if recomputed is not None:
            return min(recomputed[s.index], s.last - s.first) if s.index < len(recomputed) else 0
        return s.last - s.first if s.index in checkpointed else 0

    return [StageModule(s, backbone.units[s.first:s.last], backbone.parameter_names, autocast_dtype,
                        count(s), compiled, blocks) for s in specs]

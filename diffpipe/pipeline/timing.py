"""When each stage computes: forward and backward intervals per micro-batch, from public hooks only.

Forward is timed inside `StageModule.forward`. Backward starts when the gradient of the stage's outputs
arrives (an identity autograd function on the outputs) and ends with the last gradient the stage produces
(a hook on each parameter, which runs when its gradient is computed). Zero-bubble schedules compute the weight
gradients later, in a pass of their own (`torch.autograd.grad` to the parameters, which runs those hooks too, but
no others): there a stage's backward ends with the gradient of its received tensors (a hook on each), and
parameter gradients after it are that pass, a "weight" interval from its first gradient to its last. On CUDA
the marks are CUDA events read after the step's synchronisation; on CPU they are wall-clock readings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["StageClock", "Interval", "StepTimes", "Mark"]


@dataclass(frozen=True)
class Interval:
    stage: int
    kind: str  # "forward", "backward", or "weight" (zero-bubble schedules' weight-gradient pass)
    microbatch: int
    start_s: float  # seconds since the step began
    end_s: float


@dataclass
class StepTimes:
    """One rank's step: its compute intervals, the schedule's wall time and the optimizer's."""

    intervals: list[Interval]
    step_s: float
    optimizer_s: float = 0.0
    exchanged_bytes: int = 0  # given to the all-to-alls of attention split over a sample's processes (sequence.py)

    @property
    def compute_s(self) -> float:
        return sum(i.end_s - i.start_s for i in self.intervals)


class Mark:
    """A point in time: a CUDA event (read later) or a wall-clock reading."""

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.wall = None
        else:
            self.event, self.wall = None, time.perf_counter()

    def wait(self) -> None:
        """Block the host until the device has got here (a CPU is always there)."""
        if self.event is not None:
            self.event.synchronize()

    def seconds_since(self, origin: "Mark") -> float:
        if self.event is not None:
            return origin.event.elapsed_time(self.event) / 1e3
        return self.wall - origin.wall


class _BackwardStarts(torch.autograd.Function):
    """Identity on a stage output; its backward runs first in the stage's backward."""

    @staticmethod
    def forward(ctx, clock, call, x):
        ctx.clock, ctx.call = clock, call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_started(ctx.call)
        return None, None, grad


@dataclass
class StageClock:
    """Collects the compute marks of one stage module during a step."""

    stage: int
    device: torch.device
    split_backward: bool = False  # a zero-bubble schedule: weight gradients in a pass of their own
    _marks: list[tuple[str, Mark]] = field(default_factory=list)
    _origin: Mark | None = None
    _watched: set[int] = field(default_factory=set)  # ids of the parameters with a gradient hook

    @property
    def timing(self) -> bool:
        """Whether this step is timed (`start_step` was given an origin)."""
        return self._origin is not None

    def start_step(self, origin: "Mark | None") -> None:
        """Begin a step measured from `origin`; None leaves the step untimed (every mark is skipped)."""
        self._marks.clear()
        self._origin = origin
        self._calls, self._open_backward = 0, None

    def forward_started(self) -> None:
        if self._origin is not None:
            self._calls += 1
            self._open_backward = None
            self._marks.append(("forward_start", Mark(self.device)))

    def forward_ended(self) -> None:
        if self._origin is not None:
            self._marks.append(("forward_end", Mark(self.device)))

    def backward_started(self, call: int) -> None:
        """Called by each output's gradient; only the first output of a forward call opens the interval."""
        if self._origin is not None and call != self._open_backward:
            self._open_backward = call
            self._marks.append(("backward_start", Mark(self.device)))

    def gradient_produced(self, *_) -> None:
        if self._origin is not None:
            self._marks.append(("gradient", Mark(self.device)))

    def _gradient_hook(self, grad: torch.Tensor) -> None:
        self.gradient_produced()  # returns None: the gradient is left as it is

    def _input_gradient_hook(self, grad: torch.Tensor) -> None:
        if self._origin is not None:
            self._marks.append(("input_gradient", Mark(self.device)))

    def watch_inputs(self, received: tuple[torch.Tensor, ...]) -> None:
        """Mark when the gradients of this forward's received tensors are computed (a zero-bubble backward's end)."""
        if self._origin is not None and self.split_backward and torch.is_grad_enabled():
            for tensor in received:
                if tensor.requires_grad:
                    tensor.register_hook(self._input_gradient_hook)

    def watch_outputs(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self._origin is None or not torch.is_grad_enabled():
            return outputs
        return tuple(_BackwardStarts.apply(self, self._calls, o) if o.requires_grad else o for o in outputs)

    def watch_parameters(self, module: torch.nn.Module) -> None:
        """Mark when each parameter's gradient is computed. Called at each forward: under torch's data parallelism
        the module computes with whole copies of its parameters, present only then (pipeline/data_parallel.py)."""
        for p in module.parameters():
            if p.requires_grad and id(p) not in self._watched:  # a tensor hook: it runs in a weight pass too,
                self._watched.add(id(p))  # unlike a post-accumulation hook
                p.register_hook(self._gradient_hook)

    def intervals(self) -> list[Interval]:
        """Forward and backward intervals of this step, numbered per kind in the order they ran."""
        origin = self._origin
        if origin is None:
            return []
        out, counts = [], {"forward": 0, "backward": 0, "weight": 0}
        open_kind, open_at, last_gradient, inputs_done = None, None, None, False

        def close(end: float) -> None:
            nonlocal open_kind
            if open_kind is not None:
                out.append(Interval(self.stage, open_kind, counts[open_kind], open_at, end))
                counts[open_kind] += 1
                open_kind = None

        for kind, mark in self._marks:
            t = mark.seconds_since(origin)
            if kind in ("forward_start", "backward_start"):
                if open_kind in ("backward", "weight"):
                    close(last_gradient if last_gradient is not None else t)
                open_kind, open_at, last_gradient, inputs_done = kind.split("_")[0], t, None, False
            elif kind == "forward_end":
                close(t)
            elif kind == "input_gradient":
                last_gradient, inputs_done = t, True
            else:
                if open_kind == "backward" and inputs_done:  # the input gradients ended it: a weight pass follows
                    close(last_gradient)
                if open_kind is None:  # parameter gradients with nothing open: a zero-bubble weight pass
                    open_kind, open_at = "weight", t
                last_gradient = t
        if open_kind in ("backward", "weight"):
            close(last_gradient if last_gradient is not None else open_at)
        return out

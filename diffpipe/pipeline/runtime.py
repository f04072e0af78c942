"""Training steps of this process's stages through a `torch.distributed.pipelining` schedule.

Receive buffers of upstream pipelining have fixed shapes (pytorch/pytorch#159942), so stage and schedule
objects are built once per input shape and kept: a step with another bucket shape gets its own, while the
modules (and so the weights and gradients) are shared.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..observe.timing import Mark, StageClock, StepTimes
from .stage import StageModule

__all__ = ["PipelineRunner", "SCHEDULES", "stage_indices_for_rank"]

# Zero-bubble schedules are left out: docs/pipelining-facts.md, pitfall 3 (silently wrong gradients when a stage's
# parameters are not reached through an input that requires grad, as conv_in on a later stage).
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
_MULTI_STAGE = {"interleaved_1f1b"}


def stage_indices_for_rank(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """Looped placement: rank r holds stages r, r + pp_size, r + 2 pp_size, ..."""
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


class PipelineRunner:
    """Runs one forward+backward over all micro-batches of a step; the last stage returns the mean loss."""

    def __init__(self, modules: list[StageModule], stage_indices: list[int], num_stages: int,
                 group: dist.ProcessGroup, device: torch.device, schedule: str, microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], timeable: bool = True):
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule={schedule!r}: choose one of {sorted(SCHEDULES)}")
        self.modules, self.stage_indices = modules, stage_indices
        self.num_stages, self.group, self.device = num_stages, group, device
        self.schedule_name, self.microbatches, self.loss_fn = schedule, microbatches, loss_fn
        self._schedules: dict[tuple, object] = {}
        # clocks (and their gradient hooks) only when steps may be timed; each step then chooses
        self.clocks = [StageClock(i, device) for i in stage_indices] if timeable else []
        for module, clock in zip(modules, self.clocks):
            module.clock = clock
            clock.watch_parameters(module)

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def _schedule_for(self, shape_key: tuple):
        if shape_key not in self._schedules:
            stages = [PipelineStage(m, i, self.num_stages, self.device, group=self.group)
                      for m, i in zip(self.modules, self.stage_indices)]
            cls = SCHEDULES[self.schedule_name]
            arg = stages if self.schedule_name in _MULTI_STAGE else stages[0]
            # scale_grads=False: the micro-batches' gradients stay summed, and the trainer divides them by the
            # micro-batch count inside the optimizer step, instead of a division of every gradient here
            self._schedules[shape_key] = cls(arg, n_microbatches=self.microbatches, loss_fn=self.loss_fn,
                                             scale_grads=False)
        return self._schedules[shape_key]

    def step(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
             timed: bool = True) -> tuple[torch.Tensor | None, StepTimes | None]:
        """Forward and backward of one batch; gradients accumulate, summed over micro-batches.

        Returns the mean loss (on the rank holding the last stage, else None) and, when `timed`, this rank's
        compute intervals.
        """
        schedule = self._schedule_for(tuple(sample.shape))
        timed = timed and bool(self.clocks)
        if timed:
            dist.barrier(group=self.group)  # one origin for the whole pipeline: the timeline's ranks line up
        origin = Mark(self.device) if timed else None
        for clock in self.clocks:
            clock.start_step(origin)
        losses: list[torch.Tensor] = []
        args = (sample,) if self.holds_first_stage else ()
        kwargs = dict(conditions)
        if self.holds_last_stage:
            kwargs.update(target=target, losses=losses)
        schedule.step(*args, **kwargs)
        times = None
        if timed:
            end = Mark(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times = StepTimes([iv for clock in self.clocks for iv in clock.intervals()], end.seconds_since(origin))
        if not self.holds_last_stage:
            return None, times
        return torch.stack([loss.detach().float() for loss in losses]).mean(), times

    @torch.no_grad()
    def forward_only(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
                     with_loss: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A forward of every micro-batch without gradients (evaluation, sampling): on the rank holding the last
        stage, the output (micro-batches merged) and, `with_loss`, the mean loss against `target` (without: any tensor
        of the output's shape); (None, None) elsewhere. Nothing is timed and no gradient is touched, so it may run
        between a step's backward and its optimizer step."""
        schedule = self._schedule_for(tuple(sample.shape))
        for clock in self.clocks:
            clock.start_step(None)
        losses: list[torch.Tensor] = []
        args = (sample,) if self.holds_first_stage else ()
        kwargs = dict(conditions)
        if self.holds_last_stage:  # the schedule computes its loss on the last stage: a target is always needed
            kwargs.update(target=target, losses=losses)
        output = schedule.eval(*args, **kwargs)
        if not self.holds_last_stage:
            return None, None
        loss = torch.stack([loss.float() for loss in losses]).mean() if with_loss else None
        return output, loss

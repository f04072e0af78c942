"""Training steps of this process's stages through a `torch.distributed.pipelining` schedule.

Receive buffers of upstream pipelining have fixed shapes (pytorch/pytorch#159942), so stage and schedule
objects are built once per input shape and kept: a step with another bucket shape (or another text length, for a
family that cuts text to a batch's captions) gets its own, while the modules (and so the weights and gradients) are
shared.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from ..config import ConfigError
from .timing import Mark, StageClock, StepTimes
from ..torch_support import schedule_problem
from .data_parallel import before_backward
from .schedules import schedule_named
from .sequence import SequenceShards
from .stage import StageModule

__all__ = ["PipelineRunner"]


def _shapes(sample: torch.Tensor, conditions: dict[str, torch.Tensor]) -> tuple:
    """What a step's receive buffers depend on: the shapes of everything fed to the stages."""
    return (tuple(sample.shape),) + tuple((name, tuple(t.shape)) for name, t in sorted(conditions.items()))


class PipelineRunner:
    """Runs one forward+backward over all micro-batches of a step; the last stage returns the mean loss."""

    def __init__(self, modules: list[StageModule], stage_indices: list[int], num_stages: int,
                 group: dist.ProcessGroup, device: torch.device, schedule: str, microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], timeable: bool = True,
                 send_group: dist.ProcessGroup | None = None, sequence: SequenceShards | None = None):
        """`group`: the pipeline's processes (barriers); `send_group`: the same processes for the stages' sends
        (default `group`); `sequence`: this process's share of every sample's tokens (pipeline/sequence.py), None
        for all of them: the stages then compute on that share, and the loss against that share of the target."""
        self.schedule = schedule_named(schedule)
        problem = schedule_problem(schedule, self.schedule.placement, device.type)
        if problem is not None:
            raise ConfigError(problem)
        self.modules, self.stage_indices = modules, stage_indices
        self.num_stages, self.group, self.device = num_stages, group, device
        self.send_group = send_group if send_group is not None else group
        self.microbatches, self.loss_fn, self.sequence = microbatches, loss_fn, sequence
        for module in modules:  # the split backward's needs: pipeline/zero_bubble.py
            module.split_backward = schedule if self.schedule.zero_bubble else None
        self._schedules: dict[tuple, object] = {}
        # clocks (and their gradient hooks) only when steps may be timed; each step then chooses
        self.clocks = [StageClock(i, device, self.schedule.zero_bubble) for i in stage_indices] if timeable else []
        for module, clock in zip(modules, self.clocks):
            module.clock = clock  # which watches the module's parameters at each forward

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def last_stage_rank(self) -> int:
        """The process of this pipeline (its rank in the pipeline's group) holding the last stage."""
        return self.schedule.rank_of(self.num_stages - 1, dist.get_world_size(self.group))

    def _schedule_for(self, shape_key: tuple):
        if shape_key not in self._schedules:
            stages = [PipelineStage(m, i, self.num_stages, self.device, group=self.send_group)
                      for m, i in zip(self.modules, self.stage_indices)]
            cls = self.schedule.torch_type
            arg = stages if self.schedule.multi_stage else stages[0]
            # scale_grads=False: the micro-batches' gradients stay summed, and the trainer divides them by the
            # micro-batch count inside the optimizer step, instead of a division of every gradient here
            self._schedules[shape_key] = cls(arg, n_microbatches=self.microbatches, loss_fn=self._loss,
                                             scale_grads=False)
        return self._schedules[shape_key]

    def step(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
             timed: bool = True) -> tuple[torch.Tensor | None, StepTimes | None]:
        """Forward and backward of one batch; gradients accumulate, summed over micro-batches.

        Returns the mean loss (on the rank holding the last stage, else None) and, when `timed`, this rank's
        compute intervals.
        """
        with self._picture_tokens(target):
            return self._step(sample, conditions, self._share(target), timed and bool(self.clocks))

    def _step(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
              timed: bool) -> tuple[torch.Tensor | None, StepTimes | None]:
        if timed:
            dist.barrier(group=self.group)  # one origin for the whole pipeline: the timeline's ranks line up
        origin = Mark(self.device) if timed else None
        for clock in self.clocks:
            clock.start_step(origin)
        if self.sequence is not None:  # an evaluation's or a sample's all-to-alls are not the step's
            self.sequence.take_exchanged_bytes()
        losses: list[torch.Tensor] = []
        if self.num_stages == 1:
            self._accumulate(sample, conditions, target, losses)
        else:
            args = (sample,) if self.holds_first_stage else ()
            kwargs = dict(conditions)
            if self.holds_last_stage:
                kwargs.update(target=target, losses=losses)
            self._schedule_for(_shapes(sample, conditions)).step(*args, **kwargs)
        times = None
        if timed:
            end = Mark(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times = StepTimes([iv for clock in self.clocks for iv in clock.intervals()], end.seconds_since(origin),
                              exchanged_bytes=self.sequence.take_exchanged_bytes() if self.sequence else 0)
        if not self.holds_last_stage:
            return None, times
        return torch.stack([loss.detach().float() for loss in losses]).mean(), times

    def _accumulate(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
                    losses: list[torch.Tensor]) -> None:
        """One stage: each micro-batch's forward and backward in turn (split as torch's schedules split them),
        gradients summed. Replicas reduce them during the backwards, as pipeline/data_parallel.py says (torch's
        schedules reduce only after the last backward)."""
        module, split = self.modules[0], self.microbatches
        samples, targets = torch.tensor_split(sample, split), torch.tensor_split(target, split)
        parts = {k: torch.tensor_split(v, split) for k, v in conditions.items()}
        for i in range(split):
            before_backward(module, last=i == split - 1)
            loss = self._loss(module(samples[i], **{k: v[i] for k, v in parts.items()}), targets[i])
            loss.backward()
            losses.append(loss.detach())

    @torch.no_grad()
    def forward_only(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
                     with_loss: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A forward of every micro-batch without gradients (evaluation, sampling): on the rank holding the last
        stage, the output (micro-batches merged) and, `with_loss`, the mean loss against `target` (without: any tensor
        of the output's shape); (None, None) elsewhere. Nothing is timed and no gradient is touched, so it may run
        between a step's backward and its optimizer step."""
        for clock in self.clocks:
            clock.start_step(None)
        with self._picture_tokens(target):
            return self._forward_only(sample, conditions, self._share(target), with_loss)

    def _forward_only(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor], target: torch.Tensor,
                      with_loss: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.schedule.placement == "v":
            output, losses = self._forward_in_stage_order(sample, conditions, target)
        else:
            losses: list[torch.Tensor] = []
            args = (sample,) if self.holds_first_stage else ()
            kwargs = dict(conditions)
            if self.holds_last_stage:  # the schedule computes its loss on the last stage: a target is always needed
                kwargs.update(target=target, losses=losses)
            output = self._schedule_for(_shapes(sample, conditions)).eval(*args, **kwargs)
        if not self.holds_last_stage:
            return None, None
        loss = torch.stack([loss.float() for loss in losses]).mean() if with_loss else None
        if self.sequence is not None:  # every share of the output, less any pad (the loss stays this share's)
            output = self.sequence.gather(output, dim=1)
        return output, loss

    def _share(self, target: torch.Tensor) -> torch.Tensor:
        """The target's share that this process's output predicts: the backbone's output is in its token layout
        (B, tokens, ...), tokens along dimension 1."""
        return target if self.sequence is None else self.sequence.shard(target, dim=1)

    def _picture_tokens(self, target: torch.Tensor):
        """Around a step: each sample's picture token count (the target's, before its share is cut), which the
        shares' attentions and `_loss` read to leave out the pad of a count the degree does not divide."""
        return nullcontext() if self.sequence is None else self.sequence.picture_tokens(target.shape[1])

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of this process's share. Where the step pads its picture tokens, the pad is left out (output and
        target zero there) and the share's mean is scaled by padded/real tokens, so that the mean over the shares is
        the mean over the picture's own tokens, as one process computes it."""
        shards = self.sequence
        if shards is None or not shards.padding:
            return self.loss_fn(output, target)
        kept = shards.kept(output.device).view(1, -1, *[1] * (output.dim() - 2))
        loss = self.loss_fn(torch.where(kept, output, 0), torch.where(kept, target, 0))
        return loss * (shards.padded(shards.step.count) / shards.step.count)

    def _forward_in_stage_order(self, sample: torch.Tensor, conditions: dict[str, torch.Tensor],
                                target: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Forward without gradients for V-shaped placement, whose torch schedules run only with a backward
        (docs/pipelining-facts.md, pitfall 7): each micro-batch through the stages in order, handed between
        processes by plain sends (shapes first). Micro-batches split as the schedules split them."""
        ranks, me = dist.get_world_size(self.send_group), dist.get_rank(self.send_group)
        mine = dict(zip(self.stage_indices, self.modules))
        split = self.microbatches
        samples, targets = torch.tensor_split(sample, split), torch.tensor_split(target, split)
        parts = {k: torch.tensor_split(v, split) for k, v in conditions.items()}
        outputs, losses = [], []
        for i in range(split):
            x = (samples[i],)
            for stage in range(self.num_stages):
                if self.schedule.rank_of(stage, ranks) != me:
                    continue
                before = self.schedule.rank_of(stage - 1, ranks) if stage > 0 else me
                if before != me:
                    x = self._receive(before)
                out = mine[stage](*x, **{k: v[i] for k, v in parts.items()})
                x = out if isinstance(out, tuple) else (out,)
                after = self.schedule.rank_of(stage + 1, ranks) if stage + 1 < self.num_stages else me
                if after != me:
                    self._send(x, after)
            if self.holds_last_stage:
                outputs.append(x[0])
                losses.append(self._loss(x[0], targets[i]))
        return (torch.cat(outputs) if outputs else None), losses

    def _send(self, tensors: tuple[torch.Tensor, ...], to: int) -> None:
        peer = dist.get_global_rank(self.send_group, to)
        dist.send_object_list([[(tuple(t.shape), t.dtype) for t in tensors]], dst=peer, group=self.send_group,
                              device=self.device)
        for t in tensors:
            dist.send(t.contiguous(), dst=peer, group=self.send_group)

    def _receive(self, source: int) -> tuple[torch.Tensor, ...]:
        peer = dist.get_global_rank(self.send_group, source)
        meta = [None]
        dist.recv_object_list(meta, src=peer, group=self.send_group, device=self.device)
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0])
        for t in tensors:
            dist.recv(t, src=peer, group=self.send_group)
        return tensors

"""One training step on this process's stages: the step's batch through the pipeline (forward and backward), then
the optimizer step: one vote over every process (the loss, a stop or checkpoint asked for), the global gradient
norm, clipping, fp16's overflow skip, non-finite steps skipped on the device, the moving average and the learning
rate schedule. The loop around it (train/trainer.py) reads, judges and logs each step's record.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.batches import StepBatch
from ..distributed import Topology
from ..pipeline.data_parallel import full, local
from ..pipeline.sequence import average_over_shares
from ..pipeline.timing import StepTimes
from .ema import MovingAverage
from .optim import clip_gradients, global_grad_norm, step_optimizer
from .records import on_host_when_ready, read_record

__all__ = ["TrainingStep"]


class TrainingStep:
    """Forward, backward and the optimizer step of a process's part of the run (`parts`: train/run_parts.py's)."""

    def __init__(self, config: RunConfig, topo: Topology, parts):
        self.config, self.topo = config, topo
        self.runner, self.tied, self.idle_experts = parts.runner, parts.tied, parts.idle_experts
        self.modules, self.params, self.batches = parts.modules, parts.params, parts.batches
        self.optimizer, self.lr_schedule, self.scaler = parts.optimizer, parts.lr_schedule, parts.scaler
        decay = config.train.ema_decay
        self.ema = MovingAverage(self.params, decay) if decay > 0 else None

    def timed(self, step: int) -> bool:
        """Whether the step's stage times are measured (observe.every, and the timeline's step)."""
        obs = self.config.observe
        return obs.enabled and (step % obs.every == 0 or step == obs.timeline_step)

    def take(self, step: int) -> tuple[dict, StepTimes | None]:
        """The whole step, waited for: its record read on the host, and its times."""
        loss, times = self.forward_backward(step)
        return read_record(self.apply_gradients(step, loss, times)), times

    def batch_for(self, step: int) -> StepBatch:
        """This replica's slice of the step's batch, on the device (copied from pinned memory without waiting)."""
        topo = self.topo
        return self.batches.make(step, topo.dp_rank, topo.dp_size).to(topo.device)

    def forward_backward(self, step: int, batch: StepBatch | None = None) -> tuple[torch.Tensor | None, StepTimes | None]:
        """Gradients of the step's batch on this process's stages (summed over micro-batches, averaged over
        replicas by torch's data parallelism: pipeline/data_parallel.py): the mean loss where the last stage lives,
        and this rank's compute intervals (on timed steps). On a GPU the work is queued, not waited for."""
        batch = batch if batch is not None else self.batch_for(step)
        self.optimizer.zero_grad(set_to_none=True)
        result = self.runner.step(batch.noisy, batch.conditions, batch.target, timed=self.timed(step))
        if self.topo.sp_size > 1 and self.topo.dp_size == 1:  # with data parallel, its wrappers average them all
            average_over_shares(self.params, self.runner.sequence)
        self.tied.sum_()  # weights shared by units of several stages: every copy gets the whole gradient
        if self.idle_experts is not None and batch.step_timesteps is not None:  # none for an expert no sample reached
            self.idle_experts.drop(batch.step_timesteps)
        return result

    def batch_gradients(self) -> dict[str, torch.Tensor]:
        """Each parameter of this process's stages (by its diffusers name) with the gradient of the step's mean
        loss over every micro-batch and replica, before clipping: what `apply_gradients` hands the optimizer,
        less the clip factor. Call it between `forward_backward` and `apply_gradients` (checks, debugging). Whole
        tensors: with sharded replicas, every replica must call it (it gathers)."""
        unscale = self._unscale()
        return {name: full(p.grad.detach()) * unscale for m in self.modules for name, p in m.full_named_parameters()
                if p.grad is not None}

    def _unscale(self, loss_scale: float | None = None) -> float:
        """What turns the gradients the schedule leaves (summed over micro-batches, times the fp16 loss scale)
        into the gradient of the batch's mean loss."""
        return 1.0 / (self.config.pipeline.microbatches * (loss_scale or self.scaler.scale))

    def apply_gradients(self, step: int, loss: torch.Tensor | None, times: StepTimes | None = None,
                        stop_asked: bool = False, checkpoint_asked: bool = False) -> dict:
        """Clip by the global norm, step (unless fp16 overflowed anywhere: then the learning-rate schedule waits
        too); the step's record. The gradients were averaged over replicas by `forward_backward`. `stop_asked`
        and `checkpoint_asked`: this process's votes, which reach every process with the loss.

        Nothing here waits for the device, except fp16, which reads the norm before the optimizer (to skip the
        step on every stage alike): the record's loss and norm are read by `read_record`. `times.optimizer_s`
        gets the local clipping and optimizer time (not the collectives, whose waiting for slower stages is
        pipeline bubble, already counted).
        """
        topo, train = self.topo, self.config.train
        lr = self.optimizer.param_groups[0]["lr"]
        scale_used = self.scaler.scale
        # [the loss, processes asked to stop, checkpoint asked]: the loss lives on the last stage of each replica, so
        # the sum over the world averaged over replicas is the step's loss; a vote of any process reaches all alike
        summed = torch.zeros(3, dtype=torch.float64, device=topo.device)
        if loss is not None:
            summed[0] += loss.double() / scale_used
        summed[1], summed[2] = float(stop_asked), float(checkpoint_asked)
        dist.all_reduce(summed)
        total = summed[0]
        norm = global_grad_norm(self.tied.for_norm(self.params), topo.pp_group, topo.device)  # the same on every rank
        overflow = self.scaler.enabled and not bool(torch.isfinite(norm))  # of scaled gradients
        # outside fp16 scaling a non-finite loss or gradient skips the step on the device (the loop counts it)
        nonfinite = (~torch.isfinite(norm) | ~torch.isfinite(total)).float()
        start = time.perf_counter()
        if not overflow:
            factor = clip_gradients(self.params, norm, train.max_grad_norm, unscale=self._unscale())
            step_optimizer(self.optimizer, self.params, factor, skip=None if self.scaler.enabled else nonfinite)
            if self.ema is not None:
                self.ema.update(skipped=None if self.scaler.enabled else nonfinite)
        if times is not None:
            if topo.device.type == "cuda":
                torch.cuda.synchronize(topo.device)
            times.optimizer_s = time.perf_counter() - start
        self.scaler.update(overflow)
        if not overflow:  # a skipped step is no step of the schedule
            self.lr_schedule.step()
        record = {"step": step, "loss": total / topo.replicas, "lr": lr, "grad_norm": norm * self._unscale(scale_used),
                  "nonfinite": nonfinite, "stop_asked": summed[1], "checkpoint_asked": summed[2]}
        if self.scaler.enabled:
            record.update(loss_scale=scale_used, skipped=overflow)
        return on_host_when_ready(record, topo.device)

    def weights_finite(self) -> bool:
        """Whether every trained weight of every process is finite (a collective: every process calls it)."""
        bad = torch.zeros((), device=self.topo.device)
        for p in self.params:
            bad += (~torch.isfinite(local(p.detach()))).any()
        dist.all_reduce(bad)
        return float(bad) == 0

"""The training loop run by every process: each step's batch through this process's stages, the optimizer step,
the step's figures read, judged, logged; evaluation, samples and checkpoints when due; the weights at the end.

A run's parts are built by train/run_parts.py; when it checkpoints, train/checkpointing.py; what stops it early,
train/stopping.py; its final weights, train/weights.py (replica 0's pipeline ranks send their stages' weights to rank
0, which writes model.safetensors). Only rank 0 prints and writes metrics.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.batches import StepBatch
from ..data.prefetch import BatchPrefetcher
from ..distributed import Topology
from ..observe.observer import PipelineObserver, probe_link
from ..pipeline.timing import StepTimes
from ..observe.writers import ScalarWriters, make_writers
from ..pipeline.data_parallel import full, local
from .checkpointing import Checkpoints
from .ema import MovingAverage
from .evaluation import evaluate, write_samples
from .optim import clip_gradients, global_grad_norm, step_optimizer
from .records import StepReport, on_host_when_ready, read_record, step_end
from .run_parts import build_run
from .stopping import NonFiniteSteps, TrainingStopped
from .weights import export_adapters, save_run_weights

__all__ = ["Trainer"]


class Trainer:
    def __init__(self, config: RunConfig, topo: Topology, run_dir: Path):
        self.config, self.topo, self.run_dir = config, topo, run_dir
        parts = build_run(config, topo)
        self.model_config, self.model_shapes = parts.model_config, parts.model_shapes
        self.modules, self.params, self.tied = parts.modules, parts.params, parts.tied
        self.scaler, self.runner, self.idle_experts = parts.scaler, parts.runner, parts.idle_experts
        self.optimizer, self.lr_schedule = parts.optimizer, parts.lr_schedule
        self.text, self.data, self.feed, self.batches = parts.text, parts.data, parts.feed, parts.batches
        self.held_out, self.sample_shape = parts.held_out, parts.sample_shape
        self.vae = self.data.vae  # image folders: decodes samples during training
        skipped = self.data.skipped  # image folders: files left out, counted in every metrics line
        self.skipped_images = len(skipped) if skipped is not None else None
        self.writers = make_writers(config, run_dir) if topo.is_main else ScalarWriters([])
        self.observer = PipelineObserver(config, topo, run_dir, parts.bytes_moved, probe_link(topo), self.writers)
        self.nonfinite = NonFiniteSteps(config.train.max_bad_steps, run_dir, topo.is_main)
        self.checkpoints = Checkpoints(config, topo, run_dir)
        self.stop_requested = False  # set by SIGTERM / SIGINT (train/worker.py): checkpoint after this step and stop
        self.overlap_steps = topo.device.type == "cuda"  # read each step's figures only once the next is queued
        decay = config.train.ema_decay
        self.ema = MovingAverage(self.params, decay) if decay > 0 else None

    def _timed(self, step: int) -> bool:
        obs = self.config.observe
        return obs.enabled and (step % obs.every == 0 or step == obs.timeline_step)

    def _step(self, step: int) -> tuple[dict, StepTimes | None]:
        loss, times = self.forward_backward(step)
        return read_record(self.apply_gradients(step, loss, times)), times

    def batch_for(self, step: int) -> StepBatch:
        """This replica's slice of the step's batch, on the device (copied from pinned memory without waiting)."""
        topo = self.topo
        return self.batches.make(step, topo.dp_rank, topo.dp_size).to(topo.device)

    def forward_backward(self, step: int, batch: StepBatch | None = None) -> tuple[torch.Tensor | None, StepTimes | None]:
        """Gradients of the step's batch on this process's stages (summed over micro-batches, averaged over
        replicas by torch's data parallelism: pipeline/data_parallel.py): the mean loss where the
        last stage lives,
        and this rank's compute intervals (on timed steps). On a GPU the work is queued, not waited for."""
        batch = batch if batch is not None else self.batch_for(step)
        self.optimizer.zero_grad(set_to_none=True)
        result = self.runner.step(batch.noisy, batch.conditions, batch.target, timed=self._timed(step))
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

    def apply_gradients(self, step: int, loss: torch.Tensor | None, times: StepTimes | None = None) -> dict:
        """Clip by the global norm, step (unless fp16 overflowed anywhere: then the learning-rate schedule waits
        too); the step's record. The gradients were averaged over replicas by `forward_backward`.

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
        if self.stop_requested:
            summed[1] = 1.0
        if topo.is_main and self.checkpoints.overdue():  # [2]: one clock decides when for every process
            summed[2] = 1.0
        dist.all_reduce(summed)
        total = summed[0]
        norm = global_grad_norm(self.tied.for_norm(self.params), topo.pp_group, topo.device)  # the same on every rank
        overflow = self.scaler.enabled and not bool(torch.isfinite(norm))  # of scaled gradients
        # outside fp16 scaling a non-finite loss or gradient skips the step on the device (`_finish` counts it)
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
        record = {"step": step, "loss": total / topo.dp_size, "lr": lr, "grad_norm": norm * self._unscale(scale_used),
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

    def resume(self) -> int:
        """Weights, AdamW state and progress from the run folder's newest checkpoint; the step to run next."""
        return self.checkpoints.resume(self)

    def save(self) -> None:
        """The run's final weights (train/weights.py): the moving average's, with train.ema_decay."""
        with self.outputs_weights():
            save_run_weights(self)

    def outputs_weights(self):
        """A context in which the parameters hold the weights the run's outputs show (samples, exports, the final
        weights): the moving average's with train.ema_decay, else the trained ones."""
        return self.ema.swapped_in() if self.ema is not None else nullcontext()

    def _due(self, step: int, every: int) -> bool:
        """Every `every` steps and after the last one (0: never)."""
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.config.train.max_steps)

    def _epochs_due(self, step: int) -> bool:
        """After the step that ends every checkpoint.export_every_epochs-th epoch of the data, and the last one."""
        every = self.config.checkpoint.export_every_epochs
        if not every:
            return False
        span = every * self.data.steps_per_epoch(self.config.train.batch_size)
        return math.floor((step + 1) / span + 1e-9) > math.floor(step / span + 1e-9) or (
            step + 1 == self.config.train.max_steps)

    def fit(self, start_step: int = 0) -> None:
        """All steps. On a GPU a step's figures are read once the next step's forward and backward are queued,
        waiting for that step alone (an event, not the stream: `_on_host_when_ready`), so the device never waits
        for the host between steps; the next batch is made in the background. On a CPU the host is the device:
        each step is read as it ends."""
        train, topo = self.config.train, self.topo
        if start_step >= train.max_steps:  # the launcher checks max_steps; epochs are counted only here
            raise TrainingStopped(f"resuming at step {start_step}, but the run is {train.max_steps} steps long "
                                  f"(train.epochs = {train.epochs}); raise train.epochs to train on")
        self.next_step = start_step  # the step after the last one finished: what a checkpoint resumes at
        prefetcher = BatchPrefetcher(self.batch_for, topo.device)
        report = StepReport(self.run_dir, train.max_steps, train.batch_size, train.log_every, self.writers,
                            topo.is_main, topo.device, start_step, self.data.steps_per_epoch(train.batch_size))
        try:
            with report:
                waiting = None  # the previous step: (step, record, times)
                for step in range(start_step, train.max_steps):
                    batch = prefetcher.take(step)
                    if step + 1 < train.max_steps:
                        prefetcher.ask(step + 1)
                    loss, times = self.forward_backward(step, batch)
                    if waiting is not None and self._finish(report, *waiting) == "stop":
                        waiting = None  # this step's gradients are dropped: the weights are the stopped step's
                        break
                    waiting = (step, self.apply_gradients(step, loss, times), times)
                    if not self.overlap_steps:
                        action, waiting = self._finish(report, *waiting), None
                        if action == "stop":
                            break
                if waiting is not None:
                    self._finish(report, *waiting)
        finally:
            prefetcher.close()
        self.writers.close()
        if self.nonfinite.streak or not self.weights_finite():
            self.checkpoints.finish()
            self.nonfinite.stop_unfinished(self.next_step)
        self.save()
        checkpoints = self.config.checkpoint.every > 0 or self.config.checkpoint.every_minutes > 0
        if checkpoints and self.config.output.save_weights:
            self.checkpoints.write(self, self.next_step, wait=True)
        self.checkpoints.finish()

    def _finish(self, report: StepReport, step: int, record: dict, times: StepTimes | None) -> str:
        """Read, time, judge and log a finished step; returns the action every rank takes (a checkpoint is
        taken here)."""
        end = step_end(record)
        self.next_step = step + 1
        record = read_record(record)
        report.time(record, end)
        self.nonfinite.judge(step, record)
        if self.skipped_images is not None:  # image folders
            record["skipped_images"] = self.skipped_images
            indices = self.data.batch_indices(step, self.config.train.batch_size, self.config.train.seed)
            record["bucket"] = self.data.placements[indices[0]].name
        if self._due(step, self.config.train.eval_every):  # its time counts in the next step's
            record.update(evaluate(self))
        if self._due(step, self.config.sample.every):
            with self.outputs_weights():
                write_samples(self, step)
        if self._due(step, self.config.checkpoint.export_every) or self._epochs_due(step):
            with self.outputs_weights():
                written = export_adapters(self, step + 1)
            if written is not None:
                print(f"exported {written}", flush=True)
        interrupted = record.pop("stop_asked") > 0
        overdue = record.pop("checkpoint_asked") > 0
        action = self.observer.after_step(step, record, times) if times is not None else "continue"
        report.write(step, record)
        if interrupted:  # every process: each read the same all-reduced vote
            path = self.checkpoints.write(self, step + 1, wait=True)
            raise TrainingStopped(f"interrupted after step {step}; checkpoint {path}. Continue with: diffpipe train "
                                  f"CONFIG --resume {self.run_dir}")
        # no checkpoint after a skipped step: the newest one stays the last good one; a warning (the monitor's
        # "warn") never cancels a scheduled one, and "stop" gets its checkpoint after the loop
        due = overdue or self.checkpoints.due(step)
        if self.nonfinite.streak == 0 and (action == "checkpoint" or (action != "stop" and due)):
            self.checkpoints.write(self, step + 1)
        if action == "stop" and self.topo.is_main:  # the save after the loop keeps the weights
            print(f"stopped after step {step} (observe.on_anomaly = \"stop\"); weights saved", flush=True)
        return action

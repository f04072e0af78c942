"""The training loop run by every process: each step (train/step.py: the batch through this process's stages, the
optimizer step) queued, the step's figures read, judged, logged; evaluation, samples and checkpoints when due; the
weights at the end.

A run's parts are built by train/run_parts.py; when it checkpoints, train/checkpoint_schedule.py; what stops it early,
train/stopping.py; its final weights, train/weights.py (replica 0's pipeline ranks send their stages' weights to rank
0, which writes model.safetensors). Only rank 0 prints and writes metrics.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

from ..config import RunConfig
from ..data.prefetch import BatchPrefetcher
from ..distributed import Topology
from ..observe.observer import PipelineObserver, probe_all_to_all, probe_link
from ..pipeline.timing import StepTimes
from ..observe.writers import ScalarWriters, make_writers
from .checkpoint_schedule import Checkpoints
from .evaluation import evaluate, write_samples
from .records import StepReport, read_record, step_end
from .run_parts import build_run
from .step import TrainingStep
from .stopping import NonFiniteSteps, TrainingStopped
from .weights import export_adapters, save_run_weights

__all__ = ["Trainer"]


class Trainer:
    def __init__(self, config: RunConfig, topo: Topology, run_dir: Path):
        self.config, self.topo, self.run_dir = config, topo, run_dir
        parts = build_run(config, topo)
        self.model_config, self.model_shapes = parts.model_config, parts.model_shapes
        self.modules, self.params = parts.modules, parts.params
        self.scaler, self.runner = parts.scaler, parts.runner
        self.optimizer, self.lr_schedule = parts.optimizer, parts.lr_schedule
        self.text, self.data, self.feed, self.batches = parts.text, parts.data, parts.feed, parts.batches
        self.steps = TrainingStep(config, topo, parts)  # forward, backward, the optimizer step
        self.ema = self.steps.ema
        self.held_out, self.sample_shape = parts.held_out, parts.sample_shape
        self.vae = self.data.vae  # image folders: decodes samples during training
        skipped = self.data.skipped  # image folders: files left out, counted in every metrics line
        self.skipped_images = len(skipped) if skipped is not None else None
        self.writers = make_writers(config, run_dir) if topo.is_main else ScalarWriters([])
        all_to_all = probe_all_to_all(topo)
        if all_to_all and topo.is_main:
            print(f"all-to-alls among the {topo.sp_size} processes of each sample: {1e-9 / all_to_all:.2f} GB/s "
                  "measured at start; the time a step spends in them is each stage's all_to_all_s (a part of "
                  "compute_s) in the step lines and metrics.jsonl", flush=True)
        self.observer = PipelineObserver(config, topo, run_dir, parts.bytes_moved, probe_link(topo), self.writers,
                                         all_to_all)
        self.nonfinite = NonFiniteSteps(config.train.max_bad_steps, run_dir, topo.is_main)
        self.checkpoints = Checkpoints(config, topo, run_dir)
        self.stop_requested = False  # set by SIGTERM / SIGINT (train/worker.py): checkpoint after this step and stop
        self.overlap_steps = topo.device.type == "cuda"  # read each step's figures only once the next is queued

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
        prefetcher = BatchPrefetcher(self.steps.batch_for, topo.device)
        report = StepReport(self.run_dir, train.max_steps, train.batch_size, train.log_every, self.writers,
                            topo.is_main, topo.device, start_step, self.data.steps_per_epoch(train.batch_size))
        try:
            with report:
                waiting = None  # the previous step: (step, record, times)
                for step in range(start_step, train.max_steps):
                    batch = prefetcher.take(step)
                    if step + 1 < train.max_steps:
                        prefetcher.ask(step + 1)
                    loss, times = self.steps.forward_backward(step, batch)
                    if waiting is not None and self._finish(report, *waiting) == "stop":
                        waiting = None  # this step's gradients are dropped: the weights are the stopped step's
                        break
                    votes = dict(stop_asked=self.stop_requested,  # one clock decides a checkpoint for every process
                                 checkpoint_asked=topo.is_main and self.checkpoints.overdue())
                    waiting = (step, self.steps.apply_gradients(step, loss, times, **votes), times)
                    if not self.overlap_steps:
                        action, waiting = self._finish(report, *waiting), None
                        if action == "stop":
                            break
                if waiting is not None:
                    self._finish(report, *waiting)
        finally:
            prefetcher.close()
        self.writers.close()
        if self.nonfinite.streak or not self.steps.weights_finite():
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

"""The training loop run by every process: its stages, the step's batch, optimizer, metrics, weights.

Every process builds the backbone on the meta device and gives weights only to the units of its own stages
(each module seeded alike whatever the stage count: models/materialise.py), then moves them to its device.
Only rank 0 prints and writes metrics; replica 0's pipeline ranks send their stages' weights to rank 0, which
writes model.safetensors (train/weights.py); every process writes its part of each checkpoint (train/checkpoint.py).
"""
from __future__ import annotations

import faulthandler
import json
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..build import (boundary_traffic, build_backbone, build_dataset, build_stages, build_text_encoder, feed,
                     sample_shape)
from ..config import RunConfig
from ..data.batches import BatchMaker, StepBatch
from ..data.prefetch import BatchPrefetcher
from ..models.lora import lora_metadata, lora_scale, lora_weights, merge_lora
from ..models.text import TextEncoder
from ..distributed import Topology, end_process_group, init_topology
from ..observe.observer import PipelineObserver, probe_link
from ..observe.timing import Mark, StepTimes
from ..observe.writers import ScalarWriters, make_writers
from ..pipeline.data_parallel import full, local, spread_over_replicas
from ..pipeline.runtime import PipelineRunner
from ..pipeline.schedules import schedule_named
from ..pipeline.traffic import Crossing
from ..precision import frozen_storage
from ..pipeline.split import stage_specs
from ..pipeline.tied import TiedGradients, tied_parameters
from ..planner.plan import resolve_memory, resolve_stages
from .optim import (LossScaler, clip_gradients, global_grad_norm, make_optimizer,
                    step_optimizer)
from .checkpoint import PendingCheckpoint, latest_checkpoint, load_checkpoint, model_shapes, save_checkpoint
from ..sampling import grid_prompts
from .evaluation import evaluate, held_out_data, write_samples
from .machines import agreed_checkpoint, complete_checkpoint
from .records import StepReport
from .weights import gather_weights, original_base
from ..written_files import save_tensors

__all__ = ["train_worker", "Trainer", "TrainingStopped", "read_record", "step_end"]


class TrainingStopped(RuntimeError):
    """The run cannot go on (its loss or gradients stay non-finite); the message says why and what to do."""


class _ScaledMSE:
    """Mean squared error in fp32, times the current loss scale (1 unless fp16)."""

    def __init__(self, scaler: LossScaler):
        self.scaler = scaler

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), target.float()) * self.scaler.scale


class Trainer:
    def __init__(self, config: RunConfig, topo: Topology, run_dir: Path):
        self.config, self.topo, self.run_dir = config, topo, run_dir
        p = config.pipeline
        backbone = build_backbone(config, "meta")
        self.model_config = dict(backbone.model.config)
        self.model_shapes = model_shapes(backbone.model)
        m = config.memory  # settings left to the planner: the launcher chooses them before starting processes
        if not isinstance(p.split, list) or "auto" in (m.block_swap, m.optimizer_state):  # here where it did not
            for key, value in resolve_memory(config, backbone).changes(m).items():
                setattr(m, key, value)
        if not isinstance(p.split, list) or not isinstance(p.checkpointing, list):
            p.split, p.checkpointing = resolve_stages(config, backbone)
        specs = stage_specs(backbone, p.split)
        schedule = schedule_named(p.schedule)
        mine = schedule.stage_indices(topo.pp_rank, p.stages, p.virtual_stages)
        self.modules = build_stages(config, backbone, specs, mine, topo.device, p.checkpointing)
        tied = tied_parameters(backbone, specs)  # by the backbone's parameter objects, which wrapping replaces:
        spread_over_replicas(self.modules, topo, p.data_parallel_shard)  # before anything keeps the parameters
        lr_scale = config.train.stage_lr_scale or [1.0] * len(specs)
        seen: set[int] = set()  # a weight tied between two stages of this process is one parameter, trained once
        groups = [([q for q in m.parameters() if q.requires_grad and not (id(q) in seen or seen.add(id(q)))],
                   lr_scale[i]) for m, i in zip(self.modules, mine)]
        self.params = [q for params, _ in groups for q in params]
        held = {name: q for m in self.modules for name, q in m.full_named_parameters()}
        self.tied = TiedGradients(tied, held, mine, topo, p.data_parallel_shard)
        self.scaler = LossScaler(config.train.precision == "fp16")
        self.runner = PipelineRunner(self.modules, mine, len(specs), topo.pp_group, topo.device, p.schedule,
                                     p.microbatches, _ScaledMSE(self.scaler), timeable=config.observe.enabled,
                                     send_group=topo.send_group)
        self.optimizer, self.lr_schedule = make_optimizer(groups, config.train, config.memory.optimizer_state)
        self.text = build_text_encoder(config, backbone).to(topo.device)
        self.data = build_dataset(config, backbone, self.text, topo.device, topo.rank, topo.world_size, dist.barrier)
        self.feed = feed(config, backbone)
        self.batches = BatchMaker(self.data, self.text, config.train, config.data.caption_dropout, self.feed)
        self.held_out = held_out_data(config, self.data)
        self.vae = self.data.vae  # image folders: decodes samples during training
        # every caption the run will ask for computed already (cached or kept): the text encoders leave the GPU
        prompts = grid_prompts(config, lambda: self.data.captions)
        self.text.keep(prompts, config.data.text_cache_gib)
        asked = [*self.data.captions, "", *(self.held_out.captions if self.held_out is not None else []), *prompts]
        if self.text.park(asked) and topo.is_main:
            print("text encoders moved to host memory: every caption is encoded already", flush=True)
        self.sample_shape = sample_shape(config, backbone)
        skipped = self.data.skipped  # image folders: files left out, counted in every metrics line
        self.skipped_images = len(skipped) if skipped is not None else None
        summary = self.data.summary(self.held_out)
        if topo.is_main and summary:
            print(summary, flush=True)
        moved = _bytes_moved(boundary_traffic(config, backbone, p.split), mine, len(specs), p.microbatches,
                             lambda s: schedule.rank_of(s, p.stages))
        self.writers = make_writers(config, run_dir) if topo.is_main else ScalarWriters([])
        self.observer = PipelineObserver(config, topo, run_dir, moved, probe_link(topo), self.writers)
        self.bad_streak, self.skipped_steps = 0, 0  # steps skipped for non-finite values: in a row, in all
        self.stop_requested = False  # set by SIGTERM / SIGINT (train_worker): checkpoint after this step and stop
        self._pending, self._background_group = None, None  # a checkpoint written in the background, its group
        self._last_checkpoint = time.monotonic()  # for checkpoint.every_minutes
        self.overlap_steps = topo.device.type == "cuda"  # read each step's figures only once the next is queued

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
        if topo.is_main and self._checkpoint_overdue():  # [2]: one clock decides when for every process
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
        return _on_host_when_ready(record, topo.device)

    def checkpoint(self, next_step: int, wait: bool = False) -> Path | None:
        """A checkpoint to resume from before `next_step` (every process takes part): written now (its path is
        returned), or with `checkpoint.asynchronous` (unless `wait`) started in the background and sealed by the
        next call (None)."""
        self.finish_checkpoint()
        if not self.weights_finite():  # every process votes alike: the newest checkpoint stays the last finite one
            if self.topo.is_main:
                kept = latest_checkpoint(self.run_dir)
                print(f"warning: the weights before step {next_step} are not finite: no checkpoint written; the newest "
                      f"is {kept.name if kept else 'none'}", flush=True)
            return None
        background = None
        if self.config.checkpoint.asynchronous and not wait:
            if self._background_group is None:  # created once, by every process alike
                self._background_group = dist.new_group(backend="gloo")
            background = self._background_group
        done = save_checkpoint(self, next_step, self.config.checkpoint.keep, background)
        self._last_checkpoint = time.monotonic()
        if isinstance(done, PendingCheckpoint):
            self._pending = done
            return None
        if self.topo.is_main:
            print(f"checkpoint {done}", flush=True)
        return done

    def weights_finite(self) -> bool:
        """Whether every trained weight of every process is finite (a collective: every process calls it)."""
        bad = torch.zeros((), device=self.topo.device)
        for p in self.params:
            bad += (~torch.isfinite(local(p.detach()))).any()
        dist.all_reduce(bad)
        return float(bad) == 0

    def finish_checkpoint(self) -> None:
        """Seal the checkpoint being written in the background, if any (waits for its writes)."""
        if self._pending is not None:
            path, self._pending = self._pending.finish(), None
            if self.topo.is_main:
                print(f"checkpoint {path}", flush=True)

    def resume(self) -> int:
        """Weights, AdamW state and progress from the run folder's newest checkpoint; the step to run next."""
        path = agreed_checkpoint(self.run_dir)  # machines without a shared disk: each folder holds its own parts
        received = complete_checkpoint(path)
        if received and self.topo.is_main:
            print(f"resuming: received {received / 2**20:.1f} MiB of {path.name} from the other machines", flush=True)
        return load_checkpoint(self, path)

    def _checkpoint_overdue(self) -> bool:
        minutes = self.config.checkpoint.every_minutes
        return minutes > 0 and time.monotonic() - self._last_checkpoint >= 60 * minutes

    def _due(self, step: int, every: int) -> bool:
        """Every `every` steps and after the last one (0: never)."""
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.config.train.max_steps)

    def _checkpoint_due(self, step: int) -> bool:
        every = self.config.checkpoint.every
        return every > 0 and (step + 1) % every == 0 and step + 1 < self.config.train.max_steps

    def fit(self, start_step: int = 0) -> None:
        """All steps. On a GPU a step's figures are read once the next step's forward and backward are queued,
        waiting for that step alone (an event, not the stream: `_on_host_when_ready`), so the device never waits
        for the host between steps; the next batch is made in the background. On a CPU the host is the device:
        each step is read as it ends."""
        train, topo = self.config.train, self.topo
        self.next_step = start_step  # the step after the last one finished: what a checkpoint resumes at
        prefetcher = BatchPrefetcher(self.batch_for, topo.device)
        report = StepReport(self.run_dir, train.max_steps, train.batch_size, train.log_every, self.writers,
                            topo.is_main, topo.device, start_step)
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
        if self.bad_streak or not self.weights_finite():
            self._stop_unfinished()
        self.save()
        checkpoints = self.config.checkpoint.every > 0 or self.config.checkpoint.every_minutes > 0
        if checkpoints and self.config.output.save_weights:
            self.checkpoint(self.next_step, wait=True)
        self.finish_checkpoint()

    def _stop_unfinished(self) -> None:
        """A run whose last steps were non-finite (fewer than train.max_bad_steps) or whose weights are: no weights,
        no final checkpoint and no samples from them; the newest checkpoint stays the result, and the run fails."""
        self.finish_checkpoint()
        kept = latest_checkpoint(self.run_dir)
        then = (f"; the newest checkpoint, {kept.name}, is the last good state: resume from it with --resume "
                f"{self.run_dir} and a change" if kept is not None else "; no checkpoint was written before them")
        what = (f"the last {self.bad_streak} step(s), up to step {self.next_step - 1}, had a non-finite loss or "
                "gradients (skipped)" if self.bad_streak else f"the weights after step {self.next_step - 1} are not finite")
        raise TrainingStopped(f"{what}: no model.safetensors was written. Lower train.learning_rate, check the data, "
                              f"or use bf16 instead of fp16{then}")

    def _finish(self, report: StepReport, step: int, record: dict, times: StepTimes | None) -> str:
        """Read, time, judge and log a finished step; returns the action every rank takes (a checkpoint is
        taken here)."""
        end = step_end(record)
        self.next_step = step + 1
        record = read_record(record)
        report.time(record, end)
        self._judge_finite(step, record)
        if self.skipped_images is not None:  # image folders
            record["skipped_images"] = self.skipped_images
            indices = self.data.batch_indices(step, self.config.train.batch_size, self.config.train.seed)
            record["bucket"] = self.data.placements[indices[0]].name
        if self._due(step, self.config.train.eval_every):  # its time counts in the next step's
            record.update(evaluate(self))
        if self._due(step, self.config.sample.every):
            write_samples(self, step)
        interrupted = record.pop("stop_asked") > 0
        overdue = record.pop("checkpoint_asked") > 0
        action = self.observer.after_step(step, record, times) if times is not None else "continue"
        report.write(step, record)
        if interrupted:  # every process: each read the same all-reduced vote
            path = self.checkpoint(step + 1, wait=True)
            raise TrainingStopped(f"interrupted after step {step}; checkpoint {path}. Continue with: diffpipe train "
                                  f"CONFIG --resume {self.run_dir}")
        # no checkpoint after a skipped step: the newest one stays the last good one; a warning (the monitor's
        # "warn") never cancels a scheduled one, and "stop" gets its checkpoint after the loop
        due = overdue or self._checkpoint_due(step)
        if self.bad_streak == 0 and (action == "checkpoint" or (action != "stop" and due)):
            self.checkpoint(step + 1)
        if action == "stop" and self.topo.is_main:  # the save after the loop keeps the weights
            print(f"stopped after step {step} (observe.on_anomaly = \"stop\"); weights saved", flush=True)
        return action

    def _judge_finite(self, step: int, record: dict) -> None:
        """Count steps skipped for a non-finite loss or gradient (fp16 overflows included: a run that overflows
        every step is broken too); warn at the first of a streak, stop after `train.max_bad_steps` in a row.
        Every rank reads the same all-reduced figures, so every rank stops alike."""
        bad = bool(record.pop("nonfinite")) or bool(record.get("skipped"))
        self.bad_streak = self.bad_streak + 1 if bad else 0
        self.skipped_steps += bad
        record["skipped_steps"] = self.skipped_steps
        limit = self.config.train.max_bad_steps
        if bad and self.bad_streak == 1 and self.topo.is_main:
            what = "fp16 overflow" if record.get("skipped") else "loss or gradients not finite"
            print(f"warning: step {step}: {what} (loss {record['loss']:.4g}, gradient norm {record['grad_norm']:.4g}); "
                  f"step skipped, weights unchanged; {limit} in a row stop the run (train.max_bad_steps)", flush=True)
        if self.bad_streak >= limit:
            kept = latest_checkpoint(self.run_dir)
            then = (f"; resume from {kept.name} with --resume {self.run_dir} and a change" if kept is not None
                    else "; no checkpoint was written before it")
            raise TrainingStopped(
                f"{limit} steps in a row up to step {step} had a non-finite loss or gradients (skipped: the weights are "
                f"those before them). Lower train.learning_rate, check the data, or use bf16 instead of fp16{then}")

    def save(self) -> None:
        """model.safetensors (every stage's weights, sent to rank 0 over the process group; with LoRA, merged into
        the base, and the adapters alone in lora.safetensors), model_config.json and the text encoder (unless it is
        a pipeline folder's), in rank 0's run folder."""
        if not self.config.output.save_weights:
            return
        merged = gather_weights(self.modules, self.topo)
        if self.topo.is_main:
            if self.config.adapter.type == "lora":  # the adapters alone, and the base with them merged in
                save_tensors(lora_weights(merged), self.run_dir / "lora.safetensors",
                             metadata=lora_metadata(self.config, self.feed.family.lora_targets))
                # merged in fp32 into the base as model.path holds it, whatever memory.base_dtype stored it in: a
                # bf16 sum would round the update away, and a stored copy's rounding would stay in the result
                stored = frozen_storage(self.config, self.topo.device.type)
                if stored.dtype != torch.float32 or stored.linear:
                    merged = original_base(self.config, merged)
                merged = {k: v.float() if v.is_floating_point() else v for k, v in merged.items()}
                merged = merge_lora(merged, lora_scale(self.config.adapter))
            save_tensors(merged, self.run_dir / "model.safetensors")
            (self.run_dir / "model_config.json").write_text(json.dumps(self.model_config, indent=1, default=list))
            if isinstance(self.text, TextEncoder):  # a pipeline folder's text encoders stay in it
                self.text.to("cpu")
                self.text.save(self.run_dir / "text_encoder")
        dist.barrier()


_END = "_end"  # the record's Mark: where on the device the step ended, after its figures were copied to the host


def _on_host_when_ready(record: dict, device: torch.device) -> dict:
    """The record with its GPU tensors copied into pinned host memory once the GPU gets there, and a Mark (a CUDA
    event; on a CPU the clock) at the step's end. Reading a GPU tensor (`.item()`) would wait for everything queued
    on the stream, the next step's forward and backward included, and leave the GPU idle while the host catches
    up; waiting on the mark waits for this step alone, and the marks of consecutive steps time them on the device."""
    record = dict(record)
    for key, value in record.items():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            record[key] = host.copy_(value, non_blocking=True)
    record[_END] = Mark(device)
    return record


def step_end(record: dict) -> Mark:
    """Where on the device the step of a record (from `apply_gradients`) ended."""
    return record[_END]


def read_record(record: dict) -> dict:
    """The record with its tensors read as numbers (on a GPU this waits for the step the record is of)."""
    if _END in record:
        record[_END].wait()
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items() if k != _END}


def _bytes_moved(crossings: list[Crossing], mine: list[int], stages: int, microbatches: int, rank_of) -> int:
    """Bytes this rank sends and receives in a step: activations forward, their gradients back (none between two
    stages of this process: V-shaped schedules put neighbouring stages on one)."""
    per_boundary = {c.after_stage: c.bytes for c in crossings}
    total = 0
    for s in mine:
        if s > 0 and rank_of(s - 1) != rank_of(s):
            total += per_boundary.get(s - 1, 0)
        if s < stages - 1 and rank_of(s + 1) != rank_of(s):
            total += per_boundary.get(s, 0)
    return 2 * microbatches * total


def train_worker(config_data: dict, run_dir: str, resume: bool = False) -> None:
    """Entry point of each process (spawned or under torchrun)."""
    from ..config import build_config
    from transformers.utils import logging as transformers_logging

    from ..distributed import resolve_device_kind

    transformers_logging.disable_progress_bar()  # the text encoder's save would print a bar per file
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run: `kill -USR1 PID` prints where each thread is

    config = build_config(config_data)
    topo = init_topology(config.pipeline.stages, config.pipeline.data_parallel,
                         resolve_device_kind(config.train.device), config.train.collective_timeout_minutes)
    _train(Trainer(config, topo, Path(run_dir)), resume)
    end_process_group()  # only after success: distributed.end_process_group says why


def _train(trainer: Trainer, resume: bool) -> None:
    """Train, a signal (SIGTERM, or Ctrl-C, which reaches every process) asking every process to checkpoint and
    stop. The handlers are put back before returning: one left installed would keep the trainer, with the pipeline's
    pending communication objects, alive until the interpreter's exit, after the process group is destroyed, where
    freeing them aborted the process now and then ("terminate called without an active exception": 2 runs in 10)."""
    def ask_to_stop(signum, frame) -> None:
        trainer.stop_requested = True

    previous = {sig: signal.signal(sig, ask_to_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        trainer.fit(trainer.resume() if resume else 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""What a run writes besides weights: metrics.jsonl, loss.png, and the console progress bar."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

from ..pipeline.timing import Mark  # noqa: E402

__all__ = ["MetricsLog", "StepReport", "is_logged", "plot_loss", "make_progress", "NullProgress", "on_host_when_ready",
           "step_end", "read_record"]


class MetricsLog:
    """Appends one JSON object per logged step; a resumed run keeps the lines of the steps before it."""

    def __init__(self, path: Path, start_step: int = 0):
        self.path = path
        kept = [r for r in read_metrics(path) if r["step"] < start_step] if start_step and path.is_file() else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, out: Path) -> None:
    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
    if len(losses) >= 10:
        k = max(2, len(losses) // 20)
        smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.5, label=f"mean of {k + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if any(loss > 0 for loss in losses):  # (a run whose masks are all black has nothing to put on a log scale)
        ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


class NullProgress:
    """Stands in for the progress bar on ranks that do not print."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass


def make_progress() -> Progress:
    return Progress(TextColumn("step {task.completed}/{task.total}"), TextColumn("epoch {task.fields[epoch]}"),
                    BarColumn(),
                    TextColumn("loss {task.fields[loss]}"),
                    TextColumn("{task.fields[samples_per_s]} samples/s (global batch {task.fields[batch]})"),
                    TextColumn("ETA"), TimeRemainingColumn())


def is_logged(step: int, max_steps: int, log_every: int) -> bool:
    """Steps written to metrics.jsonl: every `log_every`-th and the last."""
    return step % log_every == 0 or step == max_steps - 1


class StepReport:
    """Each finished step: its wall time, then metrics.jsonl and TensorBoard every `log_every` steps and the
    progress bar (on the main rank; elsewhere only the time)."""

    def __init__(self, run_dir: Path, max_steps: int, batch_size: int, log_every: int, writers, is_main: bool,
                 device: torch.device, start_step: int = 0, steps_per_epoch: float = 1.0):
        self.max_steps, self.batch_size, self.log_every, self.writers = max_steps, batch_size, log_every, writers
        self.start_step, self.steps_per_epoch = start_step, steps_per_epoch
        self.log = MetricsLog(run_dir / "metrics.jsonl", start_step) if is_main else None
        self.progress = make_progress() if is_main else NullProgress()
        self.device, self.task, self.last = device, 0, None

    def __enter__(self) -> "StepReport":
        self.progress.__enter__()
        self.task = self.progress.add_task("train", total=self.max_steps, completed=self.start_step, loss="-",
                                           samples_per_s="-", batch=self.batch_size, epoch=self._epoch(self.start_step))
        self.last = Mark(self.device)  # the loop begins: the first step is timed from here
        return self

    def __exit__(self, *exc) -> bool:
        return self.progress.__exit__(*exc)

    def time(self, record: dict, end: Mark) -> None:
        """The step's time on the device: from the previous step's end (the first: the loop's start) to `end`.
        On a GPU the host runs ahead of the device, so its own clock would give a step the time the host spent
        waiting there (the last step of a run ended on the host long before it did on the GPU)."""
        seconds, self.last = end.seconds_since(self.last), end
        record.update(step_time_s=round(seconds, 5), samples_per_s=self.batch_size / seconds)

    def _epoch(self, steps_done: int) -> float:
        """Epochs of the training data gone through after `steps_done` steps."""
        return round(steps_done / self.steps_per_epoch, 3)

    def write(self, step: int, record: dict) -> None:
        record["epoch"] = self._epoch(step + 1)
        if self.log is not None and is_logged(step, self.max_steps, self.log_every):
            self.log.write(record)
            for key in ("loss", "lr", "grad_norm", "samples_per_s"):
                if key in record:
                    self.writers.add_scalar(f"train/{key}", record[key], step)
            for key in (k for k in record if k.startswith("eval_loss")):
                self.writers.add_scalar(f"eval/{key.removeprefix('eval_')}", record[key], step)
        self.progress.update(self.task, completed=step + 1, loss=f"{record['loss']:.4f}",
                             samples_per_s=f"{record['samples_per_s']:.1f}", epoch=record["epoch"])


_END = "_end"  # the record's Mark: where on the device the step ended, after its figures were copied to the host


def on_host_when_ready(record: dict, device: torch.device) -> dict:
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
    """Where on the device the step of a record (from `TrainingStep.apply_gradients`) ended."""
    return record[_END]


def read_record(record: dict) -> dict:
    """The record with its tensors read as numbers (on a GPU this waits for the step the record is of)."""
    if _END in record:
        record[_END].wait()
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items() if k != _END}

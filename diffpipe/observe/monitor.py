"""Warn when a stage slows down: rolling per-stage statistics of step and idle (communication) latency.

A stage whose latest figure exceeds `factor` x its rolling mean (after `warmup` steps) raises an alert; the
trainer then does what `observe.on_anomaly` says: warn, checkpoint (save the weights now) or stop (save and
exit cleanly). Nothing re-plans.

A step is judged against earlier steps of its own batch shape (its bucket), each shape with its own history: a
1024^2 bucket's step is slower than a 512^2 one's by its size, not by a slowdown. A shape's first step is neither
judged nor counted: it compiles that shape's graphs (`pipeline.compile`) and tunes its kernels, tens of seconds that
once made a new bucket look like a 6x slowdown (and would stop a run with `observe.on_anomaly = "stop"`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Alert", "PipelineMonitor"]


@dataclass(frozen=True)
class Alert:
    stage: int
    rank: int
    metric: str
    value_s: float
    mean_s: float
    shape: str | None = None

    def message(self, step: int) -> str:
        bucket = f" (bucket {self.shape})" if self.shape else ""
        return (f"step {step}: stage {self.stage} (rank {self.rank}) {self.metric} {self.value_s * 1e3:.1f} ms is "
                f"{self.value_s / self.mean_s:.1f}x its rolling mean {self.mean_s * 1e3:.1f} ms{bucket}")


class PipelineMonitor:
    def __init__(self, factor: float = 2.5, window: int = 20, warmup: int = 5, floor_s: float = 1e-3):
        self.factor, self.window, self.warmup, self.floor_s = factor, window, warmup, floor_s
        self._history: dict[tuple[int, int, str | None, str], deque] = {}

    def observe(self, stage: int, rank: int, figures: dict[str, float], shape: str | None = None) -> list[Alert]:
        """Add one step's figures (seconds) of a stage on a batch of `shape` (a bucket's name; None where every
        batch has one shape); alerts for those far above their rolling mean on that shape.

        A figure under `floor_s` never alerts (a 0.1 ms idle doubling is noise, not a slowdown).
        """
        if not any((stage, rank, shape, metric) in self._history for metric in figures):
            for metric in figures:  # the shape's first step (compiling, tuning): its history starts empty
                self._history[(stage, rank, shape, metric)] = deque(maxlen=self.window)
            return []
        alerts = []
        for metric, value in figures.items():
            history = self._history.setdefault((stage, rank, shape, metric), deque(maxlen=self.window))
            if len(history) >= self.warmup:
                mean = sum(history) / len(history)
                if value > self.floor_s and value > self.factor * max(mean, self.floor_s / self.factor):
                    alerts.append(Alert(stage, rank, metric, value, mean, shape))
                    continue  # an outlier does not join the baseline it is judged against
            history.append(value)
        return alerts

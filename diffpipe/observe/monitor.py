"""Warn when a stage slows down: rolling per-stage statistics of step and idle (communication) latency.

A stage whose latest figure exceeds `factor` x its rolling mean (after `warmup` steps) raises an alert; the
trainer then does what `observe.on_anomaly` says: warn, checkpoint (save the weights now) or stop (save and
exit cleanly). Nothing re-plans.
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

    def message(self, step: int) -> str:
        return (f"step {step}: stage {self.stage} (rank {self.rank}) {self.metric} {self.value_s * 1e3:.1f} ms is "
                f"{self.value_s / self.mean_s:.1f}x its rolling mean {self.mean_s * 1e3:.1f} ms")


class PipelineMonitor:
    def __init__(self, factor: float = 2.5, window: int = 20, warmup: int = 5, floor_s: float = 1e-3):
        self.factor, self.window, self.warmup, self.floor_s = factor, window, warmup, floor_s
        self._history: dict[tuple[int, int, str], deque] = {}

    def observe(self, stage: int, rank: int, figures: dict[str, float]) -> list[Alert]:
        """Add one step's figures (seconds) of a stage; alerts for those far above their rolling mean.

        A figure under `floor_s` never alerts (a 0.1 ms idle doubling is noise, not a slowdown).
        """
        alerts = []
        for metric, value in figures.items():
            history = self._history.setdefault((stage, rank, metric), deque(maxlen=self.window))
            if len(history) >= self.warmup:
                mean = sum(history) / len(history)
                if value > self.floor_s and value > self.factor * max(mean, self.floor_s / self.factor):
                    alerts.append(Alert(stage, rank, metric, value, mean))
                    continue  # an outlier does not join the baseline it is judged against
            history.append(value)
        return alerts

"""A step's recorded time is the device's, between the marks at the ends of consecutive steps, not the host's."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from diffpipe.train.records import NullProgress, StepReport


class _DeviceMark:
    """A mark at a chosen time on a device the host runs ahead of."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def seconds_since(self, origin: "_DeviceMark") -> float:
        return self.seconds - origin.seconds

    def wait(self) -> None:
        pass


class _NoWriters:
    def add_scalar(self, *args) -> None:
        pass


def test_step_times_are_the_intervals_between_device_marks(tmp_path: Path):
    report = StepReport(tmp_path, 3, 64, 1, _NoWriters(), True, torch.device("cpu"))
    report.progress = NullProgress()
    with report:
        report.last = _DeviceMark(10.0)  # the loop's start on the device
        for step, end in enumerate([14.3, 18.6, 22.9]):  # steps of 4.3 s on the device
            record = {"step": step, "loss": 0.5}
            time.sleep(0.01)  # the host's own pace is not the step's time
            report.time(record, _DeviceMark(end))
            report.write(step, record)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [round(r["step_time_s"], 3) for r in rows] == [4.3, 4.3, 4.3]  # the last one too
    assert [round(r["samples_per_s"], 2) for r in rows] == [14.88] * 3

"""`diffpipe timeline` and `diffpipe report`: a finished (or running) run's timed step as a Gantt chart and a
Chrome trace, and its one-page summary.

    diffpipe timeline runs/digits [--step N] --out timeline.png
    diffpipe report runs/digits [--out report.png]
"""
from __future__ import annotations

import json
from pathlib import Path

from ..observe.report import draw_report, summarise_run
from ..observe.timeline import chrome_trace, draw_timeline, read_step_intervals

__all__ = ["timeline_command", "report_command"]


def timeline_command(run_dir: str, step: int | None, out: str) -> None:
    """One timed step, one row per rank, as a picture and as a trace for ui.perfetto.dev."""
    record = read_step_intervals(run_dir, step)
    draw_timeline(record, out)
    trace = Path(out).with_suffix(".json")
    trace.write_text(json.dumps(chrome_trace(record)))
    print(f"wrote {out} and {trace} (open it in ui.perfetto.dev) for step {record['step']}")


def report_command(run_dir: str, out: str | None) -> None:
    """The run's summary printed, and drawn beside it (report.png unless `out`)."""
    print(summarise_run(run_dir))
    out = out or str(Path(run_dir) / "report.png")
    draw_report(run_dir, out)
    print(f"wrote {out}")

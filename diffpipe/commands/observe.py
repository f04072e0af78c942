"""`diffpipe timeline` and `diffpipe report`: a finished (or running) run's timed step as a Gantt chart and a
Chrome trace, and its one-page summary.

    diffpipe timeline runs/digits [--step N] --out timeline.png [--force]
    diffpipe report runs/digits [--out report.png [--force]]

What they write follows the rule every writer shares (written_files.check_target): nothing over an existing file
without --force, with it only an earlier picture or trace, and nothing into a run folder but the run's own
report.png (report's default).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..observe.report import draw_report, summarise_run
from ..observe.timeline import chrome_trace, draw_timeline, read_step_intervals
from ..written_files import check_target, is_image

__all__ = ["timeline_command", "report_command"]


def timeline_command(run_dir: str, step: int | None, out: str, force: bool = False) -> None:
    """One timed step, one row per rank, as a picture and as a trace for ui.perfetto.dev."""
    trace = Path(out).with_suffix(".json")
    check_target(Path(out), force, is_image, "a picture", [("the run folder", Path(run_dir))])
    check_target(trace, force, _is_trace, "a trace an earlier `diffpipe timeline` wrote",
                 [("the run folder", Path(run_dir))])
    record = read_step_intervals(run_dir, step)
    draw_timeline(record, out)
    trace.write_text(json.dumps(chrome_trace(record)))
    print(f"wrote {out} and {trace} (open it in ui.perfetto.dev) for step {record['step']}")


def report_command(run_dir: str, out: str | None, force: bool = False) -> None:
    """The run's summary printed, and drawn beside it (the run's own report.png unless `out`)."""
    if out is not None:
        check_target(Path(out), force, is_image, "a picture", [("the run folder", Path(run_dir))])
    print(summarise_run(run_dir))
    out = out or str(Path(run_dir) / "report.png")
    draw_report(run_dir, out)
    print(f"wrote {out}")


def _is_trace(path: Path) -> bool:
    try:
        return "traceEvents" in json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return False

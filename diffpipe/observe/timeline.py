"""One step as a picture (a Gantt chart, one row per rank) and as a Chrome/Perfetto trace.

    diffpipe timeline runs/digits [--step N] --out timeline.png     (also writes timeline.png's .json trace)
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["draw_timeline", "chrome_trace", "read_step_intervals"]


def read_step_intervals(run_dir: str | Path, step: int | None = None) -> dict:
    """The record of `step` (default: the last recorded) from the run's stage_times.jsonl."""
    path = Path(run_dir) / "stage_times.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run recorded no stage times (train it with this version)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if step is None:
        return records[-1]
    for record in records:
        if record["step"] == step:
            return record
    raise FileNotFoundError(f"step {step} was not recorded; recorded steps: {[r['step'] for r in records][:20]}...")


def chrome_trace(record: dict) -> dict:
    """Trace events (microseconds) that chrome://tracing and ui.perfetto.dev open: one thread per rank."""
    events = []
    for rank in record["ranks"]:
        for iv in rank["intervals"]:
            events.append({"name": f"{iv['kind'][0].upper()}{iv['microbatch']} stage {iv['stage']}", "ph": "X",
                           "ts": iv["start_s"] * 1e6, "dur": (iv["end_s"] - iv["start_s"]) * 1e6, "pid": 0,
                           "tid": rank["rank"], "args": {"microbatch": iv["microbatch"], "stage": iv["stage"]}})
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank["rank"],
                       "args": {"name": f"rank {rank['rank']}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_timeline(record: dict, out: str | Path) -> None:
    """Forward blocks light, backward dark, coloured by micro-batch; idle time is the white space."""
    ranks = sorted(record["ranks"], key=lambda r: r["rank"])
    microbatches = 1 + max((iv["microbatch"] for r in ranks for iv in r["intervals"]), default=0)
    cmap = plt.get_cmap("tab10" if microbatches <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.4))
    for row, rank in enumerate(ranks):
        for iv in rank["intervals"]:
            colour = cmap(iv["microbatch"] % cmap.N)
            forward = iv["kind"] == "forward"
            ax.broken_barh([(iv["start_s"] * 1e3, (iv["end_s"] - iv["start_s"]) * 1e3)], (row - 0.4, 0.8),
                           facecolors=colour, alpha=0.45 if forward else 0.95, edgecolor="black", linewidth=0.4)
            letter = {"forward": "F", "backward": "B", "weight": "W"}[iv["kind"]]
            ax.text((iv["start_s"] + iv["end_s"]) / 2 * 1e3, row, f"{letter}{iv['microbatch']}",
                    ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(f"step {record['step']}: {record.get('schedule', '')}, bubble {record.get('bubble_fraction', 0):.1%} "
                 f"(ideal {record.get('ideal_bubble_fraction', 0):.1%}); F light = forward, B dark = backward, "
                 "W = weight gradients", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

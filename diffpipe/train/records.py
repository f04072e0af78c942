"""What a run writes besides weights: metrics.jsonl, loss.png, and the console progress bar."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

__all__ = ["MetricsLog", "plot_loss", "make_progress", "NullProgress"]


class MetricsLog:
    """Appends one JSON object per logged step."""

    def __init__(self, path: Path):
        self.path = path
        self.path.write_text("")

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
    return Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"),
                    TextColumn("{task.fields[samples_per_s]:.1f} samples/s (global batch {task.fields[batch]})"),
                    TextColumn("ETA"), TimeRemainingColumn())

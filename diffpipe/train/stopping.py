"""When a run stops before its last step: steps whose loss or gradients are not finite (skipped, counted; too many
in a row stop the run), and the error that says why a run stopped and what to do."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import latest_checkpoint

__all__ = ["TrainingStopped", "NonFiniteSteps"]


class TrainingStopped(RuntimeError):
    """The run cannot go on (its loss or gradients stay non-finite); the message says why and what to do."""


class NonFiniteSteps:
    """Steps skipped for a non-finite loss or gradient (fp16 overflows included: a run that overflows every step
    is broken too): in a row (`streak`) and in all (`skipped`)."""

    def __init__(self, limit: int, run_dir: Path, prints: bool):
        self.limit, self.run_dir, self.prints = limit, run_dir, prints
        self.streak, self.skipped = 0, 0

    def judge(self, step: int, record: dict) -> None:
        """Count the step; warn at the first of a streak, stop after `train.max_bad_steps` in a row. Every rank
        reads the same all-reduced figures, so every rank stops alike."""
        bad = bool(record.pop("nonfinite")) or bool(record.get("skipped"))
        self.streak = self.streak + 1 if bad else 0
        self.skipped += bad
        record["skipped_steps"] = self.skipped
        if bad and self.streak == 1 and self.prints:
            what = "fp16 overflow" if record.get("skipped") else "loss or gradients not finite"
            print(f"warning: step {step}: {what} (loss {record['loss']:.4g}, gradient norm {record['grad_norm']:.4g}); "
                  f"step skipped, weights unchanged; {self.limit} in a row stop the run (train.max_bad_steps)",
                  flush=True)
        if self.streak >= self.limit:
            kept = latest_checkpoint(self.run_dir)
            then = (f"; resume from {kept.name} with --resume {self.run_dir} and a change" if kept is not None
                    else "; no checkpoint was written before it")
            raise TrainingStopped(
                f"{self.limit} steps in a row up to step {step} had a non-finite loss or gradients (skipped: the "
                f"weights are those before them). Lower train.learning_rate, check the data, or use bf16 instead of "
                f"fp16{then}")

    def stop_unfinished(self, next_step: int) -> None:
        """A run whose last steps were non-finite (fewer than train.max_bad_steps) or whose weights are: no
        weights, no final checkpoint and no samples from them; the newest checkpoint stays the result, and the run
        fails."""
        kept = latest_checkpoint(self.run_dir)
        then = (f"; the newest checkpoint, {kept.name}, is the last good state: resume from it with --resume "
                f"{self.run_dir} and a change" if kept is not None else "; no checkpoint was written before them")
        what = (f"the last {self.streak} step(s), up to step {next_step - 1}, had a non-finite loss or gradients "
                "(skipped)" if self.streak else f"the weights after step {next_step - 1} are not finite")
        raise TrainingStopped(f"{what}: no model.safetensors was written. Lower train.learning_rate, check the data, "
                              f"or use bf16 instead of fp16{then}")

"""The GPU's training loop (each step's figures read once the next step is queued) logs what the step-by-step
loop logs, and stops where it says it stopped; run on CPU processes by switching the overlap on."""
from __future__ import annotations

import json
import os

from diffpipe.config_files import build_config

from .helpers import run_workers

STEPS = 5


def _worker(out_dir: str) -> None:
    from pathlib import Path

    from diffpipe.distributed import init_topology
    from diffpipe.train.trainer import Trainer

    for overlap in (False, True):
        for stop in (False, True):
            config = build_config({"train": {"max_steps": STEPS, "batch_size": 16, "log_every": 1},
                                   "pipeline": {"stages": 2, "microbatches": 2, "split": [5]},
                                   "observe": {"log_every": 0}, "output": {"save_weights": False}})
            topo = init_topology(2, 1, "cpu")
            run_dir = Path(out_dir) / f"overlap{overlap}-stop{stop}"
            run_dir.mkdir(exist_ok=True)
            trainer = Trainer(config, topo, run_dir)
            trainer.overlap_steps = overlap
            if stop:  # as if the monitor said "stop" after step 2, on every rank
                judged = trainer.observer.after_step
                trainer.observer.after_step = lambda step, record, times: "stop" if step == 2 else judged(step, record, times)
            trainer.fit()


def _losses(folder) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def test_overlapped_loop_logs_the_same_steps_and_stops_at_the_same_step(tmp_path):
    run_workers(_worker, (str(tmp_path),), 2)
    plain, overlapped = _losses(tmp_path / "overlapFalse-stopFalse"), _losses(tmp_path / "overlapTrue-stopFalse")
    assert [s for s, _ in plain] == list(range(STEPS)) and overlapped == plain
    stopped_plain = _losses(tmp_path / "overlapFalse-stopTrue")
    stopped_overlapped = _losses(tmp_path / "overlapTrue-stopTrue")
    assert [s for s, _ in stopped_plain] == [0, 1, 2] and stopped_overlapped == stopped_plain
    assert os.path.exists(tmp_path / "overlapTrue-stopFalse" / "stage_times.jsonl")

"""Do the recorded step times add up to the training loop's wall time, the last step included?

    python bench/step_clock.py examples/sdxl_unet.toml [--steps 12] [--set KEY=VALUE ...]

Runs `Trainer.fit` in this process (one stage; on a GPU the host runs ahead of the device, so a step clock read on
the host stops early) and prints one JSON line: the loop's wall time, the sum of `step_time_s` from metrics.jsonl,
their ratio, the median step and the last step (the one a host clock recorded as far too short), and the
samples/s over the run from each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import resolve_device_kind, single_process_topology  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp())
    config = load_config(args.config, ["pipeline.stages=1", f"train.max_steps={args.steps}", "observe.log_every=0",
                                       "output.save_weights=false", "output.sample_every_end=false", *args.set])
    trainer = Trainer(config, single_process_topology(resolve_device_kind(config.train.device)), run_dir)
    start = time.perf_counter()
    trainer.fit()  # ends after the last step's record is read, i.e. once the device has finished it
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows]
    batch = config.train.batch_size
    print(json.dumps({"config": args.config, "steps": len(steps), "loop_wall_s": round(wall, 4),
                      "sum_step_time_s": round(sum(steps), 4), "sum_over_wall": round(sum(steps) / wall, 4),
                      "median_step_s": round(statistics.median(steps), 4), "last_step_s": steps[-1],
                      "first_step_s": steps[0], "samples_per_s_by_wall": round(batch * len(steps) / wall, 2),
                      "samples_per_s_by_steps": round(batch * len(steps) / sum(steps), 2)}), flush=True)


if __name__ == "__main__":
    main()

"""Cost of diffpipe's per-stage timing: the same training run with `observe.enabled` on and off.

    python bench/observe_overhead.py [CONFIG] [--steps 60] [--set KEY=VALUE ...]

Runs `diffpipe train` twice per setting, alternating, and prints one JSON line per setting with the median
step time over the steps after the first tenth (warm-up), then the relative overhead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _median_step(config: str, steps: int, extra: list[str], enabled: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "diffpipe", "train", config, "--output-dir", f"{tmp}/run",
               "--set", f"train.max_steps={steps}", "--set", "output.sample_every_end=false",
               "--set", f"observe.enabled={'true' if enabled else 'false'}", "--set", "observe.log_every=0"]
        for item in extra:
            cmd += ["--set", item]
        subprocess.run(cmd, check=True, capture_output=True)
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[max(1, steps // 10):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="examples/digits.toml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    medians = {True: [], False: []}
    for _ in range(args.repeats):
        for enabled in (False, True):
            medians[enabled].append(_median_step(args.config, args.steps, args.set, enabled))
    for enabled in (False, True):
        print(json.dumps({"observe": enabled, "median_step_s": round(statistics.median(medians[enabled]), 5),
                          "runs": [round(x, 5) for x in medians[enabled]]}))
    off, on = statistics.median(medians[False]), statistics.median(medians[True])
    print(json.dumps({"overhead": round(on / off - 1, 4)}))


if __name__ == "__main__":
    main()

"""Run `diffpipe train` with a deadline; if it has not finished a step by then, record where every process is
(py-spy's Python and native stacks when installed, else the stacks each training process prints on SIGUSR1), the
GPUs' state, and stop it. For diagnosing a run that hangs (the two-H200 Flux-dev run of issue 15).

    python bench/hang_probe.py --deadline 240 --out $OUT/flux_dev -- examples/flux_dev.toml --set pipeline.stages=2

Writes OUT/train.log (the run's output), OUT/stacks.txt and OUT/gpus.txt when the deadline passes, and prints
whether a step was made and when.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found] + [q for p in found for q in _children(int(p))]


def _record_state(run: subprocess.Popen, out: Path) -> None:
    pids = _children(run.pid)
    with open(out / "stacks.txt", "w") as f:
        spy = shutil.which("py-spy")
        for pid in pids:
            f.write(f"===== process {pid}\n")
            f.flush()
            if spy:
                result = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                        timeout=60)
                f.write(result.stdout + result.stderr)
            else:
                os.kill(pid, signal.SIGUSR1)  # training processes print their threads' stacks to the log
    if shutil.which("nvidia-smi"):
        with open(out / "gpus.txt", "w") as f:
            f.write(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
    time.sleep(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=240, help="seconds to the first step before stacks are taken")
    parser.add_argument("--out", required=True)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- CONFIG [--set ...] as for diffpipe train")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_args = [a for a in args.train_args if a != "--"]
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "diffpipe", "train", *train_args, "--output-dir", str(run_dir), "--overwrite"]
    started = time.monotonic()
    with open(out / "train.log", "w") as log:
        run = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        first_step = None
        while run.poll() is None and time.monotonic() - started < args.deadline:
            metrics = run_dir / "metrics.jsonl"
            if first_step is None and metrics.exists() and metrics.read_text().strip():
                first_step = round(time.monotonic() - started, 1)
            time.sleep(2)
        hung = run.poll() is None and first_step is None
        if hung:
            _record_state(run, out)
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    print(json.dumps({"exit": run.returncode, "first_step_s": first_step, "hung": hung,
                      "wall_s": round(time.monotonic() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()

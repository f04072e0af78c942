"""The central correctness check over NCCL: pipelined training on this host's GPUs computes what the unsplit
model computes (PIPELINING-FACTS: non-contiguous buffers are a known NCCL risk).

    python bench/nccl_gradients.py --gpus 4            # or 2; --device cpu runs the same check with gloo

Runs the scenarios of tests/pipeline/test_pipelined_gradients.py (GPipe, 1F1B, interleaved, checkpointed,
data parallel x pipeline) for 3 steps with fp32 on the GPUs (TF32 off), and prints, per scenario, the largest
difference of the losses, first-step gradients and final weights from the unsplit model run on the CPU.
Exits 1 if any exceeds the test's tolerance (1e-5).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.distributed import launch  # noqa: E402
from tests.pipeline.test_pipelined_gradients import FOUR, TOL, TWO, _scenario_worker, differences  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, choices=[2, 4], default=4)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    scenarios = TWO if args.gpus == 2 else FOUR
    failed = False
    with tempfile.TemporaryDirectory() as out:
        payload = [(name, cfg.model_dump(mode="json")) for name, cfg in scenarios.items()]
        launch(_scenario_worker, (payload, out, args.device), args.gpus)
        for name, config in scenarios.items():
            found = differences(name, args.gpus, config, out)
            ok = not found["missing"] and all(found[k] <= TOL for k in ("losses", "grads", "weights"))
            failed |= not ok
            print(json.dumps({"scenario": name, "backend": "nccl" if args.device == "cuda" else "gloo",
                              "equal_within_1e-5": ok, **found}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

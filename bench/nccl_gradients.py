"""The central correctness check over NCCL: pipelined training on this host's GPUs computes what the unsplit
diffusers model computes (docs/pipelining-facts.md: non-contiguous buffers are a known NCCL risk).

    python bench/nccl_gradients.py --gpus 2            # or 4; --device cpu runs the same check with gloo

Runs the scenarios of tests/pipeline/test_pipelined_gradients.py (GPipe, 1F1B, interleaved, checkpointed,
clipping off, data parallel x pipeline, a tiny SDXL-style UNet) in fp32 on the GPUs (TF32 off), and prints, per
scenario, the largest relative difference of the losses, gradient norms, first-step gradients (before clipping),
AdamW moments and final weights from the unsplit diffusers model run on the CPU. A NaN or inf counts as a
difference. Exits 1 if any exceeds the test's tolerances.
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
from tests.pipeline.test_pipelined_gradients import (FOUR, TWO, _load_ranks, _scenario_worker,  # noqa: E402
                                                     _weight_scale, compare, draws_of, failures, reference, resolved,
                                                     write_model_folders)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, choices=[2, 4], default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    scenarios = TWO if args.gpus == 2 else FOUR
    failed = False
    with tempfile.TemporaryDirectory() as out:
        folders = write_model_folders(Path(out))  # as the test's fixture
        configs = {name: resolved(data, folders) for name, data in scenarios.items()}
        payload = [(name, cfg.model_dump(mode="json")) for name, cfg in configs.items()]
        launch(_scenario_worker, (payload, out, args.device), args.gpus)
        for name, config in configs.items():
            found = compare(reference(config, draws_of(config)), _load_ranks(name, args.gpus, out), _weight_scale(config))
            problems = failures(found)
            failed |= bool(problems)
            print(json.dumps({"scenario": name, "backend": "nccl" if args.device == "cuda" else "gloo",
                              "equal": not problems, "problems": problems,
                              "worst": {k: [v, where] for k, (v, where) in found["worst"].items()}}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Where one diffpipe training step spends its time, phase by phase (synchronising the GPU between phases).

    python bench/step_phases.py examples/sdxl_unet.toml [--steps 6] [--set KEY=VALUE ...]

Runs in one process (one stage); prints one JSON line with the median seconds of: making the batch,
forward+backward through the schedule, the gradient norm, the optimizer step, and the whole step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import resolve_device_kind, single_process_topology  # noqa: E402
from diffpipe.train.optim import global_grad_norm  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    config = load_config(args.config, ["pipeline.stages=1", "output.save_weights=false", *args.set])
    topo = single_process_topology(resolve_device_kind(config.train.device))
    trainer = Trainer(config, topo, Path(tempfile.mkdtemp()))

    def sync():
        if topo.device.type == "cuda":
            torch.cuda.synchronize()

    phases = {k: [] for k in ("batch", "forward_backward", "grad_norm", "apply_gradients", "step")}
    for step in range(args.steps + 2):
        sync()
        t0 = time.perf_counter()
        batch = trainer.steps.batch_for(step)
        sync()
        t1 = time.perf_counter()
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, _ = trainer.runner.step(batch.noisy, batch.conditions, batch.target)
        sync()
        t2 = time.perf_counter()
        global_grad_norm(trainer.params, topo.pp_group, topo.device)
        sync()
        t3 = time.perf_counter()
        trainer.steps.apply_gradients(step, loss)
        sync()
        t4 = time.perf_counter()
        if step >= 2:
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                phases[key].append(value)
    print(json.dumps({k: round(statistics.median(v), 4) for k, v in phases.items()}), flush=True)


if __name__ == "__main__":
    main()

"""Where diffpipe's training loop makes the host wait for the GPU: `diffpipe train` in this process with
torch.cuda.set_sync_debug_mode("warn") from step 2 on, printing each synchronising call once, with the Python
stack that made it (the step's record is read on purpose, once per step, after the next step is queued).

    python bench/host_syncs.py examples/sdxl_unet.toml [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import resolve_device_kind, single_process_topology  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    config = load_config(args.config, ["pipeline.stages=1", "pipeline.microbatches=1", "train.batch_size=8",
                                       "pipeline.checkpointing=\"none\"", "plan.memory_gib=139", "train.max_steps=6",
                                       "output.save_weights=false", "output.sample_every_end=false", *args.set])
    trainer = Trainer(config, single_process_topology(resolve_device_kind(config.train.device)),
                      Path(tempfile.mkdtemp()))
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        if stack not in seen:
            seen.add(stack)
            print(f"--- {message}\n{stack}", flush=True)

    warnings.showwarning = show
    warnings.simplefilter("always")
    step_batch = trainer.steps.forward_backward

    def counted(step, batch=None):  # sync debugging from step 2 on: steps 0-1 build schedules, compile
        if step == 2:
            torch.cuda.set_sync_debug_mode("warn")
        return step_batch(step, batch)

    trainer.steps.forward_backward = counted
    trainer.fit()
    torch.cuda.set_sync_debug_mode(0)
    print(f"{len(seen)} distinct synchronising call stacks from step 2 on", flush=True)


if __name__ == "__main__":
    main()

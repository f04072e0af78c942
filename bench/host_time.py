"""Where diffpipe's host time goes in a training run: `diffpipe train` in this process under cProfile, printing
the functions that take the most time (cumulative and own), so that host work the GPU waits for (a GPU-idle gap that
bench/profile_step.py shows) can be named.

    python bench/host_time.py examples/sdxl_unet.toml [--top 40] [--set KEY=VALUE ...]

The run is one stage on one device, as bench/profile_step.py runs it (batch 8 as one micro-batch, nothing
checkpointed). Building the model is left out of the profile; compilation and the first steps are in it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.distributed import resolve_device_kind, single_process_topology  # noqa: E402
from diffpipe.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    config = load_config(args.config, ["pipeline.stages=1", "pipeline.microbatches=1", "train.batch_size=8",
                                       'pipeline.checkpointing="none"', "plan.memory_gib=139",
                                       f"train.max_steps={args.steps}", "observe.every=1000",
                                       "output.save_weights=false", "output.sample_every_end=false", *args.set])
    trainer = Trainer(config, single_process_topology(resolve_device_kind(config.train.device)),
                      Path(tempfile.mkdtemp()))
    profiler = cProfile.Profile()
    profiler.runcall(trainer.fit)
    stats = pstats.Stats(profiler, stream=sys.stdout)
    print(f"--- {args.steps} steps, by cumulative time")
    stats.sort_stats("cumulative").print_stats(args.top)
    print("--- by own time")
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()

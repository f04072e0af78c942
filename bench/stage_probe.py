"""Per-stage probe as JSON lines: each stage of a plan run alone on this device (synthetic boundary tensors,
the micro-batches in flight that 1F1B holds there, AdamW state), probed against planned time and peak memory.
The same as `diffpipe plan CONFIG --probe`, whose table this prints one JSON line per stage.

    python bench/stage_probe.py examples/sdxl_unet.toml [--set KEY=VALUE ...] [--repeats 3] [--unsplit]
        [--no-optimizer] [--stage N ...] [--gib 24]

--stage probes only the stages named; --gib caps this process's CUDA allocator to a smaller card's memory
(torch.cuda.set_per_process_memory_fraction): a stage that needs more gets a row saying it ran out of memory.

Uses the unit profile named by plan.profile when it exists (make it with `diffpipe plan CONFIG --profile`),
else FLOP-based times. --unsplit first probes the whole model as one stage (one micro-batch): the figure each
stage's peak is compared with.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.build import build_backbone  # noqa: E402
from diffpipe.config_files import load_config  # noqa: E402
from diffpipe.planner.levers import plan_memory  # noqa: E402
from diffpipe.planner.plan import hardware, make_plan  # noqa: E402
from diffpipe.train.probe import probe_plan, probed_samples_per_s  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unsplit", action="store_true", help="first probe the whole model as one stage")
    parser.add_argument("--no-optimizer", action="store_true", help="leave out AdamW state (gradients only)")
    parser.add_argument("--stage", type=int, action="append", help="probe only this stage (repeatable)")
    parser.add_argument("--gib", type=float, help="cap the CUDA allocator to this many GiB (a smaller card)")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gib * 2**30 / total), 0)
    meta = build_backbone(config, "meta")
    p = config.pipeline
    plan = make_plan(config, meta, p.stages * p.virtual_stages, p.data_parallel, p.microbatches, hardware(config))
    print(f"plan: split {plan.planned.starts}, {plan.samples_per_s:.3f} samples/s, memory "
          f"{plan_memory(config, plan).words(plan.replicas.frozen.name)}", flush=True)
    rows = probe_plan(config, meta, plan, device, args.repeats, not args.no_optimizer, args.unsplit, args.stage)
    for row in rows:
        print(json.dumps({**row, "optimizer_state": not args.no_optimizer, "capped_gib": args.gib}), flush=True)
    print(json.dumps({"probed_samples_per_s": probed_samples_per_s(plan, rows)}), flush=True)


if __name__ == "__main__":
    main()

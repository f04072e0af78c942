"""How many frames of a real-width Wan fit, at 1, 2, 4 and 8 stages, with and without activation checkpointing: the
planner's answer (FLOP-counted units on the meta device; nothing is allocated, runs on the CPU in seconds).

    python bench/video_plan.py [--preset t2v-14b] [--gpu-memory 139] [--side 60]

Wan's VAE makes 1 + (F - 1) / 4 latent frames of a clip of F video frames and 8x smaller sides; latents are square
(--side 60: 480x480 pixels). Each stage holds its units' fp32 weights, gradients and AdamW moments, and the
activations of the micro-batches in flight (bf16); micro-batch 1, as many micro-batches as stages (at least 4).
Prints one row per (frames, stages): the peak stage's memory and the estimated clips/s per pipeline, or "-".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffpipe.build import build_backbone  # noqa: E402
from diffpipe.config_files import build_config  # noqa: E402
from diffpipe.planner.partition import Hardware, Infeasible  # noqa: E402
from diffpipe.planner.plan import make_plan  # noqa: E402

VIDEO_FRAMES = (1, 17, 33, 49, 65, 81)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="t2v-14b")
    parser.add_argument("--gpu-memory", type=float, default=139.0)
    parser.add_argument("--tflops", type=float, default=400.0)
    parser.add_argument("--side", type=int, default=60)
    args = parser.parse_args()
    hw = Hardware(tflops=args.tflops, link_gbps=100.0, memory_bytes=args.gpu_memory * 2**30)
    print(f"Wan {args.preset}, {args.side * 8}x{args.side * 8} pixels, {args.gpu_memory:g} GiB a GPU")
    print("video frames  latent frames  stages  checkpointing  peak stage GiB  clips/s")
    for frames in VIDEO_FRAMES:
        latent = 1 + (frames - 1) // 4
        for stages in (1, 2, 4, 8):
            for mode in ("none", "all"):
                m = max(stages, 4)
                config = build_config({
                    "model": {"architecture": "wan", "preset": args.preset, "text_max_length": 512},
                    "data": {"dataset": "synthetic", "frames": latent},
                    "train": {"batch_size": m, "precision": "bf16", "objective": "flow_matching"},
                    "pipeline": {"stages": stages, "microbatches": m, "checkpointing": mode}})
                meta = build_backbone(config, "meta")
                try:
                    plan = make_plan(config, meta, stages, 1, m, hw)
                    peak = max(s.memory_bytes for s in plan.planned.stages) / 2**30
                    row = f"{peak:14.1f}  {plan.samples_per_s:7.3f}"
                except Infeasible:
                    row = f"{'-':>14}  {'-':>7}"
                print(f"{frames:12d}  {latent:13d}  {stages:6d}  {mode:>13}  {row}", flush=True)


if __name__ == "__main__":
    main()

"""Do generated clips move as their prompts say? For a run trained on moving digits: one clip per (digit, motion)
prompt, each judged by the one-pixel roll (left, right, up, down) that best maps every frame onto the next.

    python bench/video_motion.py runs/video_tiny [--steps 20] [--guidance 3]

Prints the share of the 40 clips whose motion is the prompted one (chance: 0.25).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffpipe.data.moving_digits import MOTIONS, moving_caption  # noqa: E402
from diffpipe.sampling import load_generator  # noqa: E402


def motion_of(clip: torch.Tensor) -> str:
    """The motion whose one-pixel roll of each frame best matches the next frame (clip: C, F, H, W)."""
    def error(dy: int, dx: int) -> float:
        return sum(((torch.roll(clip[:, f], (dy, dx), dims=(-2, -1)) - clip[:, f + 1]) ** 2).mean().item()
                   for f in range(clip.shape[1] - 1))
    return min(MOTIONS, key=lambda m: error(*MOTIONS[m]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    args = parser.parse_args()
    gen = load_generator(args.run_dir)
    pairs = [(d, m) for d in range(10) for m in MOTIONS]
    clips = gen.generate([moving_caption(d, m) for d, m in pairs], list(range(len(pairs))), args.steps, args.guidance)
    right = sum(motion_of(clip) == m for clip, (_, m) in zip(clips, pairs))
    print(f"clips moving as prompted: {right} of {len(pairs)} ({right / len(pairs):.3f}; chance 0.25)")


if __name__ == "__main__":
    main()

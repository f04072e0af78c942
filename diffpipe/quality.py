"""Does a trained digits run draw the digits it is asked for? A classifier fitted on the real digits judges.

    python -m diffpipe.quality runs/digits [--per-digit 10] [--steps 30]

For each digit 0-9 it calls `diffpipe sample` (the same command a user runs) for --per-digit images, reads
the PNG back, and counts how many scikit-learn's logistic regression, fitted on all of `load_digits`,
assigns to the digit named in the prompt. Prints the accuracy; exits 1 below --min-accuracy.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from .cli import main as diffpipe_main
from .data.digits import DIGIT_WORDS, DigitsDataset, digit_caption
from .sampling import read_row

__all__ = ["digit_accuracy"]


def _classifier() -> LogisticRegression:
    digits = load_digits()
    return LogisticRegression(max_iter=5000).fit(digits.data, digits.target)


def digit_accuracy(run_dir: str | Path, per_digit: int = 10, steps: int | None = None, seed: int = 1000) -> float:
    clf = _classifier()
    correct = 0
    with tempfile.TemporaryDirectory() as tmp:
        for digit in range(len(DIGIT_WORDS)):
            out = Path(tmp) / f"{digit}.png"
            argv = ["sample", str(run_dir), "--prompt", digit_caption(digit), "--num", str(per_digit),
                    "--seed", str(seed + 100 * digit), "--out", str(out)]
            if steps:
                argv += ["--steps", str(steps)]
            if diffpipe_main(argv) != 0:
                raise RuntimeError(f"diffpipe sample failed for digit {digit}")
            pixels = read_row(out) / 255.0 * DigitsDataset.MAX_VALUE  # back to the 0..16 range
            predicted = clf.predict(pixels.reshape(per_digit, -1))
            correct += int(np.sum(predicted == digit))
            print(f"digit {digit}: {int(np.sum(predicted == digit))}/{per_digit} recognised", flush=True)
    return correct / (per_digit * len(DIGIT_WORDS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--per-digit", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--min-accuracy", type=float, default=0.8)
    args = parser.parse_args()
    accuracy = digit_accuracy(args.run_dir, args.per_digit, args.steps)
    print(f"classifier accuracy on generated digits: {accuracy:.1%} (bar: {args.min_accuracy:.0%})")
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

"""The main job exactly as the README runs it, then the quality bar: a classifier fitted on the real digits
recognises at least 80 % of `diffpipe sample` images as the prompted digit. Takes about 3 minutes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diffpipe.quality import digit_accuracy

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_digits_main_job_draws_the_prompted_digits(tmp_path):
    run = tmp_path / "digits"
    result = subprocess.run([sys.executable, "-m", "diffpipe", "train", str(ROOT / "examples" / "digits.toml"),
                             "--output-dir", str(run)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.toml", "model.safetensors", "metrics.jsonl", "samples.png", "loss.png"):
        assert (run / name).is_file(), name
    accuracy = digit_accuracy(run, per_digit=10)
    print(f"classifier accuracy on generated digits: {accuracy:.1%}")
    assert accuracy >= 0.8

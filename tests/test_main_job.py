"""The main job exactly as the README runs it, then the quality checks of `python examples/digits_quality.py`: a classifier
fitted on held-out digits the model never saw recognises at least 80 % of the samples as the prompted digit, at
most 10 % of them copy a training image, and every digit's samples vary at least 0.5x as much as real ones (measured:
0.62, LoRA 0.60).
The same for the LoRA job (examples/digits_lora.toml). Takes about 2 minutes each."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import example_module

digit_quality = example_module("digits_quality").digit_quality

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("example", ["digits.toml", "digits_lora.toml"])
def test_digits_main_job_draws_new_varied_digits_of_the_prompted_kind(tmp_path, example):
    """Full fine-tune, and LoRA adapters alone on a random frozen base (which by itself draws no digit)."""
    run = tmp_path / "digits"
    result = subprocess.run([sys.executable, "-m", "diffpipe", "train", str(ROOT / "examples" / example),
                             "--output-dir", str(run)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.toml", "model.safetensors", "metrics.jsonl", "samples.png", "loss.png"):
        assert (run / name).is_file(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(row["step_time_s"] > 0 for row in rows)
    report = digit_quality(run, per_digit=10)
    print(report.summary())
    assert report.failures() == [], report.summary()

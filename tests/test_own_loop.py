"""The README's example of diffpipe inside a loop of one's own (examples/own_loop.py): two processes train a Flux
transformer split by diffpipe's planner with torch's own 1F1B schedule, starting from the unsplit model's loss."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_own_loop_example_trains_from_the_unsplit_models_loss():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "own_loop.py")], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    unsplit = float(re.search(r"before training: ([0-9.]+)", result.stdout).group(1))
    losses = [float(x) for x in re.findall(r"pipelined loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3 and losses[0] == pytest.approx(unsplit, rel=1e-5) and losses[2] < losses[0]

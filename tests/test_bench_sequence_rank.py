"""bench/sequence_rank.py (one process of a split sample emulated on one GPU) runs its CPU smoke line: the next GPU
session's measurement must not fail on the script itself."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "bench" / "sequence_rank.py"


def test_the_emulated_process_runs_and_reports_against_the_plan():
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "digits", "--frames", "4", "--size", "8", "8",
           "--sp", "2", "--steps", "3", "--text", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["sp"] == 2 and line["measured_step_s"] > 0
    assert {"planned_step_s", "step_ratio", "measured_peak_gib", "planned_peak_gib", "peak_ratio"} <= set(line)


def test_the_emulated_exchange_lays_tensors_out_as_ulysses_does():
    """Out of the exchange and back is the identity (the layout diffusers' all-to-alls use, one process's copy)."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    from sequence_rank import _exchanged_in, _exchanged_out

    x = torch.randn(2, 6, 4, 3)
    there = _exchanged_in(x, 2)
    assert there.shape == (2, 12, 2, 3)
    assert torch.equal(_exchanged_out(there, 2), x)

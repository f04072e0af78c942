"""Under `torchrun --max-restarts 1`, a run whose training process is killed after a checkpoint is started again
by torchrun and resumes from that checkpoint by itself: it ends with exit 0 and every step recorded once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"


def _worker(parent: int, local_rank: str) -> int | None:
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(child)
    return None


def test_torchrun_restarts_a_killed_worker_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(run), "--set", "train.max_steps=30",
           "--set", "train.batch_size=16", "--set", "checkpoint.every=5", "--set", "observe.log_every=0",
           "--set", "output.sample_every_end=false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step-00000005" / "complete.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.3)
        victim = _worker(proc.pid, "1")
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "resuming" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(30))  # the steps after the checkpoint were trained again, recorded once
    assert (run / "model.safetensors").is_file()

"""Non-finite losses and gradients are never trained on: the step is skipped on the device, counted, warned about,
and a run that stays non-finite stops with a message and a non-zero exit instead of saying "done"."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffpipe.train.optim import step_optimizer

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"


def test_a_skipped_step_leaves_weights_and_adam_state_as_they_were():
    weight = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones(4)
    step_optimizer(opt, [weight], None)
    before = weight.detach().clone(), {k: v.clone() for k, v in opt.state[weight].items()}
    weight.grad = torch.full((4,), float("nan"))
    step_optimizer(opt, [weight], torch.tensor(0.5), skip=torch.tensor(1.0))
    assert torch.equal(weight.detach(), before[0])
    assert all(torch.equal(opt.state[weight][k], v) for k, v in before[1].items())  # step count too
    weight.grad = torch.ones(4)
    step_optimizer(opt, [weight], None, skip=torch.tensor(0.0))
    assert not torch.equal(weight.detach(), before[0]) and float(opt.state[weight]["step"]) == 2.0


def test_a_diverging_run_stops_with_a_message_and_unchanged_weights(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(run),
           "--set", "train.max_steps=30", "--set", "train.batch_size=16", "--set", "train.warmup_steps=0",
           "--set", "train.learning_rate=1e6", "--set", "train.max_bad_steps=4", "--set", "observe.log_every=0",
           "--set", "checkpoint.every=1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "warning: step 1: loss or gradients not finite" in result.stdout
    assert "training stopped: 4 steps in a row up to step 4" in result.stderr
    assert "resume from step-00000001" in result.stderr and "done" not in result.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2, 3]  # the stopping step is counted, not written
    # no checkpoint during the streak: the one kept is the last good one, before it (step 0's huge update made
    # every later loss NaN), and its weights are finite
    kept = run / "checkpoints" / "step-00000001"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [kept.name]
    for shard in kept.glob("*.safetensors"):
        assert all(torch.isfinite(w).all() for k, w in load_file(str(shard)).items() if k.startswith("model."))


def test_a_run_whose_last_steps_were_not_finite_fails_and_writes_no_weights(tmp_path):
    """Fewer non-finite steps at the end than train.max_bad_steps: the run ended "done", exit 0, with weights and
    samples of a model that gives NaN."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(run),
           "--set", "train.max_steps=4", "--set", "train.batch_size=16", "--set", "train.warmup_steps=0",
           "--set", "train.learning_rate=1e6", "--set", "train.max_bad_steps=10", "--set", "observe.log_every=0",
           "--set", "checkpoint.every=1", "--set", "sample.steps=2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "training stopped: the last 3 step(s), up to step 3, had a non-finite loss" in result.stderr
    assert "the newest checkpoint, step-00000001, is the last good state" in result.stderr
    assert "done" not in result.stdout
    assert not (run / "model.safetensors").exists() and not (run / "samples.png").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001"]

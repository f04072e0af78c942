"""train.ema_decay (issue 29): a moving average of the trained weights equal to diffusers' EMAModel over the run's
own weights step by step, checkpointed and resumed on another layout, and what the run's outputs hold, while the
training itself is unchanged."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe.cli import main
from diffpipe.train.ema import MovingAverage

from ..helpers import run_command

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"
QUICK = ["--set", "train.max_steps=4", "--set", "train.batch_size=16", "--set", "checkpoint.every=1",
         "--set", "checkpoint.keep=4", "--set", "output.sample_every_end=false", "--set", "observe.log_every=0",
         "--set", 'train.device="cpu"']
DECAY = "train.ema_decay=0.8"


def test_the_average_moves_as_diffusers_emamodel_and_a_skipped_step_leaves_it():
    from diffusers.training_utils import EMAModel

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]
    ours, theirs = MovingAverage(params, decay=0.8), EMAModel(params, decay=0.8)
    for step in range(6):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
        ours.update(skipped=torch.tensor(0.0))
        theirs.step(params)
        for a, b in zip(ours.averages, theirs.shadow_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    before = [a.clone() for a in ours.averages]
    with torch.no_grad():
        params[0].add_(1.0)
    ours.update(skipped=torch.tensor(1.0))  # a step skipped for non-finite gradients, on the device
    assert all(torch.equal(a, b) for a, b in zip(ours.averages, before))


def _train(run: Path, *sets: str):
    cmd = ["train", str(EXAMPLE), *QUICK, "--output-dir", str(run)]
    for setting in sets:
        cmd += ["--set", setting]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def _checkpoint(run: Path, step: int, kind: str) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted((run / "checkpoints" / f"step-{step:08d}").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k.removeprefix(kind): f.get_tensor(k) for k in f.keys() if k.startswith(kind)})
    return out


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("ema") / "run", DECAY, "sample.every=2", "sample.steps=2",
                  "sample.seeds=[0]")


def test_a_runs_outputs_are_emamodel_over_its_own_weights_and_training_is_unchanged(ema_run, tmp_path):
    """The checkpoints after steps 1-4 hold the trained weights; diffusers' EMAModel fed them in turn gives the
    run's model.safetensors, and the export of checkpoint 2 its average after 2 steps. Samples taken in between (the
    average swapped in and out) leave the losses those of a run without the average."""
    from diffusers.training_utils import EMAModel

    steps = [_checkpoint(ema_run, s, "model.") for s in range(1, 5)]
    names = sorted(steps[0])
    params = [torch.nn.Parameter(steps[0][n].clone()) for n in names]
    reference = EMAModel(params, decay=0.8)
    averages = {}
    for s, weights in enumerate(steps, start=1):
        with torch.no_grad():
            for p, n in zip(params, names):
                p.copy_(weights[n])
        reference.step(params)
        averages[s] = {n: a.clone() for n, a in zip(names, reference.shadow_params)}
        saved = _checkpoint(ema_run, s, "ema.")
        assert all(torch.allclose(saved[n], averages[s][n], rtol=1e-6, atol=1e-7) for n in names), s
    final = load_file(str(ema_run / "model.safetensors"))
    for n in names:
        torch.testing.assert_close(final[n], averages[4][n], rtol=1e-6, atol=1e-7)
    assert max((final[n] - steps[-1][n]).abs().max().item() for n in names) > 1e-4  # not the last weights
    out = tmp_path / "step2.safetensors"
    assert main(["export", str(ema_run), "--step", "2", "--format", "diffusers", "--out", str(out)]) == 0
    exported = load_file(str(out))
    for n in names:
        torch.testing.assert_close(exported[n], averages[2][n], rtol=1e-6, atol=1e-7)
    assert (ema_run / "samples" / "step-000002.png").is_file()
    plain = _train(tmp_path / "plain")
    assert _losses(ema_run) == _losses(plain)


@pytest.mark.parametrize("layout", [["pipeline.stages=2"],
                                    ["pipeline.stages=1", "pipeline.data_parallel=2",
                                     "pipeline.data_parallel_shard=true"]])
def test_the_average_resumes_from_a_checkpoint_on_another_layout(ema_run, tmp_path, layout):
    """Cut short after the checkpoint of step 2, resumed on the same 2 stages (bit for bit) or as 2 sharded
    replicas (each averages its shard of every weight): the final average of the uninterrupted run."""
    run = tmp_path / "run"
    shutil.copytree(ema_run, run)
    for step in (3, 4):
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    (run / "model.safetensors").unlink()
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in rows if json.loads(line)["step"] <= 1))
    cmd = ["train", str(EXAMPLE), *QUICK, "--resume", str(run), "--set", DECAY, "--set", "sample.every=2",
           "--set", "sample.steps=2", "--set", "sample.seeds=[0]"]
    for setting in layout:
        cmd += ["--set", setting]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = load_file(str(run / "model.safetensors")), load_file(str(ema_run / "model.safetensors"))
    exact = layout == ["pipeline.stages=2"]
    for n in want:
        if exact:
            assert torch.equal(got[n], want[n]), n
        else:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)

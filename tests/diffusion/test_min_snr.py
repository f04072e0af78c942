"""train.min_snr_gamma (issue 29): each sample's loss weighted as diffusers' training scripts weigh it, carried to the
last stage inside the target, the same on any number of stages."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffpipe.diffusion.objectives import discrete_step, min_snr_weights, weighted_mse, with_weights
from diffpipe.errors import ConfigError

from ..helpers import run_command

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


@pytest.mark.parametrize("objective", ["epsilon", "v_prediction"])
def test_the_weighted_loss_is_diffusers_min_snr_loss(objective):
    """diffusers' train_text_to_image.py: compute_snr on SD's scheduler, min(snr, gamma) / snr (epsilon) or
    / (snr + 1) (v-prediction), per-sample mean squared errors times those weights, then their mean."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    gen = torch.Generator().manual_seed(0)
    pred, target = torch.randn(6, 4, 8, 8, generator=gen), torch.randn(6, 4, 8, 8, generator=gen)
    t = torch.tensor([0.001, 0.02, 0.2, 0.5, 0.8, 0.999])
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    snr = compute_snr(scheduler, discrete_step(t))
    weights = torch.stack([snr, 5.0 * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    weights = weights / snr if objective == "epsilon" else weights / (snr + 1)
    want = (F.mse_loss(pred, target, reduction="none").mean(dim=[1, 2, 3]) * weights).mean()
    ours = min_snr_weights(objective, t, 5.0)
    assert ours.min() < 0.5 and ours.max() <= 1.0  # low-noise samples weighted down: the weighting does something
    torch.testing.assert_close(weighted_mse(pred, with_weights(target, ours)), want, rtol=1e-6, atol=1e-7)


def test_min_snr_on_a_flow_matching_run_is_refused_with_the_reason():
    from diffpipe.config_files import load_config

    with pytest.raises(ConfigError, match="min-SNR weighting is defined for epsilon and v-prediction"):
        load_config(EXAMPLES / "digits.toml", ["train.min_snr_gamma=5.0"])


def _losses(tmp_path: Path, name: str, *sets: str) -> list[float]:
    run = tmp_path / name
    cmd = ["train", str(EXAMPLES / "digits.toml"), "--output-dir", str(run), "--set", "train.max_steps=4",
           "--set", "train.objective=\"epsilon\"", "--set", "checkpoint.every=0", "--set", "output.save_weights=false",
           "--set", "output.sample_every_end=false"]
    for setting in sets:
        cmd += ["--set", setting]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_weighted_runs_train_alike_on_one_and_two_stages(tmp_path):
    """The weights ride in the target, which torch's schedules split among micro-batches like the samples: two
    stages of 4 micro-batches give the one-stage losses."""
    one = _losses(tmp_path, "one", "train.min_snr_gamma=5.0", "pipeline.stages=1")
    two = _losses(tmp_path, "two", "train.min_snr_gamma=5.0", "pipeline.stages=2", "pipeline.split=[5]")
    plain = _losses(tmp_path, "plain", "pipeline.stages=1")
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-6)
    assert abs(one[0] - plain[0]) > 1e-3 * plain[0]  # the same first batch, weighted: another loss

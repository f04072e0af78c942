"""Timestep densities, objectives and samplers against their closed forms."""
from __future__ import annotations

import math

import pytest
import torch

from diffpipe.diffusion.objectives import alphas_cumprod, discrete_step, make_targets
from diffpipe.diffusion.samplers import sample
from diffpipe.diffusion.timesteps import sample_timesteps


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_importance_sampling_follows_0_99_to_the_t():
    t = sample_timesteps("importance", 200_000, _gen())
    k = discrete_step(t)
    counts = torch.bincount(k, minlength=1000).double()
    # p(k) / p(k + 100) = 0.99^-100 = 2.73; compare summed windows to keep the noise low
    ratio = counts[0:20].sum() / counts[100:120].sum()
    assert ratio.item() == pytest.approx(0.99 ** -100, rel=0.05)
    assert k.float().mean().item() == pytest.approx(1 / (1 - 0.99) - 1, rel=0.03)  # geometric mean, 99


def test_logit_normal_and_shift_densities():
    t = sample_timesteps("logit_normal", 100_000, _gen(), logit_mean=0.5, logit_std=1.0)
    assert t.median().item() == pytest.approx(1 / (1 + math.exp(-0.5)), abs=0.01)
    shifted = sample_timesteps("shift", 100_000, _gen(), shift=3.0)
    assert shifted.median().item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5), abs=0.01)  # 0.75
    uniform = sample_timesteps("uniform", 100_000, _gen())
    assert uniform.mean().item() == pytest.approx(0.5, abs=0.01)


def test_each_sample_gets_its_own_timestep():
    x0 = torch.randn(8, 1, 4, 4)
    t = sample_timesteps("uniform", 8, _gen())
    assert len(set(t.tolist())) == 8
    targets = make_targets("flow_matching", x0, torch.randn_like(x0), t)
    assert targets.model_timestep.shape == (8,)


@pytest.mark.parametrize("objective", ["flow_matching", "epsilon", "v_prediction"])
def test_sampler_with_the_exact_denoiser_recovers_the_data_point(objective):
    """For a single data point x0 the ideal model output is known in closed form; sampling must return x0."""
    x0 = torch.randn(2, 1, 4, 4, generator=_gen(1))
    abar = alphas_cumprod().float()

    def exact(x, model_t):
        if objective == "flow_matching":
            t = (model_t / 1000).view(-1, 1, 1, 1)
            return (x - x0) / t  # noise - x0, with noise = (x - (1 - t) x0) / t
        a = abar[model_t.long()].view(-1, 1, 1, 1)
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        return eps if objective == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0

    out = sample(exact, torch.randn(2, 1, 4, 4, generator=_gen(2)), steps=25, objective=objective)
    assert torch.allclose(out, x0, atol=1e-3)


@pytest.mark.parametrize("objective", ["epsilon", "v_prediction"])
def test_discrete_targets_match_their_definitions(objective):
    x0, noise = torch.randn(4, 1, 2, 2, generator=_gen(5)), torch.randn(4, 1, 2, 2, generator=_gen(6))
    t = torch.tensor([0.0, 0.25, 0.5, 0.999])
    out = make_targets(objective, x0, noise, t)
    a = alphas_cumprod()[discrete_step(t)].float().view(-1, 1, 1, 1)
    assert torch.allclose(out.noisy, a.sqrt() * x0 + (1 - a).sqrt() * noise, atol=1e-6)  # fp32 rounding near 0
    expected = noise if objective == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
    assert torch.allclose(out.target, expected, atol=1e-6)

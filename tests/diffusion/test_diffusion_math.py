"""Timestep densities, objectives and samplers against their closed forms."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler
from scipy import stats

from diffpipe.diffusion.objectives import alphas_cumprod, discrete_step, make_targets
from diffpipe.diffusion.samplers import sample
from diffpipe.diffusion.timesteps import sample_timesteps, timestep_quantiles

from ..planted import planted


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


def _logit_normal_cdf(t, mean, std):
    return stats.norm.cdf((np.log(t / (1 - t)) - mean) / std)


def _shifted_uniform_cdf(t, shift):
    return t / (shift - (shift - 1) * t)  # the inverse of t' = s t / (1 + (s - 1) t) is the CDF of uniform t


@pytest.mark.parametrize("kind,cdf", [
    ("logit_normal", lambda t: _logit_normal_cdf(t, 0.5, 1.0)),
    ("shift", lambda t: _shifted_uniform_cdf(t, 3.0)),
    ("uniform", lambda t: t),
])
def test_timestep_densities_follow_their_distributions(kind, cdf):
    """Kolmogorov-Smirnov against the exact CDF over 100,000 draws: the whole density, not one quantile."""
    t = sample_timesteps(kind, 100_000, _gen(), logit_mean=0.5, logit_std=1.0, shift=3.0).double().numpy()
    assert stats.kstest(t, cdf).pvalue > 1e-3


@pytest.mark.parametrize("within", [(0.875, 1.0), (0.0, 0.875), (0.2, 0.5)])
@pytest.mark.parametrize("kind,cdf", [
    ("logit_normal", lambda t: _logit_normal_cdf(np.clip(t, 1e-12, 1 - 1e-12), 0.5, 1.0)),
    ("shift", lambda t: _shifted_uniform_cdf(t, 3.0)),
    ("uniform", lambda t: t),
])
def test_a_timestep_range_draws_from_the_density_cut_to_it(kind, cdf, within):
    """train.timestep_range / a Wan 2.2 expert's side of the boundary: every draw inside, distributed as the density
    cut there (KS against (F(t) - F(low)) / (F(high) - F(low))); a cut placed elsewhere fails the same check."""
    low, high = within
    t = sample_timesteps(kind, 100_000, _gen(), logit_mean=0.5, logit_std=1.0, shift=3.0, within=within)
    assert low <= t.min() and t.max() <= high
    t = t.double().numpy()

    def cut(a, b):
        return lambda x: np.clip((cdf(x) - cdf(a)) / (cdf(b) - cdf(a)), 0, 1)

    assert stats.kstest(t, cut(low, high)).pvalue > 1e-3
    width = high - low
    assert stats.kstest(t, cut(low + 0.1 * width, high - 0.1 * width)).pvalue < 1e-6
    # the eval loss's timesteps: the cut density's quantiles
    q = timestep_quantiles(kind, [0.1, 0.5, 0.9], logit_mean=0.5, logit_std=1.0, shift=3.0, within=within)
    assert cut(low, high)(q.double().numpy()) == pytest.approx([0.1, 0.5, 0.9], abs=1e-4)


def test_importance_sampling_cut_to_a_range_keeps_its_steps_and_their_weights():
    t = sample_timesteps("importance", 100_000, _gen(), within=(0.1, 0.3))
    k = (t * 1000 - 0.5).round().long()
    assert k.min() >= 100 and k.max() <= 299
    ratio = (k == 100).sum().item() / (k == 120).sum().item()  # 0.99^-20 = 1.22
    assert ratio == pytest.approx(0.99 ** -20, rel=0.15)


def test_a_wrong_density_fails_the_distribution_check():
    t = sample_timesteps("logit_normal", 100_000, _gen(), logit_mean=0.5, logit_std=1.1).double().numpy()
    assert stats.kstest(t, lambda x: _logit_normal_cdf(x, 0.5, 1.0)).pvalue < 1e-6


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


def _sd_scheduler(cls, **kwargs):
    """diffusers' scheduler with Stable Diffusion's noise schedule (scaled-linear betas 0.00085 to 0.012)."""
    return cls(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", **kwargs)


@pytest.mark.parametrize("objective", ["epsilon", "v_prediction"])
def test_discrete_targets_match_diffusers(objective):
    x0, noise = torch.randn(4, 1, 2, 2, generator=_gen(5)), torch.randn(4, 1, 2, 2, generator=_gen(6))
    t = torch.tensor([0.0, 0.25, 0.5, 0.999])
    out = make_targets(objective, x0, noise, t)
    ddpm = _sd_scheduler(DDPMScheduler)
    steps = discrete_step(t)
    assert steps.tolist() == [0, 250, 500, 999]
    torch.testing.assert_close(out.noisy, ddpm.add_noise(x0, noise, steps), rtol=0, atol=1e-6)
    expected = noise if objective == "epsilon" else ddpm.get_velocity(x0, noise, steps)
    torch.testing.assert_close(out.target, expected, rtol=0, atol=1e-6)
    assert out.model_timestep.tolist() == [0.0, 250.0, 500.0, 999.0]


class _RecordingModel:
    """A fixed nonlinear function of (x, t), neither an exact denoiser nor constant in t; records every call."""

    def __init__(self):
        gen = _gen(7)
        self.weight, self.bias = torch.randn(1, 1, 4, 4, generator=gen), torch.randn(1, 1, 4, 4, generator=gen)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, x, model_t):
        self.calls.append((x.clone(), model_t.clone()))
        s = (model_t / 1000).view(-1, 1, 1, 1)
        return torch.tanh(x * self.weight) * (1 - s) + self.bias * s + 0.3 * x


def _diffusers_trajectory(scheduler, noise) -> tuple[list, torch.Tensor]:
    model, x = _RecordingModel(), noise.clone()
    for t in scheduler.timesteps:
        out = model(x, torch.full((x.shape[0],), float(t)))
        x = scheduler.step(out, t, x).prev_sample
    return model.calls, x


def _assert_same_trajectory(ours, theirs, final_ours, final_theirs):
    assert len(ours) == len(theirs), f"{len(ours)} model calls against diffusers' {len(theirs)}"
    for i, ((x, t), (x_ref, t_ref)) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(t, t_ref, rtol=0, atol=1e-3, msg=f"timestep of step {i}")
        torch.testing.assert_close(x, x_ref, rtol=1e-5, atol=1e-5, msg=f"state entering step {i}")
    torch.testing.assert_close(final_ours, final_theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [10, 25])
@pytest.mark.parametrize("objective", ["epsilon", "v_prediction"])
def test_ddim_follows_diffusers_step_by_step(objective, steps):
    """Against DDIMScheduler (eta 0, trailing spacing, final alpha 1), every step's timestep and state."""
    noise = torch.randn(2, 1, 4, 4, generator=_gen(2))
    model = _RecordingModel()
    final = sample(model, noise, steps, objective)
    ddim = _sd_scheduler(DDIMScheduler, prediction_type=objective, timestep_spacing="trailing", clip_sample=False,
                         set_alpha_to_one=True)
    ddim.set_timesteps(steps)
    calls, expected = _diffusers_trajectory(ddim, noise)
    _assert_same_trajectory(model.calls, calls, final, expected)


@pytest.mark.parametrize("steps", [1, 8, 30])
def test_flow_matching_euler_follows_diffusers_step_by_step(steps):
    """Against FlowMatchEulerDiscreteScheduler on the same sigmas (1 down to 0 in equal steps)."""
    noise = torch.randn(2, 1, 4, 4, generator=_gen(2))
    model = _RecordingModel()
    final = sample(model, noise, steps, "flow_matching")
    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    euler.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1)[:-1].tolist())
    calls, expected = _diffusers_trajectory(euler, noise)
    _assert_same_trajectory(model.calls, calls, final, expected)


def test_a_wrong_sampler_fails_the_trajectory_check():
    """Reversed timesteps and a DDIM whose previous alpha is the current one both leave diffusers' trajectory."""
    noise = torch.randn(2, 1, 4, 4, generator=_gen(2))
    ddim = _sd_scheduler(DDIMScheduler, prediction_type="epsilon", timestep_spacing="trailing", clip_sample=False)
    ddim.set_timesteps(10)
    calls, expected = _diffusers_trajectory(ddim, noise)
    reversed_ddim = _sd_scheduler(DDIMScheduler, prediction_type="epsilon", timestep_spacing="trailing",
                                  clip_sample=False)
    reversed_ddim.set_timesteps(10)
    reversed_ddim.timesteps = reversed_ddim.timesteps.flip(0)
    wrong_calls, wrong = _diffusers_trajectory(reversed_ddim, noise)
    with pytest.raises(AssertionError):
        _assert_same_trajectory(wrong_calls, calls, wrong, expected)
    one_step_calls, one_step = _diffusers_trajectory(_one_step(), noise)
    with pytest.raises(AssertionError):
        _assert_same_trajectory(one_step_calls, calls, one_step, expected)


def _one_step():
    ddim = _sd_scheduler(DDIMScheduler, prediction_type="epsilon", timestep_spacing="trailing", clip_sample=False)
    ddim.set_timesteps(1)
    return ddim


def test_flow_matching_input_and_target_match_diffusers_and_the_path(make=make_targets):
    """The noisy input is diffusers' `FlowMatchEulerDiscreteScheduler.scale_noise` at sigma = t, the model timestep is
    sigma x 1000 (as diffusers' Flux and SD3 training scripts feed it), and the target is the path's velocity
    d x_t / dt (checked by finite differences, independently of any sign convention: `x0 - noise` fails here, where the
    rest of the suite passed)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    x0, noise = torch.randn(3, 1, 2, 2, generator=_gen(8)), torch.randn(3, 1, 2, 2, generator=_gen(9))
    picked = torch.tensor([100, 500, 850])  # schedule positions: timesteps 900, 500, 150
    timesteps, sigmas = scheduler.timesteps[picked], scheduler.sigmas[picked]
    out = make("flow_matching", x0, noise, sigmas)
    torch.testing.assert_close(out.noisy, scheduler.scale_noise(x0, timesteps, noise), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.model_timestep, timesteps, rtol=0, atol=1e-3)
    h = 1e-3
    ahead = make("flow_matching", x0, noise, sigmas + h).noisy
    torch.testing.assert_close(out.target, (ahead - out.noisy) / h, rtol=0, atol=1e-3)


def test_a_flipped_flow_target_fails_the_path_check():
    """The plant that passed the whole suite once (the central test's reference then shared make_targets)."""
    flipped = planted("diffpipe.diffusion.objectives", "noise - x0)", "x0 - noise)")
    with pytest.raises(AssertionError):
        test_flow_matching_input_and_target_match_diffusers_and_the_path(flipped.make_targets)


@pytest.mark.parametrize("pipeline", ["flux", "qwen_image"])
@pytest.mark.parametrize("side", [512, 1024, 1328])
def test_the_resolution_shift_is_the_pipelines_own_at_each_size(pipeline, side):
    """train.shift = "resolution": the shift FluxPipeline / QwenImagePipeline samples with at a picture's tokens
    (their `calculate_shift`, the scheduler's exponential time shift), from their schedulers' numbers."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from diffpipe.diffusion.timesteps import resolution_shift

    schedule = {"flux": (256, 4096, 0.5, 1.15), "qwen_image": (256, 8192, 0.5, 0.9)}[pipeline]
    tokens = (side // 16) ** 2  # 8x VAE, 2x2 patches
    mu = calculate_shift(tokens, *schedule)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=schedule[0],
                                                max_image_seq_len=schedule[1], base_shift=schedule[2],
                                                max_shift=schedule[3])
    t = torch.linspace(0.05, 0.95, 7)
    s = resolution_shift(tokens, schedule)
    assert math.isclose(s, math.exp(mu), rel_tol=1e-12)
    torch.testing.assert_close(s * t / (1 + (s - 1) * t), scheduler.time_shift(mu, 1.0, t), rtol=1e-6, atol=0)

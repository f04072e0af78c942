"""Training timestep densities, as pure functions returning t in (0, 1) (1 = pure noise), one per sample."""
from __future__ import annotations

import math

import torch

__all__ = ["sample_timesteps", "timestep_quantiles", "resolution_shift", "NUM_TRAIN_TIMESTEPS", "DYNAMIC_SHIFT"]

NUM_TRAIN_TIMESTEPS = 1000
# (base tokens, max tokens, base shift, max shift): FlowMatchEulerDiscreteScheduler's defaults, Flux.1's
DYNAMIC_SHIFT = (256, 4096, 0.5, 1.15)


def _uniform(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=generator)


def _logit_normal(n: int, generator: torch.Generator, mean: float, std: float) -> torch.Tensor:
    """Logit-normal density (Esser et al., SD3, arXiv:2403.03206, section 3.1)."""
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator))


def _shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Resolution-dependent shift t' = s t / (1 + (s - 1) t) (SD3, section 5.3.2)."""
    return shift * t / (1 + (shift - 1) * t)


def resolution_shift(tokens: int, schedule: tuple[int, int, float, float] = DYNAMIC_SHIFT) -> float:
    """The shift s = e^mu a dynamically shifting flow-matching pipeline samples with at `tokens` latent tokens (Flux's
    and QwenImagePipeline's `calculate_shift`: mu linear in the tokens between (base tokens, base shift) and (max
    tokens, max shift)); its exponential time shift e^mu / (e^mu + 1/t - 1) is SD3's s t / (1 + (s - 1) t)."""
    base_tokens, max_tokens, base_shift, max_shift = schedule
    return math.exp(base_shift + (max_shift - base_shift) / (max_tokens - base_tokens) * (tokens - base_tokens))


def _importance(n: int, generator: torch.Generator) -> torch.Tensor:
    """Discrete steps k = 0..999 drawn with p(k) proportional to 0.99^k, returned as (k + 0.5) / 1000."""
    k = torch.arange(NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
    weights = 0.99 ** k
    idx = torch.multinomial(weights, n, replacement=True, generator=generator)
    return ((idx.float() + 0.5) / NUM_TRAIN_TIMESTEPS)


def sample_timesteps(kind: str, n: int, generator: torch.Generator, *, logit_mean: float = 0.0,
                     logit_std: float = 1.0, shift: float = 3.0,
                     within: tuple[float, float] | None = None) -> torch.Tensor:
    """n timesteps in (0, 1) from the named density: uniform, logit_normal, shift (of uniform), importance; `within`
    (low, high): from the density cut to that range (its inverse CDF at uniform draws between the CDF's values at the
    two ends), the draws of a run without it unchanged."""
    if within is not None:
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return timestep_quantiles(kind, u.tolist(), logit_mean=logit_mean, logit_std=logit_std, shift=shift,
                                  within=within)
    if kind == "uniform":
        t = _uniform(n, generator)
    elif kind == "logit_normal":
        t = _logit_normal(n, generator, logit_mean, logit_std)
    elif kind == "shift":
        t = _shift(_uniform(n, generator), shift)
    elif kind == "importance":
        t = _importance(n, generator)
    else:
        raise ValueError(f"unknown timestep sampling {kind!r}")
    return t.clamp(1e-5, 1 - 1e-5)


def timestep_quantiles(kind: str, quantiles: list[float], *, logit_mean: float = 0.0, logit_std: float = 1.0,
                       shift: float = 3.0, within: tuple[float, float] | None = None) -> torch.Tensor:
    """The timesteps t in (0, 1) at the given quantiles of the named training density (its inverse CDF): the fixed
    timesteps an eval loss is measured at, so it compares across evaluations. `within` (low, high): of the density
    cut to that range."""
    q = torch.tensor(quantiles, dtype=torch.float64)
    if within is not None:
        ends = _cdf(kind, torch.tensor(within, dtype=torch.float64), logit_mean, logit_std, shift)
        q = ends[0] + q * (ends[1] - ends[0])
        low, high = within
        return _inverse_cdf(kind, q, logit_mean, logit_std, shift).clamp(max(low, 1e-5), min(high, 1 - 1e-5)).float()
    return _inverse_cdf(kind, q, logit_mean, logit_std, shift).float().clamp(1e-5, 1 - 1e-5)


def _inverse_cdf(kind: str, q: torch.Tensor, logit_mean: float, logit_std: float, shift: float) -> torch.Tensor:
    if kind == "uniform":
        t = q
    elif kind == "logit_normal":
        t = torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(q))
    elif kind == "shift":
        t = _shift(q, shift)
    elif kind == "importance":
        k = torch.arange(NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
        cdf = torch.cumsum(0.99 ** k, 0) / (0.99 ** k).sum()
        t = (torch.searchsorted(cdf, q).double() + 0.5) / NUM_TRAIN_TIMESTEPS
    else:
        raise ValueError(f"unknown timestep sampling {kind!r}")
    return t


def _cdf(kind: str, t: torch.Tensor, logit_mean: float, logit_std: float, shift: float) -> torch.Tensor:
    """The named density's CDF at t in [0, 1] (float64)."""
    if kind == "uniform":
        return t
    if kind == "logit_normal":
        logit = torch.logit(t.clamp(1e-12, 1 - 1e-12))
        return torch.special.ndtr((logit - logit_mean) / logit_std)
    if kind == "shift":  # t = s u / (1 + (s - 1) u)  <=>  u = t / (s - (s - 1) t)
        return t / (shift - (shift - 1) * t)
    if kind == "importance":  # steps k with (k + 0.5) / 1000 <= t: the mass of those below t
        k = torch.arange(NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
        cdf = torch.cumsum(0.99 ** k, 0) / (0.99 ** k).sum()
        below = torch.floor(t * NUM_TRAIN_TIMESTEPS - 0.5).clamp(-1, NUM_TRAIN_TIMESTEPS - 1).long()
        return torch.where(below >= 0, cdf[below.clamp(min=0)], torch.zeros_like(t))
    raise ValueError(f"unknown timestep sampling {kind!r}")

"""Training timestep densities, as pure functions returning t in (0, 1) (1 = pure noise), one per sample."""
from __future__ import annotations

import torch

__all__ = ["sample_timesteps", "timestep_quantiles", "NUM_TRAIN_TIMESTEPS"]

NUM_TRAIN_TIMESTEPS = 1000


def _uniform(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=generator)


def _logit_normal(n: int, generator: torch.Generator, mean: float, std: float) -> torch.Tensor:
    """Logit-normal density (Esser et al., SD3, arXiv:2403.03206, section 3.1)."""
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator))


def _shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Resolution-dependent shift t' = s t / (1 + (s - 1) t) (SD3, section 5.3.2)."""
    return shift * t / (1 + (shift - 1) * t)


def _importance(n: int, generator: torch.Generator) -> torch.Tensor:
    """Discrete steps k = 0..999 drawn with p(k) proportional to 0.99^k, returned as (k + 0.5) / 1000."""
    k = torch.arange(NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
    weights = 0.99 ** k
    idx = torch.multinomial(weights, n, replacement=True, generator=generator)
    return ((idx.float() + 0.5) / NUM_TRAIN_TIMESTEPS)


def sample_timesteps(kind: str, n: int, generator: torch.Generator, *, logit_mean: float = 0.0,
                     logit_std: float = 1.0, shift: float = 3.0) -> torch.Tensor:
    """n timesteps in (0, 1) from the named density: uniform, logit_normal, shift (of uniform), importance."""
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
                       shift: float = 3.0) -> torch.Tensor:
    """The timesteps t in (0, 1) at the given quantiles of the named training density (its inverse CDF): the fixed
    timesteps an eval loss is measured at, so it compares across evaluations."""
    q = torch.tensor(quantiles, dtype=torch.float64)
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
    return t.float().clamp(1e-5, 1 - 1e-5)

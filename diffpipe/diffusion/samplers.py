"""Samplers over any denoiser `predict(x, model_timestep) -> model output`: Euler for flow matching, DDIM otherwise."""
from __future__ import annotations

from typing import Callable

import torch

from .objectives import alphas_cumprod
from .timesteps import NUM_TRAIN_TIMESTEPS

__all__ = ["sample", "ddim_timesteps"]

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _euler_flow(predict: Predict, x: torch.Tensor, steps: int) -> torch.Tensor:
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = predict(x, torch.full((x.shape[0],), float(t) * NUM_TRAIN_TIMESTEPS))
        x = x + (t_next - t) * v
    return x


def ddim_timesteps(steps: int) -> torch.Tensor:
    """Trailing spacing (Lin et al., arXiv:2305.08891, table 2; diffusers' timestep_spacing="trailing"): the first
    step starts from the noisiest timestep, 999, and the last from about 1000 / steps - 1, towards alpha = 1."""
    return (torch.arange(NUM_TRAIN_TIMESTEPS, 0, -NUM_TRAIN_TIMESTEPS / steps, dtype=torch.float64).round() - 1).long()


def _ddim(predict: Predict, x: torch.Tensor, steps: int, objective: str) -> torch.Tensor:
    """Deterministic DDIM (Song et al., arXiv:2010.02502), eta = 0, trailing timestep spacing."""
    abar = alphas_cumprod().float()
    ts = ddim_timesteps(steps)
    for i, step in enumerate(ts):
        a = abar[step]
        out = predict(x, torch.full((x.shape[0],), float(step)))
        if objective == "epsilon":
            eps = out
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        else:  # v_prediction
            x0 = a.sqrt() * x - (1 - a).sqrt() * out
            eps = (1 - a).sqrt() * x + a.sqrt() * out
        a_prev = abar[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0)
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x


@torch.no_grad()
def sample(predict: Predict, noise: torch.Tensor, steps: int, objective: str) -> torch.Tensor:
    if objective == "flow_matching":
        return _euler_flow(predict, noise, steps)
    return _ddim(predict, noise, steps, objective)

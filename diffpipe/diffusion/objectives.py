"""Diffusion objectives as pure functions: noisy input, model timestep and regression target from (x0, noise, t).

t in (0, 1) is the fraction of the way to pure noise. epsilon and v_prediction use the discrete DDPM
schedule (scaled-linear betas, as Stable Diffusion); flow_matching uses the rectified-flow path
x_t = (1 - t) x0 + t noise with velocity target noise - x0 (Liu et al., arXiv:2209.03003).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .timesteps import NUM_TRAIN_TIMESTEPS

__all__ = ["TrainingTargets", "make_targets", "model_timesteps", "alphas_cumprod", "discrete_step", "min_snr_weights", "with_weights",
           "weighted_mse", "with_element_weights", "element_weighted_mse"]


@dataclass
class TrainingTargets:
    noisy: torch.Tensor
    model_timestep: torch.Tensor  # what the backbone's time embedding receives, 0..1000
    target: torch.Tensor


def alphas_cumprod(beta_start: float = 0.00085, beta_end: float = 0.012) -> torch.Tensor:
    """Scaled-linear beta schedule of Stable Diffusion (Rombach et al., arXiv:2112.10752)."""
    betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, NUM_TRAIN_TIMESTEPS, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def discrete_step(t: torch.Tensor) -> torch.Tensor:
    return (t * NUM_TRAIN_TIMESTEPS).long().clamp(0, NUM_TRAIN_TIMESTEPS - 1)


def _broadcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def model_timesteps(objective: str, t: torch.Tensor) -> torch.Tensor:
    """What the backbone's time embedding receives for timesteps t in (0, 1): t x 1000 for flow matching, the
    discrete step (as a float) otherwise."""
    return t * NUM_TRAIN_TIMESTEPS if objective == "flow_matching" else discrete_step(t).float()


def make_targets(objective: str, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> TrainingTargets:
    if objective == "flow_matching":
        tt = _broadcast(t, x0)
        return TrainingTargets((1 - tt) * x0 + tt * noise, model_timesteps(objective, t), noise - x0)
    step = discrete_step(t)
    abar = alphas_cumprod()[step]
    a, s = _broadcast(abar.sqrt(), x0), _broadcast((1 - abar).sqrt(), x0)
    noisy = a * x0 + s * noise
    if objective == "epsilon":
        target = noise
    elif objective == "v_prediction":
        target = a * noise - s * x0  # Salimans & Ho, arXiv:2202.00512
    else:
        raise ValueError(f"unknown objective {objective!r}")
    return TrainingTargets(noisy, model_timesteps(objective, t), target)


def min_snr_weights(objective: str, t: torch.Tensor, gamma: float) -> torch.Tensor:
    """Each sample's loss weight under min-SNR-gamma (Hang et al., arXiv:2303.09556), as diffusers' training scripts
    compute it: min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v-prediction; SNR = abar / (1 - abar)."""
    abar = alphas_cumprod()[discrete_step(t)]
    snr = abar / (1 - abar)
    clipped = torch.minimum(snr, torch.full_like(snr, gamma))
    if objective == "epsilon":
        return (clipped / snr).float()
    if objective == "v_prediction":
        return (clipped / (snr + 1)).float()
    raise ValueError(f"min-SNR weighting is defined for epsilon and v_prediction, not {objective!r}")


def with_weights(target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`target` (B, ..., W) with each sample's loss weight appended along its last dimension (B, ..., W + 1): the
    pipeline splits only the target among micro-batches and hands it to the loss, so the weights travel in it."""
    column = weights.to(target.dtype).view(-1, *([1] * (target.dim() - 1))).expand(*target.shape[:-1], 1)
    return torch.cat([target, column], dim=-1)


def weighted_mse(output: torch.Tensor, weighted_target: torch.Tensor) -> torch.Tensor:
    """The mean over samples of weight x (that sample's mean squared error), from a target made by `with_weights`."""
    target, weight = weighted_target[..., :-1], weighted_target[..., -1:]
    return (weight.float() * (output.float() - target.float()).square()).mean()


def with_element_weights(target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`target` (B, ..., W) with a loss weight for each of its elements appended along its last dimension
    (B, ..., 2W): data.mask_path's masks (times any min-SNR weight), laid out as the target is."""
    return torch.cat([target, weights.to(target.dtype).expand_as(target)], dim=-1)


def element_weighted_mse(output: torch.Tensor, weighted_target: torch.Tensor) -> torch.Tensor:
    """The mean over every element of weight x squared error, from a target made by `with_element_weights`: a masked
    loss as kohya's `apply_masked_loss` computes it (masked-out elements count as zeros in the mean, so a sample's
    loss shrinks with its mask's area, as theirs does)."""
    width = weighted_target.shape[-1] // 2
    target, weight = weighted_target[..., :width], weighted_target[..., width:]
    return (weight.float() * (output.float() - target.float()).square()).mean()

"""Multi-resolution ("pyramid") training noise (Whitaker's multires noise; kohya's `multires_noise_iterations` and
`multires_noise_discount`): Gaussian noise drawn at ever coarser sizes, each enlarged (bilinear) to the latent's and
added with weight discount^i, then scaled back to unit standard deviation. Its low frequencies carry more energy than
plain noise's, so the model learns to change an image's broad light and colour, as train.noise_offset does in one
number per channel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["multires_noise"]


def multires_noise(noise: torch.Tensor, generator: torch.Generator, iterations: int, discount: float) -> torch.Tensor:
    """`noise` (samples, channels[, frames], height, width) with `iterations` layers added as kohya's
    `pyramid_noise_like` adds them (layer i, from 0, drawn at height and width / r^i, r drawn in [2, 4) per layer,
    until a side reaches 1; the frames of a clip each get their own), each sample scaled back to standard deviation 1
    (kohya scales the whole batch at once). Draws from `generator` only."""
    height, width = noise.shape[-2:]
    lead = noise.shape[:-2]
    layered = noise.clone()
    for i in range(iterations):
        r = 2.0 + 2.0 * torch.rand((), generator=generator).item()
        h, w = max(1, int(height / r ** i)), max(1, int(width / r ** i))
        coarse = torch.randn((1, lead.numel(), h, w), generator=generator, dtype=noise.dtype)
        layered += F.interpolate(coarse, size=(height, width), mode="bilinear").view(noise.shape) * discount ** i
        if h == 1 or w == 1:
            break
    flat = layered.flatten(1)
    return (flat / flat.std(dim=1, keepdim=True)).view(noise.shape)

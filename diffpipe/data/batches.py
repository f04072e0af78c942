"""The batch of a step, the same on every process and for every stage count.

Every random draw of a step (data order, caption dropout, timesteps, noise) comes from one generator
seeded by (seed, step) over the global batch; each data-parallel replica then takes its slice. So a run
with 1, 2 or 4 stages sees exactly the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..diffusion.objectives import make_targets
from ..diffusion.timesteps import sample_timesteps
from ..models.text import TextEncoder

__all__ = ["StepBatch", "BatchMaker"]


@dataclass
class StepBatch:
    noisy: torch.Tensor
    target: torch.Tensor
    conditions: dict[str, torch.Tensor]

    def to(self, device: torch.device) -> "StepBatch":
        """On `device`; a GPU copies from pinned host memory without making the host wait."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return StepBatch(move(self.noisy), move(self.target), {k: move(v) for k, v in self.conditions.items()})


class BatchMaker:
    def __init__(self, images: torch.Tensor, captions: list[str], text: TextEncoder, train: TrainConfig,
                 caption_dropout: float, conditions: tuple[str, ...]):
        self.images, self.captions, self.text = images, captions, text
        self.train, self.caption_dropout, self.conditions = train, caption_dropout, conditions

    def _indices(self, step: int) -> torch.Tensor:
        """Sample order: a fresh seeded permutation per epoch, batches taken in turn (wrapping)."""
        n, b = len(self.images), self.train.batch_size
        start = step * b
        out = []
        while len(out) < b:
            epoch, offset = divmod(start + len(out), n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.train.seed * 7919 + epoch))
            out.extend(perm[offset:offset + b - len(out)].tolist())
        return torch.tensor(out)

    def text_conditions(self, captions: list[str], height: int, width: int) -> dict[str, torch.Tensor]:
        hidden, pooled = self.text.encode(captions)
        named = {"encoder_hidden_states": hidden}
        if "text_embeds" in self.conditions:  # SDXL-style: pooled text and (original size, crop, target size)
            named["text_embeds"] = pooled
            named["time_ids"] = torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32
                                             ).expand(len(captions), 6).contiguous()
        return named

    def make(self, step: int, dp_rank: int, dp_size: int) -> StepBatch:
        gen = torch.Generator().manual_seed(self.train.seed * 1_000_003 + step)
        idx = self._indices(step)
        x0 = self.images[idx]
        drop = torch.rand(len(idx), generator=gen) < self.caption_dropout
        captions = ["" if d else self.captions[i] for i, d in zip(idx.tolist(), drop.tolist())]
        t = sample_timesteps(self.train.timestep_sampling, len(idx), gen, logit_mean=self.train.logit_mean,
                             logit_std=self.train.logit_std, shift=self.train.shift)
        noise = torch.randn(x0.shape, generator=gen)
        targets = make_targets(self.train.objective, x0, noise, t)
        per = len(idx) // dp_size
        part = slice(dp_rank * per, (dp_rank + 1) * per)
        conditions = self.text_conditions(captions[part], x0.shape[-2], x0.shape[-1])
        conditions["timestep"] = targets.model_timestep[part]
        return StepBatch(targets.noisy[part].contiguous(), targets.target[part].contiguous(), conditions)

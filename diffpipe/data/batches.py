"""The batch of a step, the same on every process and for every stage count.

Every random draw of a step (data order, caption dropout, timesteps, noise) comes from one generator
seeded by (seed, step) over the global batch; each data-parallel replica then takes its slice. So a run
with 1, 2 or 4 stages sees exactly the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import seeds
from ..config import DataConfig, TrainConfig
from ..diffusion.noise import multires_noise
from ..diffusion.objectives import make_targets, min_snr_weights, model_timesteps, with_element_weights, with_weights
from ..diffusion.timesteps import DYNAMIC_SHIFT, resolution_shift, sample_timesteps, timestep_quantiles
from ..models.family import Feed
from ..models.text import CaptionEncoder

__all__ = ["StepBatch", "StepDraw", "BatchMaker", "TensorImages", "square_size_ids", "fixed_batches", "step_texts"]


@dataclass
class StepBatch:
    noisy: torch.Tensor
    target: torch.Tensor
    conditions: dict[str, torch.Tensor]
    # the model timesteps of the step's whole global batch, every replica's, kept on the host (a training step's
    # only): which experts of a two-expert model the step trains, known without asking the device or the replicas
    step_timesteps: torch.Tensor | None = None

    def to(self, device: torch.device) -> "StepBatch":
        """On `device` (`step_timesteps` stays on the host); a GPU copies from pinned host memory without making the
        host wait."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return StepBatch(move(self.noisy), move(self.target), {k: move(v) for k, v in self.conditions.items()},
                         self.step_timesteps)


@dataclass
class StepDraw:
    """The random numbers of a step's global batch: which items, their captions (after caption dropout), each item's
    timestep t in (0, 1) and its noise. Each data-parallel replica takes its slice."""

    indices: list[int]
    captions: list[str]
    t: torch.Tensor
    noise: torch.Tensor


class TensorImages:
    """Images (or latents) held as one tensor (N, C, H, W) with captions: digits and synthetic data. Sample order:
    a fresh seeded permutation per epoch, batches taken in turn (wrapping across epochs).

    The data a run trains on, this or data/images.py's FolderImages, has: `captions`, `batch_indices`, `groups`,
    `x0`, `size_ids`, `control_latents` (None without data.control_path), and `vae` (decodes samples during training), `skipped` (files left out), `held_out` (the
    eval split) and `summary` (a line for the log), each None where the data has none."""

    vae = None
    skipped = None
    held_out = None

    def __init__(self, images: torch.Tensor, captions: list[str], controls: torch.Tensor | None = None):
        self.images, self.captions, self.controls = images, captions, controls

    def summary(self, held_out) -> str | None:
        return None

    def steps_per_epoch(self, batch_size: int) -> float:
        """Batches are taken in turn across epochs: an epoch is a fraction of a step past a whole number of them."""
        return len(self.images) / batch_size

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        n = len(self.images)
        start = step * batch_size
        out: list[int] = []
        while len(out) < batch_size:
            epoch, offset = divmod(start + len(out), n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seeds.of_epoch(seed, epoch)))
            out.extend(perm[offset:offset + batch_size - len(out)].tolist())
        return out

    def groups(self) -> list[list[int]]:
        return [list(range(len(self.images)))]

    def x0(self, indices: list[int]) -> torch.Tensor:
        return self.images[torch.tensor(indices)]

    def size_ids(self, indices: list[int]) -> torch.Tensor:
        return square_size_ids(len(indices), *self.images.shape[-2:])

    def control_latents(self, indices: list[int]) -> torch.Tensor | None:
        """An edit model's control latents of the items (synthetic data's), or None."""
        return None if self.controls is None else self.controls[torch.tensor(indices)]

    def control_pictures(self, indices: list[int]) -> list[str] | None:
        """None: synthetic controls are latents, no pictures, so a text encoder that reads pictures reads the
        captions alone."""
        return None


def step_texts(text: CaptionEncoder, data) -> list[str]:
    """Every text a step over `data` may ask `text` for: each item's caption and "" (a caption dropped for
    guidance), each with the item's control picture where the encoder reads pictures (CaptionEncoder.texts)."""
    pictures = data.control_pictures(list(range(len(data.captions))))
    return text.texts(list(data.captions), pictures) + text.texts([""] * len(data.captions), pictures)


def fixed_batches(data, batch_size: int) -> list[list[int]]:
    """Every item once, in batches of `batch_size` from one group (bucket) each; a group's last batch is filled up
    from its start. The same list every time: what an eval loss runs over."""
    batches = []
    for group in data.groups():
        for start in range(0, len(group), batch_size):
            batch = group[start:start + batch_size]
            batches.append([group[i % len(group)] for i in range(start, start + batch_size)] if len(batch) < batch_size
                           else batch)
    return batches


def square_size_ids(n: int, height: int, width: int) -> torch.Tensor:
    """SDXL's time ids of uncropped images: (height, width, 0, 0, height, width) each."""
    return torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32).expand(n, 6).contiguous()


def _retagged(caption: str, tags: "CaptionTags", gen: torch.Generator) -> str:
    """The caption's comma-separated tags after the first `tags.kept`, each dropped with probability `tags.dropout`
    and the rest put in a random order when `tags.shuffle` (kohya's caption_tag_dropout_rate, shuffle_caption)."""
    parts = [tag.strip() for tag in caption.split(",")]
    head, rest = parts[:tags.kept], parts[tags.kept:]
    if not rest:
        return caption
    if tags.dropout:
        rest = [tag for tag, u in zip(rest, torch.rand(len(rest), generator=gen).tolist()) if u >= tags.dropout]
    if tags.shuffle and len(rest) > 1:
        rest = [rest[i] for i in torch.randperm(len(rest), generator=gen).tolist()]
    return ", ".join(head + rest)


@dataclass(frozen=True)
class CaptionTags:
    """How a training caption's comma-separated tags change every step (data.caption_shuffle, tag_dropout,
    keep_tokens)."""

    shuffle: bool = False
    dropout: float = 0.0
    kept: int = 0

    @property
    def changes(self) -> bool:
        return self.shuffle or self.dropout > 0


def loss_weighting(train: TrainConfig, data: DataConfig) -> str:
    """What a training target carries beside the target itself, for the loss to read (train/run_parts.py): a loss
    weight per element (data.mask_path's masks: `with_element_weights`), per sample (train.min_snr_gamma,
    data.regularisation_path's images: `with_weights`), or none."""
    if data.mask_path:
        return "elements"
    return "samples" if train.min_snr_gamma > 0 or data.regularisation_path else "none"


class BatchMaker:
    """A step's batch from a dataset with `captions`, `batch_indices(step, batch_size, seed)`, `x0(indices)` and
    `size_ids(indices)` (TensorImages, data/images.py's FolderImages), fed as the model's family asks (`feed`:
    its named conditions and its latent layout); its targets carry the loss weights `weighting` names
    (`loss_weighting`)."""

    def __init__(self, data, text: CaptionEncoder, train: TrainConfig, caption_dropout: float, feed: Feed,
                 tags: CaptionTags = CaptionTags(), weighting: str = "none",
                 timesteps_within: tuple[float, float] | None = None,
                 shift_schedule: tuple[int, int, float, float] = DYNAMIC_SHIFT):
        self.data, self.text = data, text
        self.train, self.caption_dropout, self.feed = train, caption_dropout, feed
        self.tags, self.weighting = tags, weighting
        self.timesteps_within = timesteps_within  # build.timestep_range: an expert's, train.timestep_range
        self.shift_schedule = shift_schedule  # build.shift_schedule: train.shift = "resolution"'s line

    def shift_for(self, item_shape: tuple[int, ...]) -> float:
        """train.shift, or with "resolution" the shift at items of `item_shape`'s latent tokens (channels, [frames,]
        height, width; sides over the family's patch)."""
        if self.train.shift != "resolution":
            return self.train.shift
        patch = self.feed.family.latent_multiple(self.feed.cfg)
        return resolution_shift(math.prod(item_shape[1:]) // patch**2, self.shift_schedule)

    def text_conditions(self, captions: list[str], size_ids: torch.Tensor, latent_size: tuple[int, int],
                        control: torch.Tensor | None = None, pictures: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The named conditions of the captions (and of an edit model's control latents); `pictures`: the keys of
        the controls' pictures, read with the captions by a text encoder that reads pictures (Qwen-Image-Edit's)."""
        texts = self.text.texts(captions, pictures)
        hidden, pooled = self.text.encode(texts)
        filled = self.text.filled_lengths(texts, hidden) if self.feed.family.reads_text_lengths else None
        return self.feed.conditions(hidden, pooled, size_ids, latent_size, filled, control)

    def draw(self, step: int, item_shape: tuple[int, ...]) -> StepDraw:
        """Every random number of step `step`'s global batch (items of `item_shape`): the same on every process."""
        gen = torch.Generator().manual_seed(seeds.of_step(self.train.seed, step))
        idx = self.data.batch_indices(step, self.train.batch_size, self.train.seed)
        drop = torch.rand(len(idx), generator=gen) < self.caption_dropout
        captions = ["" if d else self.data.captions[i] for i, d in zip(idx, drop.tolist())]
        t = sample_timesteps(self.train.timestep_sampling, len(idx), gen, logit_mean=self.train.logit_mean,
                             logit_std=self.train.logit_std, shift=self.shift_for(item_shape),
                             within=self.timesteps_within)
        noise = torch.randn((len(idx), *item_shape), generator=gen)
        if self.train.noise_offset:  # drawn after the rest: without it every run keeps the same numbers
            per_channel = torch.randn((len(idx), item_shape[0]) + (1,) * (len(item_shape) - 1), generator=gen)
            noise = noise + self.train.noise_offset * per_channel
        if self.tags.changes:  # last, for the same reason
            captions = [_retagged(c, self.tags, gen) for c in captions]
        if self.train.multires_noise_iterations:  # after the noise offset, as kohya applies them; drawn last
            noise = multires_noise(noise, gen, self.train.multires_noise_iterations,
                                   self.train.multires_noise_discount)
        return StepDraw(idx, captions, t, noise)

    def make(self, step: int, dp_rank: int, dp_size: int) -> StepBatch:
        idx = self.data.batch_indices(step, self.train.batch_size, self.train.seed)
        per = len(idx) // dp_size
        part = slice(dp_rank * per, (dp_rank + 1) * per)
        mine = idx[part]  # only this replica's images are read (and, uncached, encoded)
        x0 = self.data.x0(mine)
        drawn = self.draw(step, tuple(x0.shape[1:]))
        conditions = self.text_conditions(drawn.captions[part], self.data.size_ids(mine), x0.shape[2:],
                                          self.data.control_latents(mine), self.data.control_pictures(mine))
        masks = self.data.loss_masks(mine, x0.shape[-2:]) if self.weighting == "elements" else None
        # image folders' items weigh their own (regularisation images); other data's weigh 1
        items = self.data.loss_weights(mine) if self.weighting != "none" and hasattr(self.data, "loss_weights") else None
        batch = self._batch(x0, drawn.noise[part], drawn.t[part], conditions, masks=masks, item_weights=items)
        batch.step_timesteps = model_timesteps(self.train.objective, drawn.t)
        return batch

    def eval_timesteps(self, item_shape: tuple[int, ...]) -> list[float]:
        """The timesteps an eval loss of items of `item_shape` is measured at: train.eval_quantiles of the density
        the run trains such items with (cut to its range, at their shift), so evaluations compare."""
        train = self.train
        return timestep_quantiles(train.timestep_sampling, train.eval_quantiles, logit_mean=train.logit_mean,
                                  logit_std=train.logit_std, shift=self.shift_for(item_shape),
                                  within=self.timesteps_within).tolist()

    def make_fixed(self, data, indices: list[int], noise_seed: int, dp_rank: int, dp_size: int) -> list[StepBatch]:
        """This replica's slice of a batch of the given items of `data` at each of `eval_timesteps` (the items read
        and the captions encoded once), with noise drawn from `noise_seed` and every caption kept: the same numbers
        each time it is asked for (eval)."""
        per = len(indices) // dp_size
        part = slice(dp_rank * per, (dp_rank + 1) * per)
        mine = indices[part]
        x0 = data.x0(mine)
        noise = torch.randn((len(indices), *x0.shape[1:]), generator=torch.Generator().manual_seed(noise_seed))[part]
        conditions = self.text_conditions([data.captions[i] for i in mine], data.size_ids(mine), x0.shape[2:],
                                          data.control_latents(mine), data.control_pictures(mine))
        return [self._batch(x0, noise, torch.full((len(mine),), t), conditions, weighted=False)
                for t in self.eval_timesteps(tuple(x0.shape[1:]))]

    def _batch(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
               conditions: dict[str, torch.Tensor], weighted: bool = True,
               masks: torch.Tensor | None = None, item_weights: torch.Tensor | None = None) -> StepBatch:
        """This replica's items noised to timesteps t, with their text conditions, in the layout the backbone reads.
        With train.min_snr_gamma the target carries each sample's loss weight (`with_weights`): min-SNR's when
        `weighted`, else 1 (eval), times the items' own (`item_weights`: regularisation images'). With data.mask_path
        it carries a weight per element instead (`with_element_weights`): the items' `masks` times those per-sample
        weights, packed as the target; 1 for eval."""
        targets = make_targets(self.train.objective, x0, noise, t)
        target = targets.target
        if (clean := self.feed.clean_latents(conditions, x0.shape[2:])) is not None:
            target = target * (1 - clean[0].to(target.device))  # latents given clean: nothing to predict (zero)
        noisy, target = self.feed.pack(targets.noisy), self.feed.pack_prediction(target)
        weights = (min_snr_weights(self.train.objective, t, self.train.min_snr_gamma)
                   if self.train.min_snr_gamma and weighted else torch.ones(len(t)))
        if item_weights is not None and weighted:
            weights = weights * item_weights
        if self.weighting == "elements":
            per_element = weights.view(-1, *([1] * (x0.dim() - 1))) * (masks if masks is not None and weighted else 1)
            target = with_element_weights(target, self.feed.pack_prediction(per_element.expand_as(targets.target).contiguous()))
        elif self.weighting == "samples":
            target = with_weights(target, weights)
        return StepBatch(noisy.contiguous(), target.contiguous(), dict(conditions, timestep=targets.model_timestep))

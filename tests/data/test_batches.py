"""A step's random numbers (`BatchMaker.draw`): train.noise_offset adds one Gaussian number per sample and channel,
the same over every pixel and frame, and leaves every other number of the step as it was."""
from __future__ import annotations

import pytest
import torch

from diffpipe.config import build_config
from diffpipe.data.batches import BatchMaker
from diffpipe.data import make_dataset


def _draw(noise_offset: float, item_shape: tuple[int, ...], step: int = 3):
    config = build_config({"data": {"dataset": "synthetic"}, "train": {"batch_size": 64, "noise_offset": noise_offset}})
    data = make_dataset("synthetic", item_shape, seed=0)
    return BatchMaker(data, None, config.train, 0.1, None).draw(step, item_shape)


@pytest.mark.parametrize("item_shape", [(4, 16, 12), (16, 3, 8, 8)])  # images; clips (channels, frames, h, w)
def test_the_noise_offset_is_one_number_per_sample_and_channel_on_top_of_the_same_noise(item_shape):
    plain, offset = _draw(0.0, item_shape), _draw(0.1, item_shape)
    assert plain.indices == offset.indices and plain.captions == offset.captions
    assert torch.equal(plain.t, offset.t)
    added = offset.noise - plain.noise
    flat = added.flatten(2)  # (sample, channel, every pixel and frame)
    assert (flat.max(-1).values - flat.min(-1).values).max() < 1e-6  # the same over the whole item
    per_channel = flat[..., 0]
    assert per_channel.std() == pytest.approx(0.1, rel=0.25)  # 64 x C draws of 0.1 N(0, 1)
    assert (per_channel[:, 0] - per_channel[:, 1]).abs().max() > 1e-3  # each channel its own

"""A step's random numbers (`BatchMaker.draw`): train.noise_offset adds one Gaussian number per sample and channel,
the same over every pixel and frame; data.caption_shuffle and data.tag_dropout change each caption's tags after the
kept ones; each leaves every other number of the step as it was."""
from __future__ import annotations

import pytest
import torch

from diffpipe.config_files import build_config
from diffpipe.data import make_dataset
from diffpipe.data.batches import BatchMaker, CaptionTags


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


TAGGED = "sks dog, red collar, on grass, sunny, photo"


def _drawn_captions(tags: CaptionTags, steps: range, written: tuple[str, ...] = (TAGGED, "sks dog, sitting",
                                                                                 "a plain caption")) -> list[list[str]]:
    from diffpipe.data.batches import TensorImages

    config = build_config({"data": {"dataset": "synthetic"}, "train": {"batch_size": 4}})
    captions = list(written) * 4
    data = TensorImages(torch.zeros(len(captions), 1, 2, 2), captions)
    maker = BatchMaker(data, None, config.train, 0.0, None, tags)
    return [maker.draw(step, (1, 2, 2)).captions for step in steps]


def test_caption_shuffle_reorders_the_tags_after_the_kept_ones_and_nothing_else():
    """kohya's shuffle_caption with keep_tokens = 1: the trigger word stays first, the other tags change places from
    step to step, no tag is lost or made; a caption of one tag after the kept ones, or none, is left as written."""
    plain, shuffled = _drawn_captions(CaptionTags(), range(12)), _drawn_captions(CaptionTags(True, 0.0, 1), range(12))
    orders = set()
    for written, drawn in zip(sum(plain, []), sum(shuffled, [])):
        tags = [t.strip() for t in written.split(",")]
        got = drawn.split(", ")
        assert got[0] == tags[0] and sorted(got) == sorted(tags)
        if len(tags) <= 2:
            assert drawn == written
        else:
            orders.add(drawn)
    assert len(orders) > 3  # the four-tag caption came in several orders
    assert _drawn_captions(CaptionTags(True, 0.0, 1), range(12)) == shuffled  # from (seed, step): every process alike


def test_tag_dropout_drops_tags_after_the_kept_ones_at_its_rate_and_keeps_their_order():
    written = TAGGED.split(", ")
    drawn = [c for step in _drawn_captions(CaptionTags(False, 0.5, 1), range(40), (TAGGED,)) for c in step]
    for caption in drawn:
        got = caption.split(", ")
        assert got[0] == written[0]  # the kept tag: never dropped
        assert got[1:] == [t for t in written[1:] if t in got[1:]]  # the rest in their written order
    kept = sum(len(c.split(", ")) - 1 for c in drawn)
    assert 0.4 < kept / (4 * len(drawn)) < 0.6  # 640 tags, each kept with probability 0.5


def _multires(iterations: int, item_shape: tuple[int, ...], discount: float = 0.3):
    config = build_config({"data": {"dataset": "synthetic"}, "train": {
        "batch_size": 16, "multires_noise_iterations": iterations, "multires_noise_discount": discount}})
    data = make_dataset("synthetic", item_shape, seed=0)
    return BatchMaker(data, None, config.train, 0.1, None).draw(3, item_shape)


@pytest.mark.parametrize("item_shape", [(4, 64, 48), (16, 3, 32, 32)])  # images; clips (channels, frames, h, w)
def test_multires_noise_adds_coarse_layers_scaled_back_to_unit_variance(item_shape):
    """kohya's pyramid noise: the same draws otherwise, each sample at standard deviation 1, and far more of its
    energy in broad areas: the mean of each 8 x 8 patch varies about 1/64 for plain noise, several times that at
    discount 0.8, more than plain at kohya's 0.3 (seen failing with the coarse layers left out)."""
    plain, layered = _multires(0, item_shape), _multires(8, item_shape, discount=0.8)
    assert plain.indices == layered.indices and plain.captions == layered.captions and torch.equal(plain.t, layered.t)
    assert layered.noise.shape == plain.noise.shape
    torch.testing.assert_close(layered.noise.flatten(1).std(dim=1), torch.ones(16))
    patches = torch.nn.functional.avg_pool2d(layered.noise.flatten(0, -3)[:, None], 8)
    plain_patches = torch.nn.functional.avg_pool2d(plain.noise.flatten(0, -3)[:, None], 8)
    assert plain_patches.var() == pytest.approx(1 / 64, rel=0.2)
    assert patches.var() > 4 * plain_patches.var()
    mild = torch.nn.functional.avg_pool2d(_multires(8, item_shape).noise.flatten(0, -3)[:, None], 8)
    assert 1.2 * plain_patches.var() < mild.var() < patches.var()
    assert torch.equal(_multires(8, item_shape, discount=0.8).noise, layered.noise)  # every process draws alike


def test_a_resolution_shift_shifts_each_bucket_by_its_own_tokens():
    """train.shift = "resolution": a step of 64x64 latents (1,024 tokens after 2x2 patches) and one of 128x128 (4,096)
    draw the same uniform numbers, shifted by e^mu at their own token counts (Qwen-Image's line here)."""
    from diffpipe.diffusion.timesteps import resolution_shift
    from diffpipe.models.family import Feed
    from diffpipe.models.families.qwen_image.qwen_image import QWEN_IMAGE_PRESETS, QwenImageFamily

    config = build_config({"data": {"dataset": "synthetic"},
                           "train": {"batch_size": 64, "timestep_sampling": "shift", "shift": "resolution"}})
    with torch.device("meta"):
        cfg = QwenImageFamily.model_class(**QWEN_IMAGE_PRESETS["digits"]).config
    line = (256, 8192, 0.5, 0.9)
    uniform, drawn = [], []
    for side in (64, 128):
        shape = (1, side, side)
        maker = BatchMaker(make_dataset("synthetic", shape, seed=0), None, config.train, 0.0,
                           Feed(QwenImageFamily(), cfg), shift_schedule=line)
        s = resolution_shift((side // 2) ** 2, line)
        assert maker.shift_for(shape) == s
        t = maker.draw(3, shape).t.double()
        drawn.append(t)
        uniform.append(t / (s - (s - 1) * t))  # the draw before its shift
    torch.testing.assert_close(uniform[0], uniform[1], rtol=1e-5, atol=1e-6)
    assert (drawn[1] > drawn[0]).all()  # the larger picture trains at more noise

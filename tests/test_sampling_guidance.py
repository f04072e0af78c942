"""Classifier-free guidance as diffusers' pipelines combine it: `uncond + scale * (cond - uncond)`, the captions'
half of the batch first. A stub backbone answers 1 for the captioned rows and 0 for the empty-caption rows, so a
swap of the two branches (which only the 6-minute main job noticed) gives 0.75 where 0.25 is right."""
from __future__ import annotations

import torch

import diffpipe.sampling
from diffpipe.build import build_backbone, build_text_encoder, feed, sample_shape
from diffpipe.config_files import build_config
from diffpipe.sampling import Generator

from .planted import planted


def _generator(answers: list, generator=Generator) -> Generator:
    config = build_config({})  # the digits UNet, tiny-clip
    backbone = build_backbone(config, "meta")
    text = build_text_encoder(config, backbone)

    def forward(x, named, like):
        answers.append(tuple(named["encoder_hidden_states"].shape))
        out = torch.zeros_like(like)
        out[: out.shape[0] // 2] = 1.0  # the captioned half (prompts first, then as many empty captions)
        return out

    return generator(config, forward, text, feed(config, backbone), sample_shape(config, backbone))


def _one_step(predict, noise, steps, objective):
    return predict(noise, torch.zeros(noise.shape[0]))


def test_guidance_is_uncond_plus_scale_times_cond_minus_uncond(monkeypatch):
    monkeypatch.setattr(diffpipe.sampling, "sample", _one_step)
    calls = []
    made = _generator(calls).generate(["a handwritten digit seven", "a handwritten digit one"], [0, 1], steps=1,
                                      guidance_scale=0.25, decode=False)
    assert calls and calls[0][0] == 4  # both prompts and their two empty captions in one batch
    assert torch.allclose(made, torch.full_like(made, 0.25))
    made = _generator(calls).generate(["a handwritten digit seven"], [0], steps=1, guidance_scale=1.0, decode=False)
    assert calls[-1][0] == 1  # scale 1: no unconditional pass


def test_swapped_guidance_branches_fail_the_check(monkeypatch):
    swapped = planted("diffpipe.sampling", "cond, uncond = out.chunk(2)", "uncond, cond = out.chunk(2)")
    monkeypatch.setattr(swapped, "sample", _one_step)
    made = _generator([], swapped.Generator).generate(["a handwritten digit seven"], [0], steps=1,
                                                      guidance_scale=0.25, decode=False)
    assert torch.allclose(made, torch.full_like(made, 0.75))  # where the check above asks for 0.25


def _three_levels(predict, noise, steps, objective):
    """One prediction at each of the noise levels 1.0, 0.5 and 0.1 (model timesteps 1000, 500, 100)."""
    return torch.stack([predict(noise, torch.full((noise.shape[0],), t)).flatten()[0] for t in (1000.0, 500.0, 100.0)])


def test_guidance_applies_only_inside_sample_guidance_interval(monkeypatch):
    """sample.guidance_interval = [0.2, 0.6]: the noise level 0.5 is guided (0.25), 1.0 and 0.1 are the prompt
    alone (1); the default [0, 1] guides all three."""
    monkeypatch.setattr(diffpipe.sampling, "sample", _three_levels)
    gen = _generator([])
    assert gen.generate(["a handwritten digit seven"], [0], 3, 0.25, decode=False).tolist() == [0.25, 0.25, 0.25]
    gen.config = build_config({"sample": {"guidance_interval": [0.2, 0.6]}})
    assert gen.generate(["a handwritten digit seven"], [0], 3, 0.25, decode=False).tolist() == [1.0, 0.25, 1.0]


def test_a_guidance_interval_outside_zero_to_one_is_refused():
    import pytest

    with pytest.raises(ValueError, match="guidance_interval"):
        build_config({"sample": {"guidance_interval": [0.5, 0.2]}})

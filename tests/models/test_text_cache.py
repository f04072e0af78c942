"""Kept text embeddings: each distinct caption encoded once before training, then answered from memory."""
from __future__ import annotations

import torch

from diffpipe.data.digits import digit_caption
from diffpipe.models.text import TextEncoder


def _encoder() -> TextEncoder:
    return TextEncoder.tiny(hidden_size=32, projection_dim=24, max_length=16, seed=0)


def test_kept_captions_give_what_the_encoder_computes():
    captions = [digit_caption(i % 10) for i in range(40)] + [""]
    batch = [digit_caption(3), "", digit_caption(7), digit_caption(3)]
    fresh = _encoder().encode(batch)
    text = _encoder()
    assert text.keep(captions, max_gib=1.0)
    calls = []
    text.model.register_forward_hook(lambda *_: calls.append(1))
    kept = text.encode(batch)
    assert not calls  # answered from memory
    for want, got in zip(fresh, kept):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    text.encode(["a caption never seen"])  # not kept: the encoder runs
    assert calls


def test_captions_over_the_budget_are_not_kept():
    text = _encoder()
    per_caption = (16 * 32 + 24) * 4
    assert not text.keep([f"digit {i}" for i in range(100)], max_gib=50 * per_caption / 2**30)
    assert not text.keep(["digit 1"], max_gib=0.0)
    calls = []
    text.model.register_forward_hook(lambda *_: calls.append(1))
    text.encode(["digit 1"])
    assert calls

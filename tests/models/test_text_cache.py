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


def test_keeping_more_captions_leaves_the_kept_ones_and_parking_needs_every_caption_kept():
    text = _encoder()
    marked = (torch.full((16, 32), 7.0), torch.full((24,), 7.0))  # as a text cache on disk would give them
    text.remember({"digit 3": marked})
    assert text.keep(["digit 3", "digit 4"], max_gib=1.0)
    assert torch.equal(text.encode(["digit 3"])[0][0], marked[0])  # not encoded again
    assert not text.park(["digit 3", "a caption never seen"])  # the encoder is still needed on its device
    assert not text.park(["digit 3", "digit 4"])  # on a CPU there is no other memory to move it to
    assert text.outputs_device == text.device

"""What a stage sends has the standard strides of its shape (torch 2.11's PipelineStage compares strides)."""
from __future__ import annotations

import torch

from diffpipe.pipeline.stage import _dense


def test_a_view_at_micro_batch_one_is_sent_with_standard_strides():
    joined = torch.randn(1, 4608, 8)  # a Flux single block's text + image tokens at micro-batch 1
    image = joined[:, 512:]
    assert image.contiguous().stride() == (4608 * 8, 8, 1)  # what contiguous() alone would send
    assert _dense(image).stride() == (4096 * 8, 8, 1) and torch.equal(_dense(image), image)
    already = torch.randn(2, 3)
    assert _dense(already) is already  # no copy when nothing is wrong

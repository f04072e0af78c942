"""The digits quality check fails on what it exists to catch: memorised training images and collapsed modes.

Real held-out digits (which neither the model nor the copy check's training set contains) pass all three checks;
verbatim training images pass the classifier but fail the copy check; one image repeated per digit fails the
variety check, and so does each digit's mean image. The old check (a classifier fitted on all digits) passed all of them.
"""
from __future__ import annotations

import numpy as np
import pytest

from .helpers import example_module

DigitJudge = example_module("digits_quality").DigitJudge


@pytest.fixture(scope="module")
def judge() -> DigitJudge:
    return DigitJudge()


def _per_digit(x: np.ndarray, y: np.ndarray, n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    idx = np.concatenate([np.flatnonzero(y == d)[:n] for d in range(10)])
    return x[idx], y[idx]


def test_unseen_real_digits_pass_every_check(judge):
    x, y = _per_digit(judge.held_x, judge.held_y)
    report = judge.judge(x, y)
    assert report.failures() == [], report.summary()
    # the classifier never saw the training split: what it scores there is generalisation
    train_x, train_y = _per_digit(judge.train_x, judge.train_y, 50)
    assert judge.judge(train_x, train_y).recognised >= 0.9


def test_verbatim_training_images_fail_the_copy_check(judge):
    x, y = _per_digit(judge.train_x, judge.train_y)
    quantised = np.round(x / 16 * 255) / 255 * 16  # as written to and read back from an 8-bit PNG
    report = judge.judge(quantised, y)
    assert report.recognised >= 0.8  # the classifier alone would have passed them
    assert report.copies == 1.0
    assert any(f.startswith("copies") for f in report.failures())


def test_one_image_repeated_per_digit_fails_the_variety_check(judge):
    x, y = _per_digit(judge.held_x, judge.held_y)
    first = np.stack([x[y == d][0] for d in y])  # each digit's first unseen image, ten times
    report = judge.judge(first, y)
    assert report.copies == 0.0 and report.recognised >= 0.8
    assert report.variety == 0.0 and any(f.startswith("variety") for f in report.failures())
    means = np.stack([judge.train_x[judge.train_y == d].mean(0) for d in y])
    assert any(f.startswith("variety") for f in judge.judge(means, y).failures())


def test_wrong_digits_fail_the_classifier(judge):
    x, y = _per_digit(judge.held_x, judge.held_y)
    report = judge.judge(x, (y + 1) % 10)  # every sample drawn as the next digit
    assert report.recognised < 0.1 and any(f.startswith("recognised") for f in report.failures())


def _shrunk(x: np.ndarray, y: np.ndarray, factor: float) -> np.ndarray:
    """Each digit's samples pulled towards that digit's mean: their spread, and so their variety, times `factor`."""
    out = x.copy()
    for d in range(10):
        mean = x[y == d].mean(0)
        out[y == d] = mean + factor * (x[y == d] - mean)
    return out


def test_the_variety_bar_catches_a_drop_as_large_as_issue_28s(judge):
    """Issue 28 saw variety fall to 0.64x of what it was (0.74 to 0.47). Real digits narrowed to the main job's
    variety (0.62) pass; narrowed 0.64x further they fail (the old bar, 0.35, passed both)."""
    x, y = _per_digit(judge.held_x, judge.held_y)
    real = judge.judge(x, y).variety
    main_job_like = judge.judge(_shrunk(x, y, 0.62 / real), y)
    assert main_job_like.variety == pytest.approx(0.62, abs=0.01) and main_job_like.failures() == []
    dropped = judge.judge(_shrunk(x, y, 0.62 * 0.64 / real), y)
    assert any(f.startswith("variety") for f in dropped.failures()), dropped.summary()

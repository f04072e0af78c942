"""Fixtures of the training tests: one uninterrupted digits run (test_checkpoint's QUICK settings: 6 steps,
checkpoints at 3 and 6), made once and shared by the checkpoint and optimizer-state tests; treat it as read-only
(`_cut_short` copies it)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def full_run(tmp_path_factory) -> Path:
    from tests.train.test_checkpoint import _train

    run = tmp_path_factory.mktemp("checkpoints") / "full"
    result = _train("--output-dir", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    return run

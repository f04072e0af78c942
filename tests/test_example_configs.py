"""Every config under examples/ is valid as shipped (keys, values, its model folder's architecture): an example a
user copies never fails at its first line. Their runs are the tests of what they train."""
from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe.config_files import load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_example_config_loads(path, monkeypatch):
    monkeypatch.chdir(path.parent.parent)  # their model and data paths are relative to the project's root
    config = load_config(path)
    assert config.model.architecture

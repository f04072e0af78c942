"""Fixtures shared across test packages: small diffusers pipeline folders and photos, written once per session by
examples/make_tiny_pipeline.py (the script the README runs)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).parent.parent / "examples" / "make_tiny_pipeline.py"


def load_tiny_pipeline_script():
    spec = importlib.util.spec_from_file_location("make_tiny_pipeline", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A folder with sd15/, sdxl/, flux/ and sd3/ pipeline folders and photos/ (16 captioned crops); treat it as
    read-only (copy photos/ before changing it)."""
    out = tmp_path_factory.mktemp("tiny")
    script = load_tiny_pipeline_script()
    vae = script.fitted_vae()
    script.write_sd15(out, vae)
    script.write_sdxl(out, vae)
    script.write_flux(out, vae)
    script.write_sd3(out, vae)
    script.write_photos(out)
    return out


@pytest.fixture(scope="session")
def tiny_video(tmp_path_factory) -> Path:
    """A folder with wan/ (a WanPipeline folder: umT5, Wan's video VAE, a two-block transformer) and clips/ (twelve
    captioned mp4/webm videos and a still image); treat it as read-only (copy clips/ before changing it)."""
    out = tmp_path_factory.mktemp("tiny_video")
    script = load_tiny_pipeline_script()
    script.write_wan(out)
    script.write_clips(out)
    return out

"""Fixtures shared across test packages: small diffusers pipeline folders and photos, written once per session by
examples/make_tiny_pipeline.py (the script the README runs), or copied from examples/tiny when the README's setup
command wrote it with this very version of the script (its stamp: fitting the tiny VAE takes about a minute)."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).parent.parent / "examples" / "make_tiny_pipeline.py"
_MADE = _SCRIPT.parent / "tiny"  # where the README's setup command writes them


@pytest.fixture(scope="session", autouse=True)
def _cache_home(tmp_path_factory):
    """diffpipe's cache home (converted single files, data caches: written_files.cache_home) in the session's
    temporary folder, not the user's ~/.cache; the processes runs start inherit it."""
    import os

    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache-home"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


def load_tiny_pipeline_script():
    spec = importlib.util.spec_from_file_location("make_tiny_pipeline", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_of_made(tmp_path_factory, name: str, parts: tuple[str, ...]) -> Path | None:
    """A copy of examples/tiny's `parts` (without caches runs left there) when this script version wrote it."""
    if not load_tiny_pipeline_script().made_by_this_script(_MADE):
        return None
    out = tmp_path_factory.mktemp(name)
    for part in parts:
        shutil.copytree(_MADE / part, out / part, ignore=shutil.ignore_patterns(".diffpipe_cache"))
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A folder with sd15/, sdxl/, flux/, flux_kontext/, chroma/, sd3/, qwen_image/, qwen_image_edit/,
    qwen_image_edit_plus/, z_image/, flux2_klein/ and flux2_dev/ pipeline folders,
    photos/ (16 captioned crops) and edits/ (8 of them under pictures/, a grey copy of each under controls/); treat it
    as read-only (copy photos/ before changing it)."""
    made = _copy_of_made(tmp_path_factory, "tiny", ("sd15", "sdxl", "flux", "flux_kontext", "chroma", "sd3", "qwen_image",
                                                    "qwen_image_edit", "qwen_image_edit_plus", "z_image", "flux2_klein",
                                                    "flux2_dev", "photos", "edits"))
    if made is not None:
        return made
    out = tmp_path_factory.mktemp("tiny")
    script = load_tiny_pipeline_script()
    vae = script.fitted_vae()
    script.write_sd15(out, vae)
    script.write_sdxl(out, vae)
    script.write_flux(out, vae)
    script.write_flux(out, vae, kontext=True)
    script.write_chroma(out, vae)
    script.write_sd3(out, vae)
    script.write_qwen_image(out)
    script.write_qwen_image(out, edit=True)
    script.write_qwen_image(out, edit=True, plus=True)
    script.write_z_image(out, vae)
    script.write_flux2_klein(out)
    script.write_flux2_dev(out)
    script.write_photos(out)
    script.write_edits(out)
    return out


@pytest.fixture(scope="session")
def tiny_video(tmp_path_factory) -> Path:
    """A folder with wan/ (a WanPipeline folder: umT5, Wan's video VAE, a two-block transformer), wan22/ (the same with
    Wan 2.2 A14B's second expert, transformer_2/, and boundary_ratio 0.875), wan22_i2v/, wan22_ti2v/ (TI2V-5B's
    layout), wan21_i2v/ (Wan 2.1 I2V's: a CLIP vision model beside), hunyuan_video15/ (a HunyuanVideo15Pipeline folder),
    ltx2/ (an LTX2Pipeline folder), clips/ (twelve captioned mp4/webm videos and a still image) and av_clips/ (clips
    with their sound, one at 8 frames a second, one silent); treat it as read-only (copy clips/ before changing it)."""
    made = _copy_of_made(tmp_path_factory, "tiny_video", ("wan", "wan22", "wan22_i2v", "wan22_ti2v", "wan21_i2v",
                                                          "hunyuan_video15", "ltx2", "clips", "av_clips"))
    if made is not None:
        return made
    out = tmp_path_factory.mktemp("tiny_video")
    script = load_tiny_pipeline_script()
    script.write_wan(out)
    script.write_wan22(out)
    script.write_wan22_i2v(out)
    script.write_wan22_ti2v(out)
    script.write_wan21_i2v(out)
    script.write_hunyuan_video15(out)
    script.write_ltx2(out)
    script.write_clips(out)
    script.write_av_clips(out)
    return out

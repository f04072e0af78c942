"""Exports never lose data or claim what they did not do: an existing target is refused unless --force (then
replaced whole, and only where an earlier export wrote it), the run's own files and its base model never; `--out x.safetensors` is that one file; written
files follow the user's umask; a damaged run's weights are named in one line."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffpipe.cli import main

from .helpers import run_command

EXAMPLE = Path(__file__).parent.parent / "examples" / "digits.toml"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    cmd = ["train", str(EXAMPLE), "--output-dir", str(out), "--set",
           "train.max_steps=2", "--set", "train.batch_size=16", "--set", "output.sample_every_end=false",
           "--set", "pipeline.stages=1", "--set", "observe.log_every=0"]
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_the_runs_own_weights_are_never_written_over(run, capsys):
    before = (run / "model.safetensors").read_bytes()
    for extra in ([], ["--force"]):
        assert main(["export", str(run), "--format", "original", "--out", str(run / "model.safetensors"),
                     *extra]) == 2
        assert "is in the run folder" in capsys.readouterr().err
    assert (run / "model.safetensors").read_bytes() == before


def test_an_existing_target_is_refused_unless_forced_and_another_models_folder_even_then(run, tmp_path, capsys):
    """--force replaces an earlier export only (tests/test_nothing_lost.py): another model's folder is kept."""
    other = tmp_path / "flux_model"
    other.mkdir()
    (other / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (other / "diffusion_pytorch_model.safetensors").write_text("another model")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(other)]) == 2
    assert "already exists; choose another path, or add --force" in capsys.readouterr().err
    assert (other / "diffusion_pytorch_model.safetensors").read_text() == "another model"
    assert main(["export", str(run), "--format", "diffusers", "--out", str(other), "--force"]) == 2
    assert "--force replaces only an earlier export" in capsys.readouterr().err
    assert (other / "diffusion_pytorch_model.safetensors").read_text() == "another model"


def test_a_folder_export_to_an_existing_file_says_so_and_writes_nothing(run, tmp_path, capsys):
    text = tmp_path / "existing.txt"
    text.write_text("notes")
    assert main(["export", str(run), "--format", "diffusers", "--out", str(text)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "diffusers", "--out", str(text), "--force"]) == 2
    assert "is a file, and this export is a folder" in capsys.readouterr().err
    assert text.read_text() == "notes" and "wrote" not in capsys.readouterr().out


def test_a_safetensors_out_is_that_one_file_readable_as_the_umask_says(run, tmp_path, capsys):
    out = tmp_path / "unet.safetensors"
    previous = os.umask(0o022)
    try:
        assert main(["export", str(run), "--format", "diffusers", "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    assert out.is_file() and set(load_file(str(out))) == set(load_file(str(run / "model.safetensors")))
    assert out.stat().st_mode & 0o777 == 0o644
    assert f"wrote {out}" in capsys.readouterr().out


def test_a_truncated_run_weight_file_is_named_in_one_line(run, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged, ignore=shutil.ignore_patterns("checkpoints", ".diffpipe-lock"))
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["export", str(damaged), "--format", "original", "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{weights} is damaged" in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "x.safetensors").exists()

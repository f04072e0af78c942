"""The LoRA recipes a user copies (examples/{sdxl,flux,wan,z_image,flux2_klein,flux2_dev,ltx2}_lora.toml) run as their headers say: the CPU line against
the tiny pipelines (read from the file, so the header cannot go stale), then the export command the header gives.
Each trains 2 steps here; the recipes' own values are for real models on GPUs."""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from .helpers import run_command

EXAMPLES = Path(__file__).parent.parent / "examples"


def _header_command(recipe: Path, verb: str) -> list[str]:
    """The header's `diffpipe VERB examples/...` line that has --set (train) or --format (export), as arguments."""
    for line in recipe.read_text().splitlines():
        command = line.lstrip("# ").split("#")[0]  # the command, without a comment after it
        if not (line.startswith("#") and command.startswith(f"diffpipe {verb} ")):
            continue
        words = shlex.split(command)
        if "--set" in words if verb == "train" else "--format" in words:
            return words[1:]
    raise AssertionError(f"{recipe.name}: no '# diffpipe {verb} ...' line in its header")


def _on(folders: dict[str, Path], args: list[str]) -> list[str]:
    """The header's examples/tiny/ paths pointed at this session's tiny folders."""
    out = []
    for arg in args:
        for name, folder in folders.items():
            arg = arg.replace(f"examples/tiny/{name}", str(folder))
        out.append(arg)
    return out


@pytest.mark.parametrize("name", ["sdxl_lora", "flux_lora", "wan_lora", "z_image_lora", "flux2_klein_lora",
                                  "flux2_dev_lora", "ltx2_lora"])
def test_a_recipe_trains_on_the_tiny_pipeline_and_exports_as_its_header_says(name, tiny, tiny_video, tmp_path):
    recipe = EXAMPLES / f"{name}.toml"
    data = tmp_path / "data"  # the recipe caches latents beside its data: a copy, not the shared folder
    shutil.copytree({"wan_lora": tiny_video / "clips", "ltx2_lora": tiny_video / "av_clips"}.get(name, tiny / "photos"), data)
    # flux2_klein and flux2_dev before flux: each replaces a prefix of the path
    folders = {"sdxl": tiny / "sdxl", "flux2_klein": tiny / "flux2_klein", "flux2_dev": tiny / "flux2_dev",
               "flux": tiny / "flux",
               "wan": tiny_video / "wan", "z_image": tiny / "z_image", "ltx2": tiny_video / "ltx2", "photos": data,
               "av_clips": data, "clips": data}
    train = _on(folders, _header_command(recipe, "train"))
    assert train[:2] == ["train", f"examples/{name}.toml"]
    train[1] = str(recipe)  # wherever the tests run from
    run = tmp_path / "run"
    result = run_command([*train, "--output-dir", str(run), "--set", "train.max_steps=2", "--set", "sample.every=0",
                          "--set", "output.sample_every_end=false"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "lora.safetensors").is_file()
    assert (run / "exports" / "lora-step-00000002.safetensors").is_file()  # checkpoint.export_every: the last step
    export = _header_command(recipe, "export")
    fmt = export[export.index("--format") + 1]
    out = tmp_path / ("lora" if fmt == "diffusers" else "lora.safetensors")  # kohya, comfyui: one file
    assert run_command(["export", str(run), "--format", fmt, "--out", str(out)]).returncode == 0
    written = out / "pytorch_lora_weights.safetensors" if fmt == "diffusers" else out
    with safe_open(str(written), framework="pt") as f:
        assert len(list(f.keys())) > 0

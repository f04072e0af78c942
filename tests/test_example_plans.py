"""Every `diffpipe plan` line of every example's header works on a machine without the model's weights (issue 56):
a recipe whose model.path is not here yet is planned as the preset it names, and says so. Each line is parsed by the
CLI's own parser, its config loaded with its --set values and its backbone built on the meta device, as `plan` does
first; the LoRA recipe's line runs whole (planning every line takes 5 minutes on 2 cores: each model's costs are
counted, which the planner's own tests cover)."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from diffpipe.build import build_backbone
from diffpipe.cli import _parser
from diffpipe.commands.plan import _plan_without_weights
from diffpipe.config_files import load_config
from diffpipe.errors import CheckpointError

from .helpers import run_command

ROOT = Path(__file__).parent.parent


def _plan_lines() -> list[str]:
    """`diffpipe plan examples/...` of every example header, without the comment after it."""
    lines = []
    for example in sorted((ROOT / "examples").glob("*.toml")):
        for line in example.read_text().splitlines():
            start = line.find("diffpipe plan examples/")
            if line.startswith("#") and start >= 0:
                lines.append(line[start:].split("#")[0].split("(")[0].strip())
    return lines


def test_every_example_header_has_plan_lines():
    assert len(_plan_lines()) >= 25  # a change to how headers are written would otherwise test nothing


def _by_model() -> dict[str, list[str]]:
    """The plan lines by the model they build (config and --set values): lines that differ only in --world-size or
    --gpu-memory build the same model, once (15 s of the suite's time)."""
    lines: dict[str, list[str]] = {}
    for line in _plan_lines():
        args = _parser().parse_args(shlex.split(line)[1:])
        lines.setdefault(" ".join([args.config, *(args.set or [])]), []).append(line)
    return lines


@pytest.mark.parametrize("model", list(_by_model()))
def test_a_plan_line_of_an_example_header_builds_its_model_without_the_weights(model, monkeypatch):
    monkeypatch.chdir(ROOT)  # the lines name examples/... from the project's root, as the README runs them
    for line in _by_model()[model]:  # every line parses, flags and all
        args = _parser().parse_args(shlex.split(line)[1:])
    config = load_config(args.config, args.set or [])
    _plan_without_weights(config)
    assert config.model.path is None or Path(config.model.path).exists()
    assert len(build_backbone(config, "meta").units) >= 2


def test_the_flux_recipes_plan_runs_whole_and_says_it_planned_the_preset(monkeypatch):
    monkeypatch.chdir(ROOT)
    line = next(line for line in _plan_lines() if "flux_lora.toml" in line)
    result = run_command(shlex.split(line)[1:])
    assert result.returncode == 0
    assert "model.path=FLUX.1-dev is not on this machine: planning the flux preset 'dev'" in result.stdout
    assert "planned split" in result.stdout or "slowest stage" in result.stdout


def test_a_missing_path_without_a_preset_says_how_to_plan_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_config(ROOT / "examples" / "flux_lora.toml")
    config.model.model_fields_set.discard("preset")  # as the recipe was: no preset beside the path
    with pytest.raises(CheckpointError, match=r"FLUX.1-dev does not exist; to plan before the weights are here, name "
                                              r"the architecture's preset .* dev, digits, schnell"):
        _plan_without_weights(config)

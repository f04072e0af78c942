"""The bytes the planner and the run's header say cross each stage boundary are the bytes of the tensors the stages
actually hand on: the digits UNet and the tiny Flux, split in three, run stage after stage in one process."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import diffpipe.build
from diffpipe.build import boundary_traffic, build_backbone, example_inputs
from diffpipe.config_files import build_config, load_config
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules

from ..planted import planted

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


@pytest.mark.parametrize("example,split", [("digits.toml", [3, 8]), ("flux_tiny.toml", [2, 5])])
def test_boundary_bytes_are_the_bytes_each_stage_sends(example, split, crossings=None, monkeypatch=None):
    data = load_config(EXAMPLES / example).model_dump(mode="json", exclude_none=True)
    data["pipeline"].update(stages=3, split=split, schedule="gpipe", checkpointing="none")
    data["train"]["precision"] = "fp32"
    config = build_config(data)
    backbone = build_backbone(config, "cpu")
    specs = stage_specs(backbone, split)
    inputs, conditions = example_inputs(config, backbone, config.micro_batch_size)
    sent, received = [], (inputs["sample"],)
    with torch.no_grad():
        for module in build_stage_modules(backbone, specs)[:-1]:
            out = module(*received, **conditions)
            received = out if isinstance(out, tuple) else (out,)
            sent.append(sum(t.numel() * t.element_size() for t in received))
    if crossings is not None:  # a planted copy of pipeline/traffic.py's
        monkeypatch.setattr(diffpipe.build, "boundary_crossings", crossings)
    planned = [c.bytes for c in boundary_traffic(config, backbone, split)]
    assert planned == sent and len(set(sent)) > 1, (planned, sent)


def test_bytes_of_the_wrong_unit_fail_the_check(monkeypatch):
    wrong = planted("diffpipe.pipeline.traffic", "shapes_after[s.last - 1]", "shapes_after[-1]")  # the last unit's
    with pytest.raises(AssertionError):
        test_boundary_bytes_are_the_bytes_each_stage_sends("digits.toml", [3, 8], wrong.boundary_crossings, monkeypatch)

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
from diffpipe.pipeline.traffic import trace_tensors

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
    wrong = planted("diffpipe.pipeline.traffic", "tensors_after[s.last - 1]", "tensors_after[-1]")  # the last unit's
    with pytest.raises(AssertionError):
        test_boundary_bytes_are_the_bytes_each_stage_sends("digits.toml", [3, 8], wrong.boundary_crossings, monkeypatch)


def test_under_autocast_each_tensor_crosses_in_its_own_dtype():
    """Under bf16 autocast a boundary's bytes are each tensor's in the dtype CUDA's autocast gives it (counted as the
    planner counts it): Flux's rotary table stays fp32 while its projected streams are bf16. The run's header used
    to charge 2 bytes an element for all."""
    bf16 = ['train.precision="bf16"', "pipeline.stages=3"]
    flux = load_config(EXAMPLES / "flux_tiny.toml", [*bf16, "pipeline.split=[2, 5]"])
    meta = build_backbone(flux, "meta")
    tensors = trace_tensors(meta, *example_inputs(flux, meta, flux.micro_batch_size), torch.bfloat16)
    crossing = boundary_traffic(flux, meta, [2, 5])[0]
    sent = {n: tensors[1][n] for n in crossing.names}
    assert sent["rope"].dtype == torch.float32 and sent["h"].dtype == torch.bfloat16
    assert crossing.bytes == sum(t.numel() * (4 if n == "rope" else 2) for n, t in sent.items())


@pytest.mark.parametrize("example,split,micro_batch", [("digits.toml", [3, 8], 16), ("sd3_tiny.toml", [2, 3], 2),
                                                       ("flux_tiny.toml", [2, 5], 2), ("video_tiny.toml", [2, 3], 4)])
def test_the_planner_counts_the_bytes_the_run_sends(example, split, micro_batch):
    """The planner's boundary bytes at micro-batches above 1 are the run's: Flux's and Wan's rotary tables are one per
    micro-batch, which the planner used to scale with its size (tiny Flux, fp32, micro-batch 2: 295,168 bytes planned
    at the first boundary, 221,440 sent)."""
    from diffpipe.planner.plan import boundary_bytes, scaled, unit_costs

    config = load_config(EXAMPLES / example, ['train.precision="bf16"', f"pipeline.stages={len(split) + 1}",
                                              f"pipeline.split={split}", 'pipeline.schedule="gpipe"', "pipeline.microbatches=1",
                                              f"train.batch_size={micro_batch}"])
    meta = build_backbone(config, "meta")
    planned = boundary_bytes(meta, scaled(unit_costs(config, meta, 1), micro_batch),
                             example_inputs(config, meta, micro_batch)[0])
    assert [c.bytes for c in boundary_traffic(config, meta, split)] == [planned[k - 1] for k in split]

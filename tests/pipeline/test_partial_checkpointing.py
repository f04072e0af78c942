"""Checkpointing part of a stage (issue 54's 24 GiB card: memory left after the base keeps some units' activations):
a stage recomputes only its last `recomputed` units, computing what the stage unchecked computes, and the planner
under pipeline.checkpointing = "auto" chooses the fewest last units with which the stage fits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from diffpipe.config_files import load_config
from diffpipe.models.families.unet.unet2d import unet_backbone
from diffpipe.pipeline.schedules import ScheduleChoice
from diffpipe.pipeline.split import stage_specs
from diffpipe.pipeline.stage import build_stage_modules
from diffpipe.planner.costs import UnitCost
from diffpipe.planner.partition import Hardware, _best_stage, _stage

from ..models.test_unet_units import SDXL_STYLE, _inputs

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


def _forwards_and_gradients(stage, sample, conditions):
    """How many times each unit's forward began in one forward and backward (a recomputation stops early once it
    has what backward needs, so counted where it begins), the output and the weights' gradients."""
    runs = [0] * len(stage.unit_list)
    hooks = [u.module.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
             for i, u in enumerate(stage.unit_list)]
    out = stage(sample, **conditions)
    out.square().mean().backward()
    for hook in hooks:
        hook.remove()
    return runs, out.detach(), {n: p.grad.clone() for n, p in stage.full_named_parameters() if p.grad is not None}


def test_a_stage_recomputes_its_last_units_alone_and_computes_what_the_unchecked_stage_does():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SDXL_STYLE).train()
    sample, conditions = _inputs(SDXL_STYLE)
    results = {}
    for recomputed in (0, 3):
        for p in unet.parameters():
            p.grad = None
        backbone = unet_backbone(unet, "layers")
        stage = build_stage_modules(backbone, stage_specs(backbone, []), recomputed=[recomputed])[0]
        results[recomputed] = _forwards_and_gradients(stage, sample, conditions)
    units = len(results[0][0])
    assert results[0][0] == [1] * units
    assert results[3][0] == [1] * (units - 3) + [2] * 3  # the last three ran again in backward, the rest once
    assert torch.equal(results[3][1], results[0][1])
    grads, expected = results[3][2], results[0][2]
    assert grads.keys() == expected.keys() and len(grads) > 10
    assert all(torch.equal(grads[n], expected[n]) for n in grads)


def _costs(units: int) -> list[UnitCost]:
    return [UnitCost(f"u{i}", params=10**6, trainable_params=10**6, forward_flops=10**12, backward_flops=2 * 10**12,
                     activation_bytes=10**9, output_bytes={f"h{i}": 10**7}) for i in range(units)]


def test_auto_checkpoints_the_fewest_last_units_with_which_the_stage_fits():
    costs, schedule = _costs(8), ScheduleChoice.named("1f1b")
    args = (costs, [0] * 8, 0, 8, 0, 1, 1, schedule)
    none, whole = (_stage(*args, Hardware(), k) for k in (0, 8))
    hw = Hardware(memory_bytes=(none.memory_bytes + whole.memory_bytes) / 2)
    chosen = _best_stage(*args, hw, "auto")
    assert 0 < chosen.recomputed < 8 and chosen.memory_bytes <= hw.memory_bytes
    assert _stage(*args, hw, chosen.recomputed - 1).memory_bytes > hw.memory_bytes  # one fewer does not fit
    assert none.busy_s < chosen.busy_s < whole.busy_s  # each recomputed unit costs its forward again
    assert chosen.checkpointed_words == f"{chosen.recomputed}/8"
    # the modes that choose nothing: the whole stage, or none of it
    assert _best_stage(*args, hw, "all").recomputed == 8 and _best_stage(*args, hw, [0]).recomputed == 8
    assert _best_stage(*args, Hardware(), "auto").recomputed == 0


def test_recomputed_units_given_by_hand_are_planned_and_run_as_given(tmp_path):
    from diffpipe.build import build_backbone
    from diffpipe.planner.plan import resolve_stages

    sets = ["pipeline.stages=2", "pipeline.split=[3]", "pipeline.recomputed_units=[2, 99]", 'train.device="cpu"']
    config = load_config(EXAMPLES / "digits.toml", sets)
    meta = build_backbone(config, "meta")
    starts, recomputed = resolve_stages(config, meta)
    assert (starts, list(recomputed), recomputed.stages) == ([3], [2, len(meta.units) - 3], [0, 1])  # 99: all
    with pytest.raises(Exception, match="give one count .* for each of the 2 stages"):
        load_config(EXAMPLES / "digits.toml", [*sets[:2], "pipeline.recomputed_units=[2]"])


def test_the_launcher_says_the_units_it_checkpoints_and_writes_them_to_the_run_config(tmp_path):
    """A one-stage tiny Flux LoRA on a device between its planned peaks unchecked and all checkpointed: the launcher
    checkpoints part of the stage, prints it, and the run's config.toml holds the counts (a resume plans nothing)."""
    import tomllib

    from diffpipe.build import build_backbone
    from diffpipe.planner.partition import Recomputed
    from diffpipe.planner.plan import planned_figures

    from ..helpers import run_command

    sets = ['adapter.type="lora"', "pipeline.stages=1", 'train.device="cpu"', 'pipeline.checkpointing="auto"']
    config = load_config(EXAMPLES / "flux_tiny.toml", sets)
    meta = build_backbone(config, "meta")
    units = len(meta.units)
    none, whole = (max(planned_figures(config, meta, [], Recomputed([k])).process_memory_bytes) for k in (0, units))
    usable_gib = (none + whole) / 2 / 2**30
    run = tmp_path / "run"
    settings = [*sets, f"plan.memory_gib={usable_gib / 0.9}", "train.max_steps=1", "output.sample_every_end=false",
                "checkpoint.every=0", "output.save_weights=false"]
    result = run_command(["train", str(EXAMPLES / "flux_tiny.toml"), "--output-dir", str(run),
                          *(x for s in settings for x in ("--set", s))])
    assert result.returncode == 0, result.stderr[-3000:]
    written = tomllib.loads((run / "config.toml").read_text())["pipeline"]
    count = written["recomputed_units"][0]
    assert 0 < count < units and written["checkpointing"] == [0]
    assert f"recomputed in backward: stage 0 its last {count} of {units} units" in result.stdout

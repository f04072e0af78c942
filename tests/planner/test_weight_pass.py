"""What the planner charges a split backward (zero-bubble schedules) between a micro-batch's input-gradient pass and
its weight pass: the gradients torch keeps for the weight pass, counted unit by unit, add up to what torch keeps for
a whole stage of those units; units with nothing to keep (frozen, or reached by no input that needs a gradient)
are charged nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffpipe.build import build_backbone, example_inputs, give_weights
from diffpipe.config_files import build_config, load_config
from diffpipe.planner.costs import (_FusedAttention, needs_grad, _unit_inputs, count_unit_costs,
                                    kept_for_weight_pass)
from diffpipe.torch_support import split_backward_input

pytestmark = pytest.mark.torch_smoke
MICRO = 4
EXAMPLES = Path(__file__).parent.parent.parent / "examples"


def _kept_by_a_stage(backbone, inputs, conditions, first: int) -> int:
    """Bytes torch's input pass keeps for the weight pass when units first.. run as one stage (one graph)."""
    named = {k: v.to("meta") for k, v in {**inputs, **conditions}.items()}
    grad_names = needs_grad(backbone)
    for unit in backbone.units[:first]:
        with torch.no_grad():
            named.update(unit(_unit_inputs(named, unit.reads, grad_names)))
    stage_inputs = {k: v.detach().requires_grad_(k in grad_names and v.is_floating_point()) for k, v in named.items()}
    named = dict(stage_inputs)
    with _FusedAttention():  # attention as the fused kernel computes it, as counting does
        for unit in backbone.units[first:]:
            named.update(unit({k: named[k] for k in unit.reads}))
    outputs = [named[k].clone() for k in backbone.units[-1].writes]
    weights = [p for unit in backbone.units[first:] for p in unit.module.parameters() if p.requires_grad]
    groups = split_backward_input(outputs, [torch.ones_like(o) for o in outputs],
                                     [v for v in stage_inputs.values() if v.requires_grad], iter(weights))
    return kept_for_weight_pass(groups)


def test_units_add_up_to_what_torch_keeps_for_a_whole_stage():
    config = build_config({"train": {"batch_size": MICRO * 4}, "pipeline": {"microbatches": 4}})
    meta = build_backbone(config, "meta")
    inputs, conditions = example_inputs(config, meta, MICRO)
    costs = count_unit_costs(meta, inputs, conditions)
    first = 2  # past the time embedding and conv_in, whose inputs need no gradient
    assert [c.weight_pass_bytes for c in costs[:first]] == [0, 0], [c.name for c in costs[:first]]
    per_unit = sum(c.weight_pass_bytes for c in costs[first:])
    whole = _kept_by_a_stage(meta, inputs, conditions, first)
    print(f"units {per_unit} bytes, one stage {whole} bytes")
    assert whole > 0 and abs(per_unit - whole) <= 0.05 * whole


def test_a_transformer_whose_blocks_return_views_is_counted():
    """Wan's blocks hand on views of their tensors, which torch's input pass cannot detach in place."""
    config = load_config(EXAMPLES / "wan_clips.toml")
    meta = build_backbone(config, "meta")
    costs = count_unit_costs(meta, *example_inputs(config, meta, 1))
    blocks = [c for c in costs if c.trainable_params and c.name.startswith("block")]
    assert blocks and all(c.weight_pass_bytes > 0 for c in blocks), [(c.name, c.weight_pass_bytes) for c in costs]


def test_counting_leaves_the_meta_model_ready_for_its_weights():
    """The planner counts on the meta model that is then given its weights: the input pass's retained graph must
    not keep the frozen base weights of LoRA referenced (torch then refuses to swap them in)."""
    config = load_config(EXAMPLES / "digits_lora.toml")
    meta = build_backbone(config, "meta")
    count_unit_costs(meta, *example_inputs(config, meta, 1))
    give_weights(meta, config, list(range(len(meta.units))))
    assert all(p.device.type == "cpu" for p in meta.model.parameters() if not p.requires_grad)  # the base

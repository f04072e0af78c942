"""The planner with sequence parallelism (pipeline.sequence_parallel): each process of a sample is planned at its
share of the tokens, pays its attentions' all-to-alls, and the world-size search tries the degrees the model allows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffpipe.build import build_backbone
from diffpipe.cli import main
from diffpipe.config_files import load_config
from diffpipe.planner.plan import hardware, layouts_tried, make_plan, unit_costs

from ..planted import planted

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
# the tiny Wan (4 heads, 64 tokens a clip) planned for a GPU-like device
TINY_WAN = ["plan.device_tflops=300", "plan.link_gbps=100", "train.batch_size=8", "pipeline.microbatches=4",
            "pipeline.stages=1"]


@pytest.fixture(scope="module")
def tiny_wan():
    config = load_config(EXAMPLES / "video_tiny.toml", TINY_WAN)
    meta = build_backbone(config, "meta")
    return config, meta, unit_costs(config, meta, 1)


def _plan(plan_module, config, meta, per_sample, sp):
    return plan_module.make_plan(config, meta, 1, 1, 4, hardware(config), per_sample, sp)


@pytest.mark.torch_smoke  # the attentions' bytes are counted through torch's function mode
def test_a_process_of_a_split_sample_computes_its_share_and_pays_the_all_to_alls(tiny_wan):
    config, meta, per_sample = tiny_wan
    import diffpipe.planner.plan as plan_module

    whole, split = (_plan(plan_module, config, meta, per_sample, sp).planned.stages[0] for sp in (1, 2))
    attention = sum(c.attention_bytes for c in per_sample) * config.micro_batch_size
    assert attention > 0
    exchange = attention / 2 * (1 / 2) / (100e9)  # a process's half of the bytes, of which it sends half
    assert split.forward_s == pytest.approx(whole.forward_s / 2 + exchange, rel=1e-6)
    # and the backward computes the split self-attentions' forward again (diffusers' native op under Ulysses)
    again = sum(c.attention_flops for c in per_sample) * config.micro_batch_size / 2 / 300e12
    assert again > 0
    assert split.backward_s == pytest.approx(whole.backward_s / 2 + exchange + again, rel=1e-6)
    assert split.memory_bytes < 0.75 * whole.memory_bytes  # activations halve; the weights stay whole

    # planted: a process planned at the whole sample's tokens
    whole_tokens = planted("diffpipe.planner.plan", "micro / sequence_parallel)", "micro)")
    wrong = _plan(whole_tokens, config, meta, per_sample, 2).planned.stages[0]
    assert wrong.forward_s != pytest.approx(whole.forward_s / 2 + exchange, rel=1e-6)


@pytest.mark.parametrize("plan_module", ["diffpipe.planner.plan", "planted"])
def test_heads_the_degree_does_not_divide_cost_their_pad(tiny_wan, plan_module):
    """The tiny Wan's 4 heads over 3 processes attend as 6: a process's attention FLOPs (forward, twice them in
    backward, the forward again) and all-to-all bytes are 1.5 times its third of the unsplit attention's. Planted:
    the pad left out of the plan."""
    import importlib

    config, meta, per_sample = tiny_wan
    module = (planted("diffpipe.planner.plan", "    costs = with_padded_heads(costs, meta, sequence_parallel)\n", "")
              if plan_module == "planted" else importlib.import_module(plan_module))
    whole, split = (_plan(module, config, meta, per_sample, sp).planned.stages[0] for sp in (1, 3))
    share = config.micro_batch_size / 3
    pad = sum(c.attention_flops for c in per_sample) * share * 0.5 / 300e12  # the pad heads' forward
    exchange = sum(c.attention_bytes for c in per_sample) * share * 1.5 * (2 / 3) / 100e9
    again = 3 * pad  # the padded attention's forward, computed again in backward
    forward = whole.forward_s / 3 + pad + exchange
    backward = whole.backward_s / 3 + 2 * pad + exchange + again
    agrees = (split.forward_s == pytest.approx(forward, rel=1e-6) and
              split.backward_s == pytest.approx(backward, rel=1e-6))
    assert agrees == (plan_module != "planted")


def test_the_search_tries_the_degrees_the_heads_and_tokens_allow(tiny_wan):
    config, meta, per_sample = tiny_wan
    tried = layouts_tried(config, meta, 4, hardware(config))
    degrees = {plan.sequence_parallel for plan, _ in tried if plan is not None}
    assert degrees == {1, 2, 4}  # 4 heads; 64 tokens
    assert all(plan.replicas.count == plan.data_parallel * plan.sequence_parallel for plan, _ in tried if plan)
    unet = load_config(EXAMPLES / "digits.toml", ["train.batch_size=8"])
    unet_meta = build_backbone(unet, "meta")
    assert {p.sequence_parallel for p, _ in layouts_tried(unet, unet_meta, 4, hardware(unet)) if p} == {1}


def test_long_wan_clips_fit_eight_24_gib_cards_only_with_their_tokens_split(capsys):
    """Wan 2.1 14B LoRA on 81 frames at 720x1280 (75,600 tokens a clip), batch 8, the recipe's bf16 base: no pure
    pipeline or data-parallel layout of 8 cards of 24 GiB fits (the landed code before sequence parallelism said
    "No layout of 8 devices fits"); splitting each clip's tokens does, with blocks swapped."""
    args = ["plan", str(EXAMPLES / "wan_14b.toml"), "--world-size", "8", "--gpu-memory", "24GiB", "--json",
            "--set", "data.latent_size=[90,160]", "--set", "train.batch_size=8", "--set", "pipeline.microbatches=8"]
    assert main(args) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all(p["sequence_parallel"] > 1 for p in plans)
    assert plans[0]["planned"]["samples_per_s"] > 0
    assert max(plans[0]["planned"]["process_peak_GiB"]) <= 24 * 0.9

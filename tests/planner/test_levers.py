"""The memory settings a config leaves to the planner ("auto"; planner/levers.py): on a device between two settings'
planned peaks, the planner takes the first setting, in order of how little it changes, with which the layout fits:
block swap before 8-bit moments before a quantised base, each quantised format only when the config lists it."""
from __future__ import annotations

from pathlib import Path

import pytest

from diffpipe.build import build_backbone
from diffpipe.config_files import load_config
from diffpipe.planner.plan import planned_figures, resolve_memory, resolve_stages

EXAMPLES = Path(__file__).parent.parent.parent / "examples"
HEADROOM = 0.9  # plan.memory_headroom's default leaves 10 % free


def _peak(example: str, sets: list[str]) -> float:
    """The plan's peak GiB per process with these settings fixed."""
    config = load_config(EXAMPLES / example, sets)
    meta = build_backbone(config, "meta")
    starts, checkpointed = resolve_stages(config, meta)
    return max(planned_figures(config, meta, starts, checkpointed).process_memory_bytes) / 2**30


def _chosen(example: str, sets: list[str], usable_gib: float):
    config = load_config(EXAMPLES / example, [*sets, f"plan.memory_gib={usable_gib / HEADROOM}"])
    return resolve_memory(config, build_backbone(config, "meta"))


LORA = ['adapter.type="lora"', "pipeline.stages=1", 'train.device="cpu"', 'pipeline.checkpointing="all"']


def test_a_quantised_base_is_chosen_only_where_listed_and_the_least_changing_format_that_fits():
    bf16, int8, nf4 = (_peak("flux_tiny.toml", [*LORA, f'memory.base_dtype="{b}"']) for b in ("fp32", "int8", "nf4"))
    assert nf4 < int8 < bf16
    listed = [*LORA, 'memory.base_dtype="auto"', 'memory.quantise_if_needed=["int8", "nf4"]']
    assert _chosen("flux_tiny.toml", listed, (int8 + bf16) / 2).base_dtype == "int8"
    assert _chosen("flux_tiny.toml", listed, (nf4 + int8) / 2).base_dtype == "nf4"
    assert _chosen("flux_tiny.toml", listed, 2 * bf16).base_dtype == "auto"  # fits as it is: unchanged
    unlisted = [*LORA, 'memory.base_dtype="auto"', 'memory.quantise_if_needed=["nf4"]']
    assert _chosen("flux_tiny.toml", unlisted, (int8 + bf16) / 2).base_dtype == "nf4"  # int8 not allowed
    never = [*LORA, 'memory.base_dtype="auto"']
    assert _chosen("flux_tiny.toml", never, (int8 + bf16) / 2).base_dtype == "auto"  # nothing allowed: unchanged


def test_block_swap_comes_before_a_quantised_base_and_8bit_moments_before_both_where_they_suffice():
    swapped = _peak("flux_tiny.toml", [*LORA, "memory.block_swap=6"])
    resident = _peak("flux_tiny.toml", LORA)
    both = [*LORA, 'memory.base_dtype="auto"', 'memory.quantise_if_needed=["int8"]', 'memory.block_swap="auto"']
    choice = _chosen("flux_tiny.toml", both, (swapped + resident) / 2)
    assert choice.base_dtype == "auto" and choice.block_swap > 0  # swap changes nothing computed: tried first

    full = ["pipeline.stages=1", 'train.device="cpu"']  # digits, full fine-tune: the moments matter
    fp32, eight = _peak("digits.toml", full), _peak("digits.toml", [*full, 'memory.optimizer_state="8bit"'])
    assert eight < fp32
    assert _chosen("digits.toml", [*full, 'memory.optimizer_state="auto"'], (eight + fp32) / 2).optimizer_state == "8bit"
    assert _chosen("digits.toml", [*full, 'memory.optimizer_state="auto"'], 2 * fp32).optimizer_state == "fp32"
    with pytest.raises(Exception, match="optimizer_state"):  # 8-bit is refused with sharded replicas; auto is not
        load_config(EXAMPLES / "digits.toml", ["pipeline.stages=1", "pipeline.data_parallel=2",
                                               "pipeline.data_parallel_shard=true", 'memory.optimizer_state="8bit"'])
    shard = ["pipeline.stages=1", "pipeline.data_parallel=2", "pipeline.data_parallel_shard=true",
             'train.device="cpu"', 'memory.optimizer_state="auto"']
    assert _chosen("digits.toml", shard, 1e-4).optimizer_state == "fp32"


def test_the_printed_choice_says_how_an_auto_base_is_held():
    """base_dtype "auto" stays "auto" in the choice (bf16 or fp32 by device): the words name the storage the run
    takes, not "auto" alone (a GPU run printed `memory.base_dtype = "auto"` for a bf16 base)."""
    from diffpipe.planner.levers import MemoryChoice

    assert 'memory.base_dtype = "auto" (bf16)' in MemoryChoice("auto", "fp32", 48).words("bf16")
    assert 'memory.base_dtype = "fp8",' in MemoryChoice("fp8", "fp32", 0).words("bf16")


def test_a_moving_average_of_the_weights_is_charged_as_one_more_fp32_copy_of_the_trained_ones():
    """train.ema_decay keeps the average beside each trained weight on the device (train/ema.py): 4 bytes each."""
    from diffpipe.build import build_backbone as built

    full = ["pipeline.stages=1", 'train.device="cpu"']
    trained = sum(p.numel() for p in built(load_config(EXAMPLES / "digits.toml", full), "meta").model.parameters())
    extra = _peak("digits.toml", [*full, "train.ema_decay=0.999"]) - _peak("digits.toml", full)
    assert extra * 2**30 == pytest.approx(4 * trained, rel=1e-6)


def test_a_quantised_base_spends_time_turning_its_weights_back_at_every_pass():
    """memory.base_dtype fp8/int8/nf4: a forward, a recomputation and a backward each turn every stored linear
    weight back into bf16, DEQUANTISE_FLOPS of the device's matrix work a weight (measured on an H200: 5.2 ps a
    weight a pass for fp8, 11.6 for nf4; docs/benchmarks.md); a bf16 base computes as it is held."""
    from diffpipe.models.storage import DEQUANTISE_FLOPS
    from diffpipe.planner.plan import unit_costs

    sets = [*LORA, "plan.device_tflops=100", 'train.precision="bf16"']
    config = load_config(EXAMPLES / "flux_tiny.toml", sets)
    meta = build_backbone(config, "meta")
    frozen = sum(c.frozen_linear_params for c in unit_costs(config, meta, config.micro_batch_size))
    passes = 3 * config.pipeline.microbatches  # every unit checkpointed: forward, recomputation, backward

    def step_s(base: str) -> float:
        config = load_config(EXAMPLES / "flux_tiny.toml", [*sets, f'memory.base_dtype="{base}"'])
        meta = build_backbone(config, "meta")
        starts, checkpointed = resolve_stages(config, meta)
        return planned_figures(config, meta, starts, checkpointed).step_s

    bf16 = step_s("bf16")
    for base in ("fp8", "int8", "nf4"):
        expected = passes * frozen * DEQUANTISE_FLOPS[base] / 100e12
        assert frozen > 0 and step_s(base) - bf16 == pytest.approx(expected, rel=1e-6), base


@pytest.mark.parametrize("levers", [['memory.block_swap="auto"', 'memory.optimizer_state="auto"'],
                                    ["memory.block_swap=0", 'memory.optimizer_state="fp32"']])
def test_more_stages_than_units_is_one_sentence_at_every_planner_entry(levers):
    """With levers left to the planner, 12 stages of a 6-unit model was a traceback from deep in the partition
    (`max() arg is an empty sequence`) through the memory explanation (issue 56): every entry asks first."""
    from diffpipe.errors import SplitError
    from diffpipe.planner.plan import hardware, make_plan

    sets = ['adapter.type="lora"', "pipeline.stages=12", "pipeline.microbatches=12", "train.batch_size=12",
            "plan.memory_gib=1", *levers]
    config = load_config(EXAMPLES / "flux_tiny.toml", sets)
    meta = build_backbone(config, "meta")
    for entry in (lambda: resolve_memory(config, meta), lambda: resolve_stages(config, meta),
                  lambda: make_plan(config, meta, 12, 1, 12, hardware(config))):
        with pytest.raises(SplitError, match="12 stages, but the model has only 6 units"):
            entry()


def test_the_planners_choice_is_told_in_the_users_words_not_a_file_name(capsys):
    """The line named planner/levers.py (issue 56)."""
    from diffpipe.preflight import check_before_launch

    config = load_config(EXAMPLES / "flux_tiny.toml", [*LORA[:2], 'memory.optimizer_state="auto"',
                                                       "plan.memory_gib=0.001"])
    check_before_launch(config)
    out = capsys.readouterr().out
    assert "memory settings chosen by the planner" in out and ".py" not in out

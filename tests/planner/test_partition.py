"""The DP partitioner is exact: it matches brute force over every split and checkpointing choice."""
from __future__ import annotations

import itertools
import random

import pytest

from diffpipe.pipeline.schedules import ScheduleChoice
from diffpipe.planner.costs import UnitCost
from diffpipe.planner.partition import Hardware, Infeasible, Partition, Replicas, _split, _stage, partition


def _random_costs(rng: random.Random, n: int) -> tuple[list[UnitCost], list[int]]:
    costs = [UnitCost(f"u{i}", params=rng.randint(1, 50) * 10**6, trainable_params=0,
                      forward_flops=rng.randint(1, 100) * 10**9, backward_flops=0,
                      activation_bytes=rng.randint(0, 40) * 10**8, output_bytes={}) for i in range(n)]
    for c in costs:
        c.trainable_params = c.params if rng.random() < 0.8 else 0
        c.backward_flops = 2 * c.forward_flops
    boundary = [rng.randint(0, 20) * 10**7 for _ in range(n - 1)] + [0]
    return costs, boundary


def _brute_force(costs, boundary, stages, m, schedule, hw, mode):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        # under "auto" any count of a stage's last units checkpointed (the planner bisects for the fewest that fit)
        choices = [(0,) if mode == "none" else range(bounds[i + 1] - bounds[i] + 1) for i in range(stages)]
        for ckpt in itertools.product(*choices):
            ests = [_stage(costs, boundary, bounds[i], bounds[i + 1], i, stages, m, schedule, hw, ckpt[i])
                    for i in range(stages)]
            if hw.memory_bytes is not None and any(e.memory_bytes > hw.memory_bytes for e in ests):
                continue
            slowest = max(e.busy_s for e in ests)
            best = slowest if best is None else min(best, slowest)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_brute_force_on_random_instances(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    costs, boundary = _random_costs(rng, n)
    stages = rng.randint(1, min(4, n))
    schedule = ScheduleChoice.named(rng.choice(["gpipe", "1f1b"]))
    mode = rng.choice(["none", "auto"])
    m = rng.randint(stages, 8)
    total = sum(c.params * 16 + c.activation_bytes * m for c in costs)
    hw = Hardware(tflops=rng.choice([1.0, 100.0]), link_gbps=rng.choice([1.0, 50.0]),
                  memory_bytes=rng.choice([None, total / stages * rng.uniform(0.3, 1.5)]))
    expected = _brute_force(costs, boundary, stages, m, schedule, hw, mode)
    if expected is None:
        with pytest.raises(Infeasible):
            partition(costs, boundary, stages, m, schedule, hw, mode)
        return
    got = partition(costs, boundary, stages, m, schedule, hw, mode)
    assert got.slowest_s == pytest.approx(expected, rel=1e-12)
    assert len(got.stages) == stages and got.stages[0].first == 0 and got.stages[-1].last == n
    if hw.memory_bytes is not None:
        assert all(s.memory_bytes <= hw.memory_bytes for s in got.stages)


def test_gpipe_holds_all_micro_batches_and_1f1b_fewer():
    rng = random.Random(1)
    costs, boundary = _random_costs(rng, 4)
    hw = Hardware()
    gpipe = partition(costs, boundary, 2, 8, ScheduleChoice.named("gpipe"), hw)
    one_f_one_b = partition(costs, boundary, 2, 8, ScheduleChoice.named("1f1b"), hw)
    assert max(s.memory_bytes for s in one_f_one_b.stages) < max(s.memory_bytes for s in gpipe.stages)


def test_checkpointing_trades_time_for_memory():
    costs, boundary = _random_costs(random.Random(2), 3)
    plain = _stage(costs, boundary, 0, 3, 0, 1, 4, ScheduleChoice.named("gpipe"), Hardware(), 0)
    ckpt = _stage(costs, boundary, 0, 3, 0, 1, 4, ScheduleChoice.named("gpipe"), Hardware(), 3)
    assert ckpt.memory_bytes < plain.memory_bytes and ckpt.busy_s > plain.busy_s


def test_bubble_fraction_of_a_balanced_pipeline_is_the_textbook_figure():
    costs = [UnitCost(f"u{i}", 1, 1, 10**12, 2 * 10**12, 0, {}) for i in range(4)]
    part = partition(costs, [0, 0, 0, 0], 4, 12, ScheduleChoice.named("1f1b"), Hardware(tflops=1.0))
    assert part.bubble_fraction == pytest.approx(3 / (12 + 3))


def test_stages_sharing_a_process_share_its_memory():
    """Interleaved schedules run 2 stages on each process: a split whose stages each fit the device alone, but
    not two together, is refused (an interleaved SDXL plan that fitted stage by stage ran out of memory)."""
    costs = [UnitCost(f"u{i}", params=10**9, trainable_params=10**9, forward_flops=10**12, backward_flops=2 * 10**12,
                      activation_bytes=0, output_bytes={}) for i in range(4)]
    one_stage = 16 * 10**9  # weights, gradient and AdamW moments of one unit
    hw = Hardware(memory_bytes=1.5 * one_stage)
    assert len(partition(costs, [0] * 4, 4, 8, ScheduleChoice.named("1f1b"), hw).stages) == 4
    with pytest.raises(Infeasible):
        partition(costs, [0] * 4, 4, 8, ScheduleChoice.named("interleaved_1f1b", 2), hw)
    assert partition(costs, [0] * 4, 4, 8, ScheduleChoice.named("interleaved_1f1b", 2),
                     Hardware(memory_bytes=2 * one_stage))


def test_a_stage_uses_the_memory_its_process_s_other_stage_leaves():
    """Interleaved, 2 processes x 2 stages: stage 0 needs more than half the device, stage 2 (on the same process)
    little; together they fit, so stage 0 runs without checkpointing (the sixth session's plan checkpointed it,
    and the H200s then held 67 and 83 of 140 GiB)."""
    costs = [UnitCost(f"u{i}", params=10**9, trainable_params=10**9, forward_flops=10**12, backward_flops=2 * 10**12,
                      activation_bytes=(40 * 10**9 if i == 0 else 0), output_bytes={}) for i in range(4)]
    schedule = ScheduleChoice.named("interleaved_1f1b", 2)
    plain = [_stage(costs, [0] * 4, i, i + 1, i, 4, 4, schedule, Hardware(), 0) for i in range(4)]
    hw = Hardware(memory_bytes=plain[0].memory_bytes + plain[2].memory_bytes)
    assert plain[0].memory_bytes > hw.memory_bytes / 2  # over its equal share
    part = partition(costs, [0] * 4, 4, 4, schedule, hw, "auto")
    assert [s.checkpointed for s in part.stages] == [False] * 4
    tighter = Hardware(memory_bytes=hw.memory_bytes * 0.99)  # now the two do not fit together: stage 0 checkpoints
    assert [s.checkpointed for s in partition(costs, [0] * 4, 4, 4, schedule, tighter, "auto").stages][0]


@pytest.mark.parametrize("seed", range(40))
def test_stages_of_a_process_fit_together_and_plan_no_slower_than_equal_shares(seed):
    """Schedules with 2 stages per process: every process's stages fit its device together, and the step is never
    longer than the split that keeps each stage within half the device (the planner's answer before)."""
    rng = random.Random(seed)
    n = rng.randint(4, 8)
    costs, boundary = _random_costs(rng, n)
    schedule = ScheduleChoice.named(rng.choice(["interleaved_1f1b", "zbv"]), 2)
    mode = rng.choice(["none", "auto"])
    m = rng.choice([4, 6, 8])  # interleaved 1F1B on 2 processes: an even count
    total = sum(c.params * 16 + c.activation_bytes * m for c in costs)
    hw = Hardware(tflops=100.0, link_gbps=rng.choice([1.0, 50.0]), memory_bytes=total / 2 * rng.uniform(0.3, 1.5))
    equal_shares = _split(costs, boundary, 4, m, schedule, hw, mode, Replicas(), share=2)
    try:
        got = partition(costs, boundary, 4, m, schedule, hw, mode)
    except Infeasible:
        assert equal_shares is None
        return
    for rank in range(2):
        held = sum(s.memory_bytes for s in got.stages if schedule.schedule.rank_of(s.index, 2) == rank)
        assert held <= hw.memory_bytes
    if equal_shares is not None:
        assert got.step_s <= Partition(tuple(equal_shares), m, schedule).step_s * (1 + 1e-12)


def test_sharded_replicas_hold_a_share_and_whole_copies_while_they_compute():
    units = [UnitCost(f"u{i}", params=10**9, trainable_params=10**9, forward_flops=1, backward_flops=2,
                      activation_bytes=0, output_bytes={}) for i in range(4)]
    n = 4 * 10**9
    assert Replicas(4, False).state_bytes(units) == 16 * n  # replicate: everything whole
    assert Replicas(1, True).state_bytes(units) == 16 * n
    # in a pipeline: whole weights and summed gradients through the step, a share of the rest
    assert Replicas(4, True).state_bytes(units) == (4 + 4 + 16 / 4) * n
    # a stage alone: a share of everything, and two units whole with their gradients (the one computing, the next)
    assert Replicas(4, True, gathered_per_unit=True).state_bytes(units) == 16 / 4 * n + 2 * 8 * 10**9
    frozen = [UnitCost("u", params=n, trainable_params=0, forward_flops=1, backward_flops=2, activation_bytes=0,
                       output_bytes={})]
    assert Replicas(4, True).state_bytes(frozen) == (4 + 4 / 4) * n  # frozen weights (LoRA's base) gathered too


def test_a_checkpointed_stage_of_a_split_backward_holds_its_activations_until_the_weight_pass():
    """Zero-bubble schedules keep a micro-batch's gradients for the weight pass after its input gradients: a
    checkpointed stage then holds about its whole activations, not only its inputs (zbv with two stages
    checkpointed ran out of memory on an H200 where the inputs alone were counted)."""
    costs = [UnitCost(f"u{i}", params=10**6, trainable_params=10**6, forward_flops=10**9, backward_flops=2 * 10**9,
                      activation_bytes=10**9, output_bytes={f"h{i}": 10**7}) for i in range(4)]
    boundary = [10**7] * 3 + [0]
    whole_activations = sum(c.activation_bytes for c in costs[0:2])
    for name, waiting in (("interleaved_1f1b", 0), ("zbv", 2)):
        schedule = ScheduleChoice.named(name, 2)
        assert schedule.awaiting_weights(1, 4, 4) == waiting
        ckpt = _stage(costs, boundary, 0, 2, 1, 4, 4, schedule, Hardware(), 2)
        static = _stage(costs, boundary, 0, 2, 1, 4, 4, schedule, Hardware(), 0).memory_bytes - \
            schedule.in_flight(1, 4, 4) * (boundary[-1] + whole_activations)
        assert ckpt.memory_bytes - static >= waiting * whole_activations
        assert ckpt.memory_bytes - static < (waiting + 1) * whole_activations


def test_a_split_backward_holds_the_weight_pass_gradients_except_on_the_first_stage():
    """Between a micro-batch's input-gradient and weight passes torch keeps the gradients of its weights' op outputs
    (`UnitCost.weight_pass_bytes`); the first stage has no input pass (torch runs its whole backward in the weight
    pass), and whole backwards keep nothing."""
    def costs(weight_pass):
        return [UnitCost(f"u{i}", params=10**6, trainable_params=10**6, forward_flops=10**9, backward_flops=2 * 10**9,
                         activation_bytes=10**9, output_bytes={f"h{i}": 10**7}, weight_pass_bytes=weight_pass)
                for i in range(4)]
    boundary = [10**7] * 3 + [0]

    def extra(name, stage, ckpt):
        schedule = ScheduleChoice.named(name, 2)
        args = (boundary, stage, stage + 1, stage, 4, 4, schedule, Hardware(), ckpt)
        return _stage(costs(3 * 10**8), *args).memory_bytes - _stage(costs(0), *args).memory_bytes

    for ckpt in (False, True):
        assert extra("zbv", 1, ckpt) == 2 * 3 * 10**8  # two micro-batches of stage 1 await their weight pass
        assert extra("zbv", 0, ckpt) == 0
        assert extra("interleaved_1f1b", 1, ckpt) == 0


def test_more_memory_never_loses_a_plan_that_fits_less():
    """Processes running 2 stages: a layout planned for a device is planned for a larger one too. The roomiest
    split by stage alone packs stages that fit one by one but not as processes, and lost such plans (seeds 86 and
    116 below; and the SDXL UNet under zbv on 3 processes, planned at 84 GiB but refused at 100 and 125)."""
    lost = []
    for seed in sorted({86, 116, *range(0, 120, 4)}):  # the two that lost plans, and a quarter of the search that found them
        rng = random.Random(seed)
        costs, boundary = _random_costs(rng, rng.randint(5, 12))
        schedule = ScheduleChoice.named(rng.choice(["interleaved_1f1b", "zbv"]), 2)
        m = rng.choice([4, 8])
        total = sum(c.params * 16 + c.activation_bytes * m for c in costs)
        memory = total / 2 * rng.uniform(0.2, 1.2)
        try:
            partition(costs, boundary, 4, m, schedule, Hardware(tflops=100.0, memory_bytes=memory), "auto")
        except Infeasible:
            continue
        for factor in (1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 3.0):
            try:
                partition(costs, boundary, 4, m, schedule, Hardware(tflops=100.0, memory_bytes=memory * factor), "auto")
            except Infeasible:
                lost.append((seed, factor))
    assert lost == []

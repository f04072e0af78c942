"""The pipeline monitor fires on one stage's slowdown, and not on a steady (noisy) run, a new bucket's first
(compiling) step or a larger bucket; memory pressure is named."""
from __future__ import annotations

import random

from diffpipe.observe.monitor import PipelineMonitor
from diffpipe.observe.observer import memory_pressure_warnings


def _steady(monitor: PipelineMonitor, steps: int, rng: random.Random, shape: str | None = None,
            step_s: float = 0.2) -> list:
    alerts = []
    for _ in range(steps):
        for stage in (0, 1):
            alerts += monitor.observe(stage, stage, {"step latency": step_s * rng.uniform(0.85, 1.15),
                                                     "communication latency": 0.01 * rng.uniform(0.5, 1.5)}, shape)
    return alerts


def test_steady_run_raises_nothing():
    assert _steady(PipelineMonitor(), 200, random.Random(0)) == []


def test_slowdown_of_one_stage_is_named():
    monitor = PipelineMonitor(factor=2.5)
    _steady(monitor, 30, random.Random(1))
    alerts = monitor.observe(1, 1, {"step latency": 0.2 * 3.0, "communication latency": 0.01})
    assert [(a.stage, a.metric) for a in alerts] == [(1, "step latency")]
    assert alerts[0].message(31).startswith("step 31: stage 1 (rank 1) step latency 600.0 ms is 2.9x its rolling mean")
    assert monitor.observe(0, 0, {"step latency": 0.2, "communication latency": 0.01}) == []


def test_a_new_buckets_compiling_step_and_a_larger_bucket_raise_nothing_and_a_slowed_bucket_is_named():
    """As the forty-third session's Flux runs saw it: steps of 0.25 s on one bucket, then a new bucket's first step
    compiling for 35 s (then judged 6.6x the rolling mean: with on_anomaly = "stop" the run would have ended)."""
    monitor, rng = PipelineMonitor(factor=2.5), random.Random(2)
    assert _steady(monitor, 12, rng, "512x512") == []
    compiling = {"step latency": 35.0, "communication latency": 0.01}
    for stage in (0, 1):  # the new shape's first step: not judged, and not the baseline of the next
        assert monitor.observe(stage, stage, compiling, "1024x1024") == []
    assert _steady(monitor, 12, rng, "1024x1024", step_s=0.8) == []  # 4x the pixels, 4x the time: not a slowdown
    assert _steady(monitor, 5, rng, "512x512") == []  # back: judged against its own steps, not the larger ones
    alerts = monitor.observe(1, 1, {"step latency": 0.8 * 3.0, "communication latency": 0.01}, "1024x1024")
    assert [(a.stage, a.metric) for a in alerts] == [(1, "step latency")]
    assert alerts[0].message(40).endswith("(bucket 1024x1024)")
    assert monitor.observe(1, 1, {"step latency": 0.8 * 3.0, "communication latency": 0.01}, "512x512") != []


def test_tiny_figures_never_alert():
    monitor = PipelineMonitor()
    for _ in range(10):
        monitor.observe(0, 0, {"communication latency": 1e-5})
    assert monitor.observe(0, 0, {"communication latency": 5e-4}) == []


def test_allocator_retries_name_the_stage_and_what_to_try():
    ranks = [{"pp_rank": 0, "rank": 0, "alloc_retries": 3, "peak_gib": 105.4},
             {"pp_rank": 1, "rank": 1, "alloc_retries": 0, "peak_gib": 49.1}]
    warnings = memory_pressure_warnings(7, ranks)
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: step 7: stage 0 (rank 0) ran out of cached GPU memory 3 time(s)")
    assert "105.4 GiB" in warnings[0] and "expandable_segments:True" in warnings[0]
    assert memory_pressure_warnings(8, [dict(r, alloc_retries=0) for r in ranks]) == []

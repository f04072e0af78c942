"""`diffpipe plan --probe`: each planned stage run alone with the micro-batches 1F1B keeps in flight there."""
from __future__ import annotations

import json
from pathlib import Path

from diffpipe.cli import main

DIGITS = Path(__file__).parent.parent.parent / "examples" / "digits.toml"


def test_probe_runs_every_planned_stage_beside_its_plan(capsys):
    code = main(["plan", str(DIGITS), "--json", "--probe-unsplit", "--set", "pipeline.stages=3",
                 "--set", "pipeline.microbatches=4", "--set", "pipeline.checkpointing=[1]"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    unsplit, *stages = result["probed"]
    assert unsplit["stage"] == "unsplit" and unsplit["probed_ms"] > 0
    planned = result["planned"]["stages"]
    assert [r["stage"] for r in stages] == [s["stage"] for s in planned] == [0, 1, 2]
    assert [r["units"] for r in stages] == [s["units"] for s in planned]
    assert [r["in_flight"] for r in stages] == [3, 2, 1]  # 1F1B: stages - s
    assert [r["checkpointed"] for r in stages] == [False, True, False]
    for r in stages:
        assert r["probed_ms"] > 0 and r["planned_ms"] > 0
        assert abs(r["time_error"] - (r["planned_ms"] / r["probed_ms"] - 1)) < 0.01
        assert r["probed_peak_gib"] is None  # peak memory is measured on CUDA only


def test_probe_prints_a_table_after_the_plan(capsys):
    assert main(["plan", str(DIGITS), "--probe"]) == 0
    out = capsys.readouterr().out
    assert out.index("planned split") < out.index("each planned stage run alone on cpu")
    assert "probed ms" in out


def test_probe_with_a_world_size_probes_the_best_layout(capsys):
    assert main(["plan", str(DIGITS), "--world-size", "2", "--probe", "--json"]) == 0
    best, *others = json.loads(capsys.readouterr().out)
    assert len(best["probed"]) == len(best["planned"]["stages"])
    assert all("probed" not in other for other in others)

"""bench/scaling.py, the multi-GPU scaling run, works end to end as a gloo dry run on CPU processes: every
configuration trains, reports its figures and timeline, and a configuration that cannot run says why; with
--profile every run is planned from unit times measured first."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scaling_script_reports_every_configuration(tmp_path):
    cmd = [sys.executable, "bench/scaling.py", "--gpus", "2", "--config", "examples/digits.toml", "--device", "cpu",
           "--batch", "16", "--micro", "8", "--microbatches", "2", "--stages", "2,64", "--steps", "1",
           "--only", "single,pipeline", "--out", str(tmp_path), "--profile"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    planner, rows = lines[0]["planner"], lines[1:]
    profile = Path(json.loads(planner["plan.profile"]))  # --profile: every run planned from these unit times
    assert profile.is_file() and json.loads(profile.read_text())["key"]["device"] == "cpu"
    assert str(profile) in (tmp_path / "01-pipeline" / "config.toml").read_text()  # the run's resolved config
    assert [r["configuration"] for r in rows] == ["1 GPU", "pipeline 2, 1f1b, 2 micro-batches",
                                                  "pipeline 64, 1f1b, 2 micro-batches"]
    single, pipeline, impossible = rows
    assert "error" not in single and "error" not in pipeline, (single.get("error"), pipeline.get("error"))
    assert single["efficiency"] == 1.0 and single["samples_per_s"] > 0
    assert pipeline["devices"] == 2 and pipeline["samples_per_s"] > 0 and pipeline["efficiency"] > 0
    assert set(pipeline["peak_gib_per_stage"]) == {"stage0_peak_gib", "stage1_peak_gib"}
    assert len(pipeline["planned_gib_per_gpu"]) == 2 and all(g > 0 for g in pipeline["planned_gib_per_gpu"])
    assert len(single["planned_gib_per_gpu"]) == 1
    assert 0 <= pipeline["bubble"] < 1 and abs(pipeline["ideal_bubble"] - 1 / 3) < 1e-3  # (S-1)/(m+S-1)
    assert Path(pipeline["timeline"]).is_file()
    assert "stages" in impossible["error"]  # the preflight's message, not a crash of the script
    assert "| pipeline 2, 1f1b, 2 micro-batches |" in result.stdout

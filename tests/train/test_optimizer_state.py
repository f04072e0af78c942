"""memory.optimizer_state = "8bit": bitsandbytes' AdamW8bit trains what fp32 AdamW trains (within its quantisation),
its quantised moments and step go into checkpoints, and a cut-short run resumes bit for bit on its own layout and to
the same losses on others; the planner charges its moments about 2 bytes a parameter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from diffpipe.config import ConfigError
from diffpipe.config_files import build_config
from tests.train.test_checkpoint import _cut_short, _losses, _train

EIGHT_BIT = ["--set", 'memory.optimizer_state="8bit"']


@pytest.fixture(scope="module")
def runs(tmp_path_factory, full_run) -> dict[str, Path]:
    """The 8-bit run, and the same run with fp32 moments (the checkpoint tests' full run)."""
    eight = tmp_path_factory.mktemp("optimizer_state") / "8bit"
    result = _train("--output-dir", str(eight), *EIGHT_BIT)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"8bit": eight, "fp32": full_run}


def _state_dtypes(checkpoint: Path) -> dict[str, torch.dtype]:
    dtypes = {}
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            dtypes.update({key: f.get_slice(key).get_dtype() for key in f.keys() if key.startswith("optim.")})
    return dtypes


def test_8bit_moments_train_as_fp32_moments_do_within_their_rounding(runs):
    """Measured: 1.8e-5 relative at most over the 6 steps (the first is equal: Adam's first update is the gradient's
    sign, whatever the moments' rounding)."""
    eight, fp32 = _losses(runs["8bit"]), _losses(runs["fp32"])
    assert eight[0] == fp32[0] and eight != fp32
    assert list(eight.values()) == pytest.approx(list(fp32.values()), rel=1e-3)
    dtypes = _state_dtypes(runs["8bit"] / "checkpoints" / "step-00000003")
    assert {dtypes[k] for k in dtypes if k.endswith(".state1")} >= {"U8"}  # the large weights' moments: 8-bit
    assert any(k.endswith(".absmax2") for k in dtypes) and not any(k.endswith(".exp_avg") for k in dtypes)


@pytest.mark.parametrize("layout", [[], ["pipeline.stages=1", "pipeline.data_parallel=2"]], ids=["2 stages", "2 replicas"])
def test_a_cut_short_8bit_run_resumes_to_the_same_losses(runs, tmp_path, layout):
    run = _cut_short(runs["8bit"], tmp_path / "run")
    result = _train("--resume", str(run), *EIGHT_BIT, *(arg for item in layout for arg in ("--set", item)))
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = _losses(run), _losses(runs["8bit"])
    assert list(got) == list(range(6))
    if not layout:
        assert got == want  # the same layout: bit for bit (moments, scales and step counts restored)
    else:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_resuming_with_other_optimizer_state_is_refused(runs, tmp_path, capsys):
    run = _cut_short(runs["8bit"], tmp_path / "run")
    result = _train("--resume", str(run))
    assert result.returncode != 0 and "memory.optimizer_state" in capsys.readouterr().err


def test_8bit_state_is_refused_with_sharded_replicas_and_planned_at_about_2_bytes():
    with pytest.raises(ConfigError, match="data_parallel_shard"):
        build_config({"memory": {"optimizer_state": "8bit"},
                      "pipeline": {"stages": 1, "data_parallel": 2, "data_parallel_shard": True}})
    from diffpipe.build import build_backbone
    from diffpipe.planner.plan import _replicas, unit_costs

    config = build_config({"memory": {"optimizer_state": "8bit"}})
    costs = unit_costs(config, build_backbone(config, "meta"), 1)
    trained = sum(c.trainable_params for c in costs)
    fp32 = _replicas(build_config({}), 1, 1)
    saved = fp32.state_bytes(costs) - _replicas(config, 1, 1).state_bytes(costs)
    assert saved == pytest.approx(trained * (8 - 2 - 8 / 256))

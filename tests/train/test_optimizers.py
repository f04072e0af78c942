"""train.optimizer = "prodigy" and "adafactor": diffpipe's Prodigy steps as prodigyopt's does, both optimizers'
state goes into checkpoints and a cut-short run resumes bit for bit (Prodigy's step-size estimate included), the
planner charges their state, and settings they cannot take are refused. That a pipeline trains with them what the
unsplit model does is the central test's (tests/pipeline/test_pipelined_gradients.py, the prodigy-* and adafactor-*
scenarios: Prodigy's sums over every stage, a tied weight counted once, replicas)."""
from __future__ import annotations

import copy
from pathlib import Path

import prodigyopt
import pytest
import torch

from diffpipe.config import ConfigError
from diffpipe.config_files import build_config
from diffpipe.train.prodigy import Prodigy
from tests.planted import planted
from tests.train.test_checkpoint import _cut_short, _losses, _train

# d_coef 100: Prodigy's estimate leaves d0 within the 6 steps (d 3.4e-5 at the checkpoint, 8.1e-3 at the end), so a
# resume that lost it would step differently
SETTINGS = {"prodigy": ["--set", 'train.optimizer="prodigy"', "--set", "train.learning_rate=1.0",
                        "--set", "train.optimizer_args.d_coef=100"],
            "adafactor": ["--set", 'train.optimizer="adafactor"', "--set", "train.learning_rate=1e-3"]}


def _steps(optimizer_class, model: torch.nn.Module, steps: int, **settings):
    model = copy.deepcopy(model)
    opt = optimizer_class(model.parameters(), lr=1.0, betas=(0.9, 0.999), eps=1e-8, **settings)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 4, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("settings", [{}, {"use_bias_correction": True, "d_coef": 10.0, "beta3": 0.9},
                                      {"safeguard_warmup": True, "d0": 1e-4}, {"weight_decay": 0.1, "growth_rate": 1.02},
                                      {"chunk_elements": 20}],
                         ids=["defaults", "bias-correction", "safeguard-warmup", "decay-growth", "in-chunks"])
def test_prodigy_steps_as_prodigyopt_does(settings):
    """`chunk_elements`: diffpipe's own setting, its step's temporaries cut into runs of weights (one weight each
    here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    torch.nn.init.zeros_(model[2].weight)  # as LoRA's B starts (prodigyopt keeps a scalar p0 for it)
    theirs = {k: v for k, v in settings.items() if k != "chunk_elements"}
    want, _ = _steps(prodigyopt.Prodigy, model, 25, **theirs)
    got, optimizer = _steps(Prodigy, model, 25, **settings)
    assert optimizer.estimate["d"] > 1.5 * optimizer.d0  # the estimate has grown: it is exercised
    for mine, theirs in zip(got.parameters(), want.parameters()):
        assert torch.equal(mine, theirs)
    # the estimate's numerator planted with its sign flipped (<g, p - p0>) is seen
    wrong = planted("diffpipe.train.prodigy", 'foreach("sub", _USE)([state["p0"][i] for i in chunk], [weights[i] for i in chunk])',
                    'foreach("sub", _USE)([weights[i] for i in chunk], [state["p0"][i] for i in chunk])')
    off, _ = _steps(wrong.Prodigy, model, 25, **settings)
    assert any(not torch.equal(a, b) for a, b in zip(off.parameters(), want.parameters()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A 6-step run of each optimizer on the digits example's 2 stages, checkpointed at step 3."""
    out = {}
    for name, settings in SETTINGS.items():
        out[name] = tmp_path_factory.mktemp("optimizers") / name
        result = _train("--output-dir", str(out[name]), *settings)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize("optimizer", list(SETTINGS))
def test_a_cut_short_run_resumes_bit_for_bit(runs, tmp_path, optimizer, full_run):
    want = _losses(runs[optimizer])
    assert want != _losses(full_run)  # AdamW's run: the setting took effect
    run = _cut_short(runs[optimizer], tmp_path / "run")
    result = _train("--resume", str(run), *SETTINGS[optimizer])
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == want  # weights, state, step counts and Prodigy's estimate restored


def test_prodigy_estimate_is_in_the_checkpoint(runs):
    from safetensors import safe_open

    checkpoint = runs["prodigy"] / "checkpoints" / "step-00000003"
    keys = set()
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            keys |= set(f.keys())
            if "progress.prodigy_d" in f.keys():
                assert f.get_tensor("progress.prodigy_d").item() > 10 * 1e-6  # left d0: the estimate is at work
    assert {"progress.prodigy_d", "progress.prodigy_d_max", "progress.prodigy_d_numerator",
            "progress.prodigy_k"} <= keys
    assert any(k.endswith(".s") for k in keys) and any(k.endswith(".p0") for k in keys)


@pytest.mark.parametrize("data,words", [
    ({"train": {"optimizer": "prodigy", "optimizer_args": {"clip_threshold": 1.0}}}, "not a setting of"),
    ({"train": {"optimizer": "adafactor"}, "memory": {"optimizer_state": "8bit"}}, "AdamW's"),
    ({"train": {"optimizer": "prodigy"}, "pipeline": {"stages": 1, "data_parallel": 2, "data_parallel_shard": True}},
     "data_parallel_shard"),
    ({"train": {"optimizer": "adafactor"}, "pipeline": {"stages": 2, "data_parallel": 2}}, "DTensors"),
    ({"train": {"optimizer": "prodigy", "stage_lr_scale": [1.0, 0.5]}, "pipeline": {"stages": 2}}, "stage_lr_scale"),
], ids=["unknown-arg", "8bit-state", "sharded", "adafactor-pipeline-replicas", "stage-lr"])
def test_settings_an_optimizer_cannot_take_are_refused(data, words):
    with pytest.raises(ConfigError, match=words):
        build_config(data)


def test_the_planner_charges_each_optimizers_state():
    """Prodigy: 16 bytes a trained weight (moments, s, p0) against AdamW's 8; Adafactor: 4 bytes a row and a
    column of each matrix, an element of each vector."""
    from diffpipe.build import build_backbone
    from diffpipe.planner.plan import _replicas, unit_costs

    def state(data: dict, costs) -> float:
        return _replicas(build_config(data), 1, 1).state_bytes(costs)

    config = build_config({})
    model = build_backbone(config, "meta").model
    costs = unit_costs(config, build_backbone(config, "meta"), 1)
    trained = sum(c.trainable_params for c in costs)
    adamw = state({}, costs)
    assert state({"train": {"optimizer": "prodigy"}}, costs) - adamw == pytest.approx(8 * trained)
    factored = sum(p.numel() if p.dim() < 2 else p.shape[:-1].numel() + (p.shape[:-2] + p.shape[-1:]).numel()
                   for p in model.parameters())
    assert adamw - state({"train": {"optimizer": "adafactor"}}, costs) == pytest.approx(8 * trained - 4 * factored)
    with_first = state({"train": {"optimizer": "adafactor", "optimizer_args": {"beta1": 0.9}}}, costs)
    assert with_first - state({"train": {"optimizer": "adafactor"}}, costs) == pytest.approx(4 * trained)


def test_prodigy_with_an_adamw_sized_learning_rate_is_noted_before_launch(tmp_path):
    adamw_sized = _train("--output-dir", str(tmp_path / "small"), *SETTINGS["prodigy"][:2],
                         "--set", "train.learning_rate=1e-4", "--set", "train.max_steps=1")
    assert adamw_sized.returncode == 0 and "Prodigy's learning rate multiplies the step size" in adamw_sized.stdout
    as_meant = _train("--output-dir", str(tmp_path / "one"), *SETTINGS["prodigy"], "--set", "train.max_steps=1")
    assert as_meant.returncode == 0 and "note:" not in as_meant.stdout

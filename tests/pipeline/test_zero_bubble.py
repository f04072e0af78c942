"""The guard against zero-bubble schedules' silently wrong weight gradients (docs/pipelining-facts.md, pitfall 3):
found from the autograd graph, refused with a message, and shown to matter (without it, a parameter trains on
no gradient)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from diffpipe.distributed import WorkerFailed
from diffpipe.pipeline.zero_bubble import missed_parameters

from ..helpers import run_workers
from .test_pipelined_gradients import TWO, model_folders, resolved  # noqa: F401 (fixture)


def _named(*modules: nn.Module):
    return [(f"m{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]


def test_parameters_reached_only_from_inputs_without_gradient_are_found():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    h = torch.randn(2, 4, requires_grad=True)  # received from the previous stage
    sample = torch.randn(2, 4)  # received, no gradient (the noisy latents)
    skip = a(sample)
    assert missed_parameters([skip], [h, sample], _named(a)) == ["m0.weight", "m0.bias"]  # sent on: wholly missed
    joined = b(h) + skip
    assert missed_parameters([joined], [h, sample], _named(a, b)) == []  # joins the input's path: captured
    assert missed_parameters([joined, skip], [h, sample], _named(a, b)) == ["m0.weight", "m0.bias"]  # partly


def _gradients_of_one_step(payload: dict, out_dir: str, guarded: bool) -> None:
    from pathlib import Path

    from diffpipe.config_files import build_config
    from diffpipe.distributed import init_topology
    from diffpipe.pipeline.stage import StageModule
    from diffpipe.train.trainer import Trainer

    if not guarded:  # the planted error: no guard
        StageModule._check_split_backward = lambda self, out, received: None
    config = build_config(payload)
    topo = init_topology(config.pipeline.stages, 1, "cpu")
    trainer = Trainer(config, topo, Path(out_dir))
    trainer.steps.forward_backward(0)
    torch.save(sorted(trainer.steps.batch_gradients()), Path(out_dir) / f"grads-rank{topo.rank}.pt")


def test_a_split_zero_bubble_would_get_wrong_is_refused(model_folders, tmp_path):  # noqa: F811
    data = copy.deepcopy(TWO["zbv-2x2"])
    data["pipeline"]["split"] = [1, 2, 7]  # stage 1 = conv_in alone: its output reaches later stages as a skip
    payload = resolved(data, model_folders).model_dump(mode="json")
    with pytest.raises(WorkerFailed, match=r"'zbv' would compute wrong gradients for stage 1 \(units conv_in"):
        run_workers(_gradients_of_one_step, (payload, str(tmp_path), True), 2)
    run_workers(_gradients_of_one_step, (payload, str(tmp_path), False), 2)
    held = torch.load(tmp_path / "grads-rank1.pt")  # stages 1 and 2
    assert "conv_in.weight" not in held and "down_blocks.0.resnets.0.conv1.weight" in held  # silently no gradient

"""Wrapping a process's stages for torch's data parallelism: what is wrapped alone, and the layout it refuses.
(That the replicas train to the unsplit model's gradients is the central test's: test_pipelined_gradients.py.)"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from diffpipe.config import ConfigError
from diffpipe.distributed import Topology
from diffpipe.pipeline.data_parallel import _parts_wrapped_alone, local_numel, spread_over_replicas


class _Stage(nn.Module):
    def __init__(self, *units: nn.Module):
        super().__init__()
        self.units = nn.ModuleList(units)


def _topology(dp_size: int, dp_rank: int = 0) -> Topology:
    return Topology(rank=dp_rank, world_size=dp_size, pp_rank=0, pp_size=1, dp_rank=dp_rank, dp_size=dp_size,
                    device=torch.device("cpu"), pp_group=None, dp_group=None)


def test_units_are_wrapped_alone_unless_two_share_a_weight():
    a, b, no_weights = nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU()
    assert _parts_wrapped_alone(_Stage(a, no_weights, b)) == [a, b]
    tied = nn.Sequential(nn.Linear(2, 2))
    tied[0].weight = a.weight  # a norm shared by a DiT's first and last units, say
    assert _parts_wrapped_alone(_Stage(a, b, tied)) == []


def test_a_weight_in_two_stages_of_one_process_is_refused_with_replicas():
    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    last.weight = first.weight
    with pytest.raises(ConfigError, match="weight shared by two stages of one process"):
        spread_over_replicas([_Stage(first), _Stage(last)], _topology(2), shard=True)


def test_a_replicas_part_of_a_parameter_it_does_not_hold_is_cut_as_fsdp_cuts_it():
    """What a process that lacks a tied weight's stage adds to the pipeline's sum of its gradient."""
    for rank, rows in enumerate([3, 2]):  # torch.chunk of 5 rows over 2 replicas
        assert local_numel(None, (5, 4), _topology(2, rank), shard=True) == rows * 4
    assert local_numel(None, (5, 4), _topology(2, 1), shard=False) == 20
    assert local_numel(None, (3,), _topology(4, 3), shard=True) == 0  # chunk makes 3 parts: the 4th holds none


class _Units(nn.Module):
    """A stage of 3 linear units, as StageModule lists them."""

    def __init__(self):
        super().__init__()
        self.units = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for unit in self.units:
            x = unit(x)
        return x


def _whole_weights_while_the_last_unit_runs(out_dir: str, pp_size: int) -> None:
    """Which units hold whole weights (plain tensors, not their DTensor part) while the last unit computes: in a
    stage alone, sharded, only the one computing; in a pipeline, every unit, from the first forward on."""
    from torch.distributed.tensor import DTensor

    from diffpipe.distributed import init_topology
    from diffpipe.pipeline.data_parallel import before_backward

    topo = init_topology(1, 2, "cpu")
    topo.pp_size = pp_size  # as a pipeline's stage wraps it (the processes here are only its replicas)
    torch.manual_seed(0)
    stage = _Units()
    spread_over_replicas([stage], topo, shard=True)
    seen = []
    stage.units[2].register_forward_pre_hook(
        lambda *_: seen.append([not isinstance(u.weight, DTensor) for u in stage.units]))
    for i in range(2):
        before_backward(stage, last=i == 1)
        stage(torch.randn(4, 8)).square().mean().backward()
    if topo.rank == 0:
        torch.save(seen, f"{out_dir}/seen-{pp_size}.pt")


@pytest.mark.parametrize("pp_size", [1, 2], ids=["stage-alone", "in-a-pipeline"])
def test_sharded_replicas_of_a_stage_alone_gather_one_unit_at_a_time(tmp_path, pp_size):
    from ..helpers import run_workers

    run_workers(_whole_weights_while_the_last_unit_runs, (str(tmp_path), pp_size), 2)
    seen = torch.load(tmp_path / f"seen-{pp_size}.pt")
    assert seen == ([[False, False, True]] * 2 if pp_size == 1 else [[True, True, True]] * 2)


def _gradients_per_micro_batch(out_dir: str) -> None:
    """A replicated stage alone: its parameter type, and each replica's gradients after each micro-batch's backward
    (each replica fed its own data)."""
    from diffpipe.distributed import init_topology
    from diffpipe.pipeline.data_parallel import before_backward

    topo = init_topology(1, 2, "cpu")
    torch.manual_seed(0)
    stage = _Units()
    spread_over_replicas([stage], topo, shard=False)
    torch.manual_seed(1 + topo.rank)
    grads = []
    for i in range(2):
        before_backward(stage, last=i == 1)
        stage(torch.randn(4, 8)).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in stage.parameters()]).clone())
    torch.save({"plain": all(type(p) is nn.Parameter for p in stage.parameters()), "grads": grads},
               f"{out_dir}/grads-{topo.rank}.pt")


def test_replicas_of_a_stage_alone_keep_plain_weights_and_reduce_in_the_last_backward(tmp_path):
    """torch's DDP engine: no DTensor dispatch on the optimizer's path, and one gradient reduction a step."""
    from ..helpers import run_workers

    run_workers(_gradients_per_micro_batch, (str(tmp_path),), 2)
    first, second = (torch.load(tmp_path / f"grads-{rank}.pt") for rank in range(2))
    assert first["plain"] and second["plain"]
    assert not torch.allclose(first["grads"][0], second["grads"][0])  # micro-batch 1: each replica's own
    torch.testing.assert_close(first["grads"][1], second["grads"][1])  # after the last: reduced, the same

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

"""The final weights reach rank 0 over the process group: with a run folder of its own per process (machines that
share no disk), rank 0's model.safetensors holds every stage's weights, whole when replicas cut them, and the
other folders hold nothing."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe.config_files import build_config

from ..helpers import run_workers


def _worker(root: str, stages: int, shard: bool) -> None:
    from diffpipe.distributed import init_topology
    from diffpipe.pipeline.data_parallel import full
    from diffpipe.train.trainer import Trainer

    replicas = 2 // stages
    config = build_config({"train": {"batch_size": 8, "max_steps": 1},
                           "pipeline": {"stages": stages, "data_parallel": replicas, "data_parallel_shard": shard,
                                        "microbatches": 2},
                           "observe": {"enabled": False, "tensorboard": False}})
    topo = init_topology(stages, replicas, "cpu")
    run_dir = Path(root) / f"machine-{topo.rank}"  # nothing shared
    run_dir.mkdir()
    trainer = Trainer(config, topo, run_dir)
    trainer.steps.take(0)
    trainer.save()
    own = {k: full(v).contiguous() for m in trainer.modules for k, v in m.full_state_dict().items()}
    save_file(own, os.path.join(root, f"expected-{topo.rank}.safetensors"))


@pytest.mark.parametrize("stages,shard", [(2, False), (1, True)], ids=["2-stages", "2-sharded-replicas"])
def test_rank_0_writes_every_stage_without_a_shared_folder(tmp_path, stages, shard):
    """Of 2 stages, or of 2 replicas that each hold a part of every weight (made whole for the file)."""
    run_workers(_worker, (str(tmp_path), stages, shard), 2)
    expected = {**load_file(str(tmp_path / "expected-0.safetensors")), **load_file(str(tmp_path / "expected-1.safetensors"))}
    written = load_file(str(tmp_path / "machine-0" / "model.safetensors"))
    assert written.keys() == expected.keys() and len(written) > 50
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    assert (tmp_path / "machine-0" / "text_encoder").is_dir()
    assert list((tmp_path / "machine-1").iterdir()) == []

"""Checkpoints on machines that share no disk: every process's run folder gets a sealed checkpoint holding the files
its machine wrote and listing every machine's; resuming from one folder names the missing files and says to copy
them; copied into one folder, the checkpoint verifies and loads every process's tensors back."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffpipe.models.loading import CheckpointError

from ..helpers import run_workers


def _trainer(root: str, machine_folders: bool):
    from diffpipe.config_files import build_config
    from diffpipe.distributed import init_topology
    from diffpipe.train.trainer import Trainer

    config = build_config({"train": {"batch_size": 8, "max_steps": 2}, "pipeline": {"stages": 2, "microbatches": 2},
                           "observe": {"enabled": False, "tensorboard": False}})
    topo = init_topology(2, 1, "cpu")
    run_dir = Path(root) / (f"machine-{topo.rank}" if machine_folders else "resumed")
    run_dir.mkdir(exist_ok=True)
    return Trainer(config, topo, run_dir), topo.rank


def _save(root: str) -> None:
    from diffpipe.train.checkpoint import _state, save_checkpoint

    trainer, rank = _trainer(root, machine_folders=True)
    trainer.steps.take(0)
    save_checkpoint(trainer, 1, keep=2)
    save_file({k: v.contiguous() for k, v in _state(trainer, 1).items()}, str(Path(root) / f"expected-{rank}.safetensors"))


def _load(root: str, checkpoint: str) -> None:
    from diffpipe.train.checkpoint import _state, load_checkpoint

    trainer, rank = _trainer(root, machine_folders=False)
    assert load_checkpoint(trainer, Path(checkpoint)) == 1
    expected = load_file(str(Path(root) / f"expected-{rank}.safetensors"))
    got = _state(trainer, 1)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_each_machine_seals_its_part_and_one_folder_of_all_parts_resumes(tmp_path):
    from diffpipe.train.checkpoint import verify_checkpoint

    run_workers(_save, (str(tmp_path),), 2)
    parts = [tmp_path / f"machine-{r}" / "checkpoints" / "step-00000001" for r in (0, 1)]
    seals = [json.loads((p / "complete.json").read_text()) for p in parts]
    assert seals[0] == seals[1]  # each machine's seal lists every file
    writers = {name: info["process"] for name, info in seals[0]["files"].items()}
    assert set(writers.values()) == {0, 1}
    for rank, part in enumerate(parts):  # each folder holds only what its machine wrote, nothing half-done
        assert sorted(f.name for f in part.glob("*.safetensors")) == sorted(n for n, r in writers.items() if r == rank)
        assert not list(part.parent.glob(".*")) and not list(part.glob(".process-*"))
    shapes = {k: tuple(v) for k, v in seals[0]["model"].items()}
    with pytest.raises(CheckpointError, match=r"\(written by process 1\) is missing. If the run's machines share no "
                                              r"disk, copy every machine's checkpoints/step-00000001 into this one"):
        verify_checkpoint(parts[0], shapes)
    for f in parts[1].glob("*.safetensors"):
        shutil.copy(f, parts[0])
    assert verify_checkpoint(parts[0], shapes) == 1
    run_workers(_load, (str(tmp_path), str(parts[0])), 2)

"""One optimizer step across stages: fp16 overflow decisions shared by every stage (and a skipped step does not
advance the learning-rate schedule); per-stage learning rates."""
from __future__ import annotations

import os

import torch

from diffpipe.config_files import build_config

from ..helpers import run_workers


def _worker(out_dir: str) -> None:
    from pathlib import Path

    from diffpipe.distributed import init_topology
    from diffpipe.train.records import read_record
    from diffpipe.train.trainer import Trainer

    config = build_config({"train": {"precision": "fp16", "batch_size": 8, "max_steps": 2},
                           "pipeline": {"stages": 2, "microbatches": 2, "split": [5]}})
    topo = init_topology(2, 1, "cpu")
    trainer = Trainer(config, topo, Path(out_dir))
    before = [p.detach().clone() for p in trainer.params]
    loss, _ = trainer.steps.forward_backward(0)
    if topo.pp_rank == 1:  # an overflow on the last stage only
        trainer.params[0].grad.view(-1)[0] = float("inf")
    overflowed = read_record(trainer.steps.apply_gradients(0, loss))
    unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.params))
    clean = read_record(trainer.steps.apply_gradients(1, trainer.steps.forward_backward(1)[0]))
    torch.save({"overflowed": overflowed, "unchanged": unchanged, "clean": clean},
               os.path.join(out_dir, f"rank{topo.rank}.pt"))


def test_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path):
    run_workers(_worker, (str(tmp_path),), 2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert r["overflowed"]["skipped"] is True and r["unchanged"]
        assert r["clean"]["skipped"] is False
        assert r["clean"]["loss_scale"] == r["overflowed"]["loss_scale"] / 2
        # cosine over 2 steps: had the skipped step advanced the schedule, the next would run at half the rate
        assert r["clean"]["lr"] == r["overflowed"]["lr"] == 1e-3


def _lr_worker(out_dir: str) -> None:
    from pathlib import Path

    from diffpipe.distributed import init_topology
    from diffpipe.train.trainer import Trainer

    config = build_config({"train": {"batch_size": 8, "max_steps": 1, "stage_lr_scale": [1.0, 0.0]},
                           "pipeline": {"stages": 2, "microbatches": 2}})
    topo = init_topology(2, 1, "cpu")
    trainer = Trainer(config, topo, Path(out_dir))
    before = [p.detach().clone() for p in trainer.params]
    trainer.steps.take(0)
    changed = sum(not torch.equal(a, p) for a, p in zip(before, trainer.params))
    torch.save({"changed": changed, "count": len(before)}, os.path.join(out_dir, f"lr{topo.rank}.pt"))


def test_stage_lr_scale_applies_per_stage(tmp_path):
    run_workers(_lr_worker, (str(tmp_path),), 2)
    first, second = (torch.load(tmp_path / f"lr{r}.pt") for r in range(2))
    assert first["changed"] > 0.9 * first["count"]  # lr x 1: (nearly) every weight moves
    assert second["changed"] == 0  # lr x 0: none does

"""The central test: pipelined training computes what the unsplit model computes.

Real processes (gloo, CPU), real diffusers UNet. For every schedule offered, with 2 and 4 stages and with
data-parallel 2 x pipeline 2, the loss and every parameter gradient of the first step equal those of the
unsplit model in one process with the same micro-batches, timesteps and noise, and the weights after three
optimizer steps are equal too. AdamW's epsilon is 1e-6 here: with 1e-8, Adam divides gradients of ~1e-9 by
their own root-mean-square, so float rounding in the order gradients are summed (1e-9 here) would
decide the sign of a whole learning-rate-sized update. Scenarios of one world size share one launch (a launch costs ~10 s here).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from diffpipe.build import build_backbone, build_text_encoder
from diffpipe.config import build_config
from diffpipe.data.batches import BatchMaker
from diffpipe.data.digits import DigitsDataset
from diffpipe.train.optim import lr_factor

from ..helpers import run_workers

STEPS = 3
TOL = 1e-5


def _config(stages: int, schedule: str, virtual: int = 1, dp: int = 1, microbatches: int = 4, checkpointing="none"):
    return build_config({
        "train": {"max_steps": STEPS, "batch_size": 8 * dp * microbatches // 2, "learning_rate": 1e-3,
                  "warmup_steps": 1, "adam_eps": 1e-6, "max_grad_norm": 1.0, "seed": 3, "timestep_sampling": "uniform"},
        "pipeline": {"stages": stages, "schedule": schedule, "virtual_stages": virtual, "data_parallel": dp,
                     "microbatches": microbatches, "checkpointing": checkpointing},
    })


def _scenario_worker(scenarios: list[dict], out_dir: str, device_kind: str = "cpu") -> None:
    """Each scenario trained for STEPS steps on this rank (gloo on CPU; NCCL on GPUs for bench/nccl_gradients.py)."""
    from pathlib import Path

    from diffpipe.distributed import init_topology
    from diffpipe.train.trainer import Trainer

    if device_kind == "cuda":  # compare fp32 with fp32: cuDNN convolutions would otherwise round through TF32
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    for name, data in scenarios:
        config = build_config(data)
        topo = init_topology(config.pipeline.stages, config.pipeline.data_parallel, device_kind)
        trainer = Trainer(config, topo, Path(out_dir))
        losses, grads = [], None
        for step in range(STEPS):
            losses.append(trainer._step(step)[0]["loss"])
            if step == 0:
                grads = {n: p.grad.cpu() for m in trainer.modules for n, p in m.full_named_parameters()}
        weights = {n: p.detach().cpu() for m in trainer.modules for n, p in m.full_named_parameters()}
        torch.save({"losses": losses, "grads": grads, "weights": weights},
                   os.path.join(out_dir, f"{name}-rank{topo.rank}.pt"))


def _reference(config) -> dict:
    """The unsplit model in one process: same batches, micro-batches of the same size, same clipping and AdamW."""
    backbone = build_backbone(config)
    model = backbone.model.train()
    data = DigitsDataset()
    maker = BatchMaker(data.images, data.captions, build_text_encoder(config, backbone), config.train,
                       config.data.caption_dropout, backbone.conditions)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=config.train.learning_rate, betas=config.train.betas,
                            weight_decay=config.train.weight_decay, eps=config.train.adam_eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config.train))
    chunks = config.pipeline.microbatches * config.pipeline.data_parallel
    losses, grads = [], None
    for step in range(STEPS):
        batch = maker.make(step, 0, 1)
        opt.zero_grad(set_to_none=True)
        micro_losses = []
        for i in range(chunks):
            part = slice(i * config.micro_batch_size, (i + 1) * config.micro_batch_size)
            conditions = {k: v[part] for k, v in batch.conditions.items()}
            out = backbone.forward({"sample": batch.noisy[part]}, conditions)
            loss = F.mse_loss(out, batch.target[part])
            loss.backward()
            micro_losses.append(loss.detach())
        for p in params:
            p.grad /= chunks
        torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        sched.step()
        losses.append(float(torch.stack(micro_losses).mean()))
    return {"losses": losses, "grads": grads, "weights": {n: p.detach() for n, p in model.named_parameters()}}


def differences(name: str, world: int, config, results_dir) -> dict:
    """Largest differences from the unsplit model over every rank: losses, gradients, weights; and the
    parameters no stage held."""
    ref = _reference(config)
    seen, worst, where = set(), {"losses": 0.0, "grads": 0.0, "weights": 0.0}, {}
    for rank in range(world):
        got = torch.load(os.path.join(results_dir, f"{name}-rank{rank}.pt"))
        worst["losses"] = max([worst["losses"]] + [abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)])
        for key in ("grads", "weights"):
            for param, value in got[key].items():
                diff = (value - ref[key][param]).abs().max().item()
                if diff >= worst[key]:
                    worst[key], where[key] = diff, f"rank {rank} {param}"
        seen |= set(got["grads"])
    return {**worst, "where": where, "missing": sorted(set(ref["grads"]) - seen)}


def _compare(name: str, world: int, config, results_dir) -> None:
    found = differences(name, world, config, results_dir)
    assert not found["missing"], f"{name}: parameters not held by any stage: {found['missing']}"
    for key in ("losses", "grads", "weights"):
        assert found[key] <= TOL, (f"{name}: {key} differ from the unsplit model's by up to {found[key]:.2e} "
                                   f"({found['where'].get(key, '')})")


TWO = {
    "gpipe-2": _config(2, "gpipe"),
    "1f1b-2": _config(2, "1f1b"),
    "interleaved-2x2": _config(2, "interleaved_1f1b", virtual=2),
    "1f1b-2-checkpointed": _config(2, "1f1b", checkpointing="all"),
}
FOUR = {
    "gpipe-4": _config(4, "gpipe"),
    "1f1b-4": _config(4, "1f1b"),
    "interleaved-4x2": _config(4, "interleaved_1f1b", virtual=2),
    "dp2-x-1f1b-2": _config(2, "1f1b", dp=2),
}


@pytest.mark.parametrize("world,scenarios", [(2, TWO), (4, FOUR)], ids=["2-processes", "4-processes"])
def test_pipelined_loss_grads_and_weights_equal_unsplit_model(world, scenarios, tmp_path):
    payload = [(name, cfg.model_dump(mode="json")) for name, cfg in scenarios.items()]
    run_workers(_scenario_worker, (payload, str(tmp_path)), world)
    for name, config in scenarios.items():
        _compare(name, world, config, tmp_path)

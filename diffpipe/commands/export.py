"""`diffpipe export RUN --format FORMAT --out PATH [--step N]`: a finished run's weights, or a checkpoint's, in the
layouts other tools load (export/: one module per format).

    diffpipe export runs/lora --format kohya --out lora.safetensors
    diffpipe export runs/lora --format kohya --out step2000.safetensors --step 2000

With --step, a checkpoint is exported as the finished run would be, while the run trains on or after it ended
(kohya's per-epoch saves, chosen afterwards).

The checkpoint after step N (RUN/checkpoints/step-0000000N, verified file by file) is read into the model built as
one stage on this machine's CPU, whatever layout wrote it: full fine-tunes take every trained weight from it, LoRA
runs the adapters (the base is model.path's, or the seeded one, as in the run). The run's weight files are then
written as the run writes them at its end (train/weights.py) into a folder of their own, and exported from there.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from ..build import build_backbone, build_stages
from ..config import RunConfig
from ..errors import CheckpointError, ExportError
from ..export.run import ExportedRun, export_files, export_run, prepare_export
from ..models.registry import family_for
from ..pipeline.split import stage_specs
from ..train.checkpoint import CHECKPOINTS, model_shapes, verify_checkpoint
from ..train.weights import write_weights

__all__ = ["export_command", "checkpoint_folder", "write_checkpoint_weights"]


def export_command(run_dir: Path, fmt: str, out: Path, force: bool = False, step: int | None = None) -> Path:
    """The export written (its path): of the run's final weights, or with `step` of its checkpoint after that step."""
    if step is None:
        return export_run(run_dir, fmt, out, force)
    config, writer, out = prepare_export(run_dir, fmt, out, force, finished=False)
    checkpoint = checkpoint_folder(run_dir, step)  # says which steps there are, before any work
    writer.check(ExportedRun(run_dir, config, family_for(config.model.architecture), {}))  # what the format holds
    with tempfile.TemporaryDirectory(prefix="diffpipe-export-") as folder:
        write_checkpoint_weights(config, checkpoint, Path(folder))
        return export_files(Path(folder), config, writer, out)


def checkpoint_folder(run_dir: Path, step: int) -> Path:
    """RUN/checkpoints/step-N, or an error listing the steps there are."""
    path = run_dir / CHECKPOINTS / f"step-{step:08d}"
    if not path.is_dir():
        kept = sorted(int(p.name.removeprefix("step-")) for p in (run_dir / CHECKPOINTS).glob("step-*")
                      if p.name.removeprefix("step-").isdigit())
        there = f"the checkpoints there are after steps {', '.join(map(str, kept))}" if kept else "it has none"
        raise ExportError(f"--step {step}: {run_dir} has no checkpoint after step {step}; {there}")
    return path


def write_checkpoint_weights(config: RunConfig, path: Path, into: Path) -> None:
    """The weight files of the run of `config` (model.safetensors, lora.safetensors, model_config.json) as of its
    checkpoint at `path`, in the folder `into`."""
    one = config.model_copy(update={  # one stage on this CPU, nothing swapped or compiled: the plain model
        "pipeline": config.pipeline.model_copy(update={"stages": 1, "data_parallel": 1, "virtual_stages": 1,
                                                        "split": [], "checkpointing": [], "compile": False}),
        "memory": config.memory.model_copy(update={"base_dtype": "fp32", "block_swap": 0}),
        "train": config.train.model_copy(update={"device": "cpu"})})
    backbone = build_backbone(one, "meta")
    model_config = dict(backbone.model.config)
    verify_checkpoint(path, model_shapes(backbone.model))
    stage = build_stages(one, backbone, stage_specs(backbone, []), [0], torch.device("cpu"), [])[0]
    trained = {name: p for name, p in stage.full_named_parameters() if p.requires_grad}
    found = set()
    kind = "ema." if config.train.ema_decay > 0 else "model."  # a moving average's run exports the average
    with torch.no_grad():
        for shard in sorted(path.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    name = key.removeprefix(kind)
                    if key.startswith(kind) and name in trained:
                        trained[name].copy_(f.get_tensor(key))
                        found.add(name)
    if found != set(trained):
        missing = sorted(set(trained) - found)
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} trained weight(s) (first: {missing[0]}); "
                              "export another step")
    into.mkdir(parents=True, exist_ok=True)
    write_weights(config, stage.full_state_dict(), model_config, into, "cpu", backbone.family.lora_targets)

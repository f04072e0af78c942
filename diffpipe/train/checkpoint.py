"""Checkpoints: each process writes what it holds, any layout reads back what it needs.

Written through `torch.distributed.checkpoint` (DCP) with its safetensors storage (`HuggingFaceStorageWriter`:
no pickle anywhere, readable by any safetensors tool), as one flat map of tensors under diffusers' parameter names:
`model.NAME`, `optim.NAME.exp_avg | exp_avg_sq | step` (AdamW; the other optimizers' keys are in optim._STATE_KEYS),
`ema.NAME` (train.ema_decay's moving average) and `progress.*` (the next step, the learning-rate schedule's position,
the fp16 loss scale, the steps the moving average has seen, Prodigy's step-size estimate). A pipeline rank writes its
own stages; data-parallel replicas hold the same names and DCP writes one copy. Loading asks DCP for the names this
process holds now, so a checkpoint of 2 stages resumes on 1, 3 or 4 stages or another data-parallel degree. The
batches need no state: every step's data, noise and timesteps are drawn from (seed, step) (data/batches.py).

Each process's part is cut into files of about 1 GiB (a parameter with its AdamW moments stays in one file): DCP's
safetensors writer builds a whole file in memory before writing it, so one file per process held a second copy of
everything (and a background save a third: an SDXL UNet's 28.7 GiB ran a 125 GiB host out of memory).

RUN_DIR/checkpoints/step-00000100/ holds the shards and, written last, `complete.json` (step, each model tensor's
shape, each file's size, sha256 and writing process). A save goes to a hidden folder renamed into place once
complete, and a checkpoint is verified file by file before anything in it is read. Each process hashes the files it
wrote; the lowest process that sees a run folder seals it, so machines that share no disk each seal their own part
(listing every machine's files: resuming needs them copied into one folder, and says so).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from ..models.loading import CheckpointError
from ..torch_support import move_lr_schedule
from .optim import ensure_state, run_level_state, set_run_level_state, set_steps, state_keys, state_tensors

__all__ = ["CHECKPOINTS", "read_seal", "sha256_of", "PendingCheckpoint", "model_shapes", "save_checkpoint", "latest_checkpoint", "verify_checkpoint", "load_checkpoint",
           "unsafe_changes"]

CHECKPOINTS = "checkpoints"
_COMPLETE = "complete.json"
_FILE_BYTES = 1 << 30  # a checkpoint file's size, about
_ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")
# what a resumed run may change: its length, logging, outputs and the layout (a checkpoint reshards by name)
_SAFE_TO_CHANGE = ("train.max_steps", "train.epochs", "train.learning_rate", "train.log_every", "train.device",
                   "train.collective_timeout_minutes", "pipeline.", "plan.", "observe.", "checkpoint.", "output.",
                   "sample.", "data.text_cache_gib", "memory.block_swap")


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each trained parameter's name and shape (diffusers names; with LoRA, the adapters alone: the frozen base
    comes from model.path): what a checkpoint must match (works on a meta model)."""
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def _held(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    """This process's trained parameters by name: what its part of a checkpoint holds."""
    return [(name, p) for module in trainer.modules for name, p in module.full_named_parameters() if p.requires_grad]


def _state(trainer, next_step: int) -> dict[str, torch.Tensor]:
    """What this process holds, by name: its stages' weights and AdamW state, and the run's progress."""
    ensure_state(trainer.optimizer)
    state = {}
    for name, p in _held(trainer):
        state[f"model.{name}"] = p.detach()
        for key, value in state_tensors(trainer.optimizer, p).items():
            state[f"optim.{name}.{key}"] = value
    if trainer.ema is not None:  # the moving average beside each weight, and the steps it has seen
        average_of = {id(p): a for p, a in zip(trainer.ema.params, trainer.ema.averages)}
        state.update({f"ema.{name}": average_of[id(p)] for name, p in _held(trainer)})
        state["progress.ema_steps"] = trainer.ema.steps
    state["progress.next_step"] = torch.tensor(next_step, dtype=torch.int64)
    state["progress.lr_schedule_steps"] = torch.tensor(trainer.lr_schedule.last_epoch, dtype=torch.int64)
    state["progress.loss_scale"] = torch.tensor(trainer.scaler.scale, dtype=torch.float64)
    state["progress.loss_scale_good_steps"] = torch.tensor(trainer.scaler.good_steps, dtype=torch.int64)
    state.update(run_level_state(trainer.optimizer))
    return state


def file_of_each_tensor(model_shapes: dict[str, tuple[int, ...]], optimizer_keys: tuple[str, ...] = _ADAMW_KEYS,
                        moving_average: bool = False, run_level: tuple[str, ...] = ()) -> dict[str, int]:
    """The file (1, 2, ...) each checkpoint tensor goes to: parameters in order, with their AdamW moments (and
    train.ema_decay's average), about `_FILE_BYTES` a file (fp32 counted), the run's progress in the first. The same on
    every process (rank 0's decides for all); a name it lacks (the second name of a tied weight) goes to file 0."""
    files: dict[str, int] = defaultdict(int)
    index, size = 1, 0
    for name, shape in model_shapes.items():
        nbytes = (4 if moving_average else 3) * 4 * int(torch.Size(shape).numel())  # weight, moments (, average)
        if size and size + nbytes > _FILE_BYTES:
            index, size = index + 1, 0
        size += nbytes
        files[f"model.{name}"] = index
        files.update({f"optim.{name}.{key}": index for key in optimizer_keys})
        if moving_average:
            files[f"ema.{name}"] = index
    for key in ("next_step", "lr_schedule_steps", "loss_scale", "loss_scale_good_steps"):  # as `_state` names them
        files[f"progress.{key}"] = 1
    if moving_average:
        files["progress.ema_steps"] = 1
    files.update({key: 1 for key in run_level})  # the optimizer's own (optim.run_level_state)
    return files


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class PendingCheckpoint:
    """A checkpoint being written in the background (`checkpoint.asynchronous`): its tensors were copied to host
    memory when it was started, so training may change the weights; `finish` waits for the writes and seals it."""

    def __init__(self, trainer, next_step: int, future, partial: Path, final: Path, keep: int):
        self.trainer, self.next_step, self.future = trainer, next_step, future
        self.partial, self.final, self.keep = partial, final, keep

    def finish(self) -> Path:
        """Wait for every process's writes, then seal. Collective."""
        self.future.result()
        return _seal(self.trainer, self.partial, self.final, self.next_step, self.keep)


def save_checkpoint(trainer, next_step: int, keep: int, background_group: dist.ProcessGroup | None = None):
    """Every process writes its part of the checkpoint taken before step `next_step`; rank 0 seals it, keeps the
    newest `keep` and removes the rest. Collective: every process must call it. With `background_group` (a gloo
    group: the writes' own collectives run beside training's) the tensors are copied to host memory, written by a
    thread, and a `PendingCheckpoint` is returned, to `finish()` later; else the sealed checkpoint's path."""
    root = trainer.run_dir / CHECKPOINTS
    final = root / f"step-{next_step:08d}"
    partial = root / f".{final.name}.partial"
    rank = dist.get_rank()
    if trainer.topo.is_main:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    partial.mkdir(parents=True, exist_ok=True)  # each machine's own, where no disk is shared
    for stale in _written_by(partial, rank):  # from a save this process was stopped in, on an unshared disk
        stale.unlink()
    for marker in partial.glob(".process-*"):  # (markers are made only after the barrier below)
        marker.unlink(missing_ok=True)
    dist.barrier()
    writer = HuggingFaceStorageWriter(str(partial), save_distributed=True,
                                      fqn_to_index_mapping=file_of_each_tensor(
                                          trainer.model_shapes, state_keys(trainer.optimizer),
                                          moving_average=trainer.ema is not None,
                                          run_level=tuple(run_level_state(trainer.optimizer))))
    if background_group is not None:
        future = dcp.async_save(_state(trainer, next_step), storage_writer=writer, process_group=background_group)
        return PendingCheckpoint(trainer, next_step, future, partial, final, keep)
    dcp.save(_state(trainer, next_step), storage_writer=writer)
    return _seal(trainer, partial, final, next_step, keep)


def _written_by(folder: Path, rank: int) -> list[Path]:
    """The files process `rank` writes into a checkpoint: DCP names them by its place in the save's plan (shard-00001
    for process 0)."""
    return sorted(folder.glob(f"shard-{rank + 1:05d}-*.safetensors"))


def _seal(trainer, partial: Path, final: Path, next_step: int, keep: int) -> Path:
    """Every process hashes what it wrote and says so; the lowest process that sees this run folder writes the seal
    (every file of every process) and moves the checkpoint into place. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_of(f), "process": rank}
            for f in _written_by(partial, rank)}
    (partial / f".process-{rank}").touch()  # who shares this folder
    everyone: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine)  # also a barrier: every marker is in place
    leader = rank == min(int(p.name.split("-")[1]) for p in partial.glob(".process-*"))
    dist.barrier()  # every process has read the markers
    if leader:
        files = {name: info for part in everyone for name, info in sorted(part.items())}
        unknown = sorted({f.name for f in partial.glob("*.safetensors")} - set(files))
        if unknown:  # a seal must cover every file a load would read
            raise RuntimeError(f"checkpoint {partial}: files no process says it wrote ({', '.join(unknown[:3])}): "
                               "has torch.distributed.checkpoint changed how it names files? (see _written_by)")
        shapes = {name: list(shape) for name, shape in trainer.model_shapes.items()}
        record = {"next_step": next_step, "model": shapes, "files": files}
        (partial / _COMPLETE).write_text(json.dumps({**record, "seal_sha256": _seal_hash(record)}, indent=1))
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of this step from before a resume
        for marker in partial.glob(".process-*"):
            marker.unlink()
        os.replace(partial, final)
        for old in sorted(p for p in final.parent.glob("step-*") if (p / _COMPLETE).is_file())[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def remove_unfinished_saves(run_dir: Path) -> list[Path]:
    """Remove the folders of saves that never finished (`.step-N.partial`: a save stopped by a full disk, a kill or a
    crash), as a resume starts; returns them. Only under the run's lock: no save of this run is under way then."""
    unfinished = sorted((Path(run_dir) / CHECKPOINTS).glob(".step-*.partial"))
    for folder in unfinished:
        shutil.rmtree(folder, ignore_errors=True)
    return unfinished


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (interrupted saves have no complete.json)."""
    done = sorted(p for p in (Path(run_dir) / CHECKPOINTS).glob("step-*") if (p / _COMPLETE).is_file())
    return done[-1] if done else None


def verify_checkpoint(path: Path, model_shapes: dict[str, tuple[int, ...]], elsewhere_ok: bool = False) -> int:
    """The checkpoint's next step, after checking every file against its recorded size and sha256 and the model's
    parameter names and shapes against this model's. Reads no tensor; raises CheckpointError naming the problem.
    `elsewhere_ok`: files this folder lacks may be on another machine (train/machines.py fetches them)."""
    record = read_seal(path)
    for name, expected in record["files"].items():
        f = path / name
        if not f.is_file() and elsewhere_ok:
            continue
        if not f.is_file():
            writer = f" (written by process {expected['process']})" if "process" in expected else ""
            raise CheckpointError(f"checkpoint {path}: {name}{writer} is missing. If the run's machines share no "
                                  f"disk, copy every machine's {path.parent.name}/{path.name} into this one; else "
                                  "resume from an older checkpoint (delete this folder) or start a new run")
        if f.stat().st_size != expected["bytes"] or sha256_of(f) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} is damaged (size or sha256 differs from when it was "
                                  "written); resume from an older checkpoint (delete this folder) or start a new run")
    theirs = {k: tuple(v) for k, v in record["model"].items()}
    missing, extra = sorted(set(model_shapes) - set(theirs)), sorted(set(theirs) - set(model_shapes))
    wrong = sorted(k for k in set(theirs) & set(model_shapes) if theirs[k] != tuple(model_shapes[k]))
    if missing or extra or wrong:
        first = (f"{len(missing)} of this model's weights missing (first: {missing[0]})" if missing else
                 f"{len(extra)} weights this model lacks (first: {extra[0]})" if extra else
                 f"{wrong[0]} is {theirs[wrong[0]]} there, {tuple(model_shapes[wrong[0]])} here")
        raise CheckpointError(f"checkpoint {path} is of another model: {first}. Resume with the model it was "
                              "trained with, or start a new run")
    return int(record["next_step"])


def _seal_hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def read_seal(path: Path) -> dict:
    """complete.json, checked whole: its own hash covers the step, the shapes and every file's size and hash (a
    `next_step` edited by hand resumed elsewhere, silently). Seals from before the hash are read unchecked."""
    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{path / _COMPLETE} {why}; resume from another checkpoint (delete this folder) or "
                               "start a new run")

    try:
        record = json.loads((path / _COMPLETE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise refuse(f"cannot be read ({exc})") from None
    shapes = {"next_step": int, "model": dict, "files": dict}
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t) for k, t in shapes.items()):
        raise refuse("is not a diffpipe checkpoint seal (it needs next_step, model and files)")
    if any(not isinstance(v, dict) or not {"bytes", "sha256"} <= set(v) for v in record["files"].values()):
        raise refuse("lists files without their size and sha256")
    written = record.pop("seal_sha256", None)
    if written is not None and written != _seal_hash(record):
        raise refuse("was changed after it was written (its own sha256 differs)")
    return record


def load_checkpoint(trainer, path: Path) -> int:
    """Fill this process's weights, AdamW state and the run's progress from checkpoint `path` (already verified);
    returns the step to run next. Collective."""
    state = _state(trainer, 0)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    set_steps(trainer.optimizer, {p: state[f"optim.{name}.step"] for name, p in _held(trainer)})
    set_run_level_state(trainer.optimizer, state)
    bad = [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    found = torch.tensor(float(len(bad)), device=trainer.topo.device)
    dist.all_reduce(found)  # every process stops alike, whichever holds the bad tensor
    if found.item() > 0:
        where = bad[0] if bad else "a tensor another process holds"
        raise CheckpointError(f"checkpoint {path} holds NaN or inf values ({where}); resume from an older "
                              "checkpoint (delete this folder)")
    move_lr_schedule(trainer.lr_schedule, trainer.optimizer, int(state["progress.lr_schedule_steps"]))
    trainer.scaler.scale = float(state["progress.loss_scale"])
    trainer.scaler.good_steps = int(state["progress.loss_scale_good_steps"])
    return int(state["progress.next_step"])


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and not key == "config":  # model.config is one value: the architecture
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def unsafe_changes(saved: dict, new: dict) -> list[str]:
    """Keys whose values differ between the run's saved config and the one it resumes with, other than those a
    resumed run may change; each as 'key: saved -> new'."""
    before, after = _flat(saved), _flat(new)
    return [f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key) and not key.startswith(_SAFE_TO_CHANGE)]

"""When a run checkpoints, and the checkpoint written in the background: every `checkpoint.every` steps, every
`checkpoint.every_minutes` (rank 0's clock decides for every process), at a signal, and never of weights that are not
finite. What a checkpoint holds and how it is written and read: train/checkpoint.py."""
from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from ..config import RunConfig
from ..distributed import Topology
from .checkpoint import PendingCheckpoint, latest_checkpoint, load_checkpoint, save_checkpoint
from .machines import agreed_checkpoint, complete_checkpoint

__all__ = ["Checkpoints"]


class Checkpoints:
    def __init__(self, config: RunConfig, topo: Topology, run_dir: Path):
        self.settings, self.max_steps = config.checkpoint, config.train.max_steps
        self.topo, self.run_dir = topo, run_dir
        self._pending, self._background_group = None, None  # a checkpoint written in the background, its group
        self._last = time.monotonic()  # for checkpoint.every_minutes

    def overdue(self) -> bool:
        """checkpoint.every_minutes have passed since the last one (rank 0 asks; every process then takes part)."""
        minutes = self.settings.every_minutes
        return minutes > 0 and time.monotonic() - self._last >= 60 * minutes

    def due(self, step: int) -> bool:
        """A checkpoint after `step` by checkpoint.every (the last step's weights are saved anyway)."""
        every = self.settings.every
        return every > 0 and (step + 1) % every == 0 and step + 1 < self.max_steps

    def write(self, trainer, next_step: int, wait: bool = False) -> Path | None:
        """A checkpoint of `trainer` to resume from before `next_step` (every process takes part): written now (its
        path is returned), or with `checkpoint.asynchronous` (unless `wait`) started in the background and sealed by
        the next call (None)."""
        self.finish()
        if not trainer.steps.weights_finite():  # every process votes alike: the newest checkpoint stays the last finite one
            if self.topo.is_main:
                kept = latest_checkpoint(self.run_dir)
                print(f"warning: the weights before step {next_step} are not finite: no checkpoint written; the newest "
                      f"is {kept.name if kept else 'none'}", flush=True)
            return None
        background = None
        if self.settings.asynchronous and not wait:
            if self._background_group is None:  # created once, by every process alike
                self._background_group = dist.new_group(backend="gloo")
            background = self._background_group
        done = save_checkpoint(trainer, next_step, self.settings.keep, background)
        self._last = time.monotonic()
        if isinstance(done, PendingCheckpoint):
            self._pending = done
            return None
        if self.topo.is_main:
            print(f"checkpoint {done}", flush=True)
        return done

    def finish(self) -> None:
        """Seal the checkpoint being written in the background, if any (waits for its writes)."""
        if self._pending is not None:
            path, self._pending = self._pending.finish(), None
            if self.topo.is_main:
                print(f"checkpoint {path}", flush=True)

    def resume(self, trainer) -> int:
        """Weights, optimizer state and progress of `trainer` from the run folder's newest checkpoint; the step to
        run next."""
        path = agreed_checkpoint(self.run_dir)  # machines without a shared disk: each folder holds its own parts
        received = complete_checkpoint(path)
        if received and self.topo.is_main:
            print(f"resuming: received {received / 2**20:.1f} MiB of {path.name} from the other machines", flush=True)
        return load_checkpoint(trainer, path)

"""The entry point of each training process (spawned by `diffpipe train`, or started by torchrun): its process group,
its trainer, and the signals that ask every process to checkpoint and stop.

    diffpipe train examples/digits.toml      # the launcher (cli.py, distributed.py) starts train_worker per process
"""
from __future__ import annotations

import faulthandler
import signal
from pathlib import Path

from ..distributed import end_process_group, init_topology
from .trainer import Trainer

__all__ = ["train_worker"]


def train_worker(config_data: dict, run_dir: str, resume: bool = False) -> None:
    """Entry point of each process (spawned or under torchrun)."""
    from ..config_files import build_config
    from transformers.utils import logging as transformers_logging

    from ..distributed import resolve_device_kind

    transformers_logging.disable_progress_bar()  # the text encoder's save would print a bar per file
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run: `kill -USR1 PID` prints where each thread is

    config = build_config(config_data)
    topo = init_topology(config.pipeline.stages, config.pipeline.data_parallel,
                         resolve_device_kind(config.train.device), config.train.collective_timeout_minutes,
                         sp_size=config.pipeline.sequence_parallel)
    _train(Trainer(config, topo, Path(run_dir)), resume)
    end_process_group()  # only after success: distributed.end_process_group says why


def _train(trainer: Trainer, resume: bool) -> None:
    """Train, a signal (SIGTERM, or Ctrl-C, which reaches every process) asking every process to checkpoint and
    stop. The handlers are put back before returning: one left installed would keep the trainer, with the pipeline's
    pending communication objects, alive until the interpreter's exit, after the process group is destroyed, where
    freeing them aborted the process now and then ("terminate called without an active exception": 2 runs in 10)."""
    def ask_to_stop(signum, frame) -> None:
        trainer.stop_requested = True

    previous = {sig: signal.signal(sig, ask_to_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        trainer.fit(trainer.resume() if resume else 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""Shared test helpers: running a function on several real processes (gloo on CPU)."""
from __future__ import annotations

from typing import Callable

from diffpipe.distributed import launch


def run_workers(fn: Callable, args: tuple, world_size: int) -> None:
    """fn(*args) on `world_size` processes started as `diffpipe train` starts them, each with RANK/WORLD_SIZE set as torchrun would."""
    launch(fn, args, world_size)

"""Every seed diffpipe derives from train.seed, in one place. Each process computes the same ones, so every layout
(stages, replicas) draws the same weights, data order and noise.
"""
from __future__ import annotations

import hashlib

__all__ = ["named", "of_epoch", "of_step"]


def named(seed: int, name: str) -> int:
    """The seed of something named (a module's initial weights, a LoRA layer's A matrix): the name hashed with the
    run's seed, so it does not depend on what else is built."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def of_epoch(seed: int, epoch: int) -> int:
    """The seed of an epoch's data order (its shuffles)."""
    return seed * 7919 + epoch


def of_step(seed: int, step: int) -> int:
    """The seed of a step's noise, timesteps and caption dropout (and of the eval's fixed batch number `step`)."""
    return seed * 1_000_003 + step

"""The bytes of tensors alive at each moment while a unit runs on the meta device, and their peak: what a unit needs
beyond what it keeps for backward (its working memory: a Wan 14B block at 32,760 tokens holds ~3 GiB of
intermediates at once in its forward, measured on an H200, that it frees before it returns).

Each storage an op makes is counted from when the op returns it until torch frees it (a weak reference to the
storage says when); weights and inputs made before are not counted.
"""
from __future__ import annotations

import weakref

import torch

from ..torch_support import dispatch_mode_class, kept_storage_key

__all__ = ["LiveBytes", "tensors_in"]


class LiveBytes(dispatch_mode_class()):
    """Inside it, `live` is the bytes of the storages made inside it and still alive, `peak` the most there were
    (reset it with `restart`) less what `held_apart()` says is held for other reasons at that moment (a trained
    weight's gradient, which the planner counts with the weights)."""

    def __init__(self, held_apart=lambda: 0) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.held_apart = held_apart
        self._counted: set[int] = set()

    def restart(self) -> None:
        """Peak from now on."""
        self.peak = self.live

    def _freed(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = None
        for tensor in tensors_in((out,)):
            storage = tensor.untyped_storage()
            key = kept_storage_key(tensor)
            if key in self._counted:  # counted already, or a view of what was
                continue
            if given is None:
                given = {kept_storage_key(t) for t in tensors_in((*args, *kwargs.values()))}
            if key in given:  # an op writing in place, or returning its input
                continue
            nbytes = storage.nbytes()
            self._counted.add(key)
            self.live += nbytes
            weakref.finalize(storage, self._freed, key, nbytes)
        if self.live > self.peak:  # (what is held apart is never negative: no peak to check otherwise)
            self.peak = max(self.peak, self.live - self.held_apart())
        return out


def tensors_in(values):
    """The tensors among `values` and the lists and tuples in them, one level deep (as aten ops take and return
    them)."""
    for value in values:
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(item, torch.Tensor):
                yield item

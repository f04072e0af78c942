"""How weights are stored and computed: the dtype of frozen weights (memory.base_dtype) and the bytes each takes.

Under bf16 or fp16 autocast every matrix product and convolution rounds its weight to the autocast dtype anyway, so
a frozen weight stored in bf16 computes what the fp32 one computed through those ops (norms and other fp32 ops see
the bf16-rounded value), at half the memory: for Flux.1-dev's 11.9 B base, 22 GiB less. Trained weights stay fp32
(the optimizer updates them in small steps that bf16 would round away).
"""
from __future__ import annotations

import torch

from .config import RunConfig

__all__ = ["frozen_weight_dtype", "element_bytes", "stored_name"]

_STORED = {"fp32": torch.float32, "bf16": torch.bfloat16}


def frozen_weight_dtype(config: RunConfig, device_kind: str) -> torch.dtype:
    """memory.base_dtype, with "auto" resolved: bf16 for LoRA runs on CUDA under bf16/fp16 autocast, else fp32
    (a CPU's bf16 matrix products are slow, and fp32 compute cannot use bf16 weights)."""
    choice = config.memory.base_dtype
    if choice == "auto":
        lora = config.adapter.type == "lora"
        choice = "bf16" if lora and device_kind == "cuda" and config.train.precision != "fp32" else "fp32"
    return _STORED[choice]


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stored_name(dtype: torch.dtype) -> str:
    """The config's name of a storage dtype ("bf16"), as memory.base_dtype spells it."""
    return next(name for name, stored in _STORED.items() if stored == dtype)

"""How weights are stored and computed: how frozen weights are held (memory.base_dtype) and the bytes each takes.

Under bf16 or fp16 autocast every matrix product and convolution rounds its weight to the autocast dtype anyway, so
a frozen weight stored in bf16 computes what the fp32 one computed through those ops (norms and other fp32 ops see
the bf16-rounded value), at half the memory: for Flux.1-dev's 11.9 B base, 22 GiB less. fp8 and int8 store the
frozen linear layers' weights in a quarter of fp32, nf4 in about an eighth (models/storage.py, models/quantised.py),
which changes the model: slightly (fp8, int8), or more (nf4). Trained weights stay fp32
(the optimizer updates them in small steps that bf16 would round away).
"""
from __future__ import annotations

import torch

from ..config import RunConfig, fp8_compute_problem
from ..models.storage import FP8_PRODUCT_SPEEDUP, LINEAR_FORMATS, FrozenStorage, element_bytes
from ..torch_support import fp8_matmul_problem

__all__ = ["AUTOCAST_DTYPES", "frozen_storage", "element_bytes", "moment_bytes", "fp8_compute_on"]

# train.precision -> the dtype autocast computes in (None: fp32, no autocast)
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def frozen_storage(config: RunConfig, device_kind: str) -> FrozenStorage:
    """memory.base_dtype, with "auto" resolved: fp8 with train.fp8_compute, bf16 for LoRA runs on CUDA under
    bf16/fp16 autocast, else fp32
    (a CPU's bf16 matrix products are slow, and fp32 compute cannot use bf16 weights). fp8 keeps the rest of the
    base in bf16 under autocast, in fp32 under fp32 compute, as int8 and nf4 do."""
    choice = config.memory.base_dtype
    autocast = config.train.precision != "fp32"
    fp8_compute = fp8_compute_on(config, device_kind) and config.adapter.type != "none"  # a full fine-tune's: torchao
    if choice == "auto":
        lora = config.adapter.type != "none"
        choice = "fp8" if fp8_compute else "bf16" if lora and device_kind == "cuda" and autocast else "fp32"
    if choice in LINEAR_FORMATS:
        speedup = FP8_PRODUCT_SPEEDUP["compiled" if config.pipeline.compile else "eager"] if fp8_compute else 1.0
        return FrozenStorage(torch.bfloat16 if autocast else torch.float32, linear=choice, fp8_compute=fp8_compute,
                             fp8_speedup=speedup)
    return FrozenStorage({"fp32": torch.float32, "bf16": torch.bfloat16}[choice])


def fp8_compute_on(config: RunConfig, device_kind: str) -> bool:
    """train.fp8_compute, "auto" resolved: on where blocks are compiled (pipeline.compile "blocks" or true: the
    planner counts the products FP8_PRODUCT_SPEEDUP faster there, and an fp8 base never holds more than a bf16 one,
    so the plan is faster and fits wherever the bf16 one does), for a run that may take it (`fp8_compute_problem`,
    replicas not sharded, a LoRA-type run: the planner does not count a full fine-tune's fp8 products yet) on a GPU
    with fp8 tensor cores (this machine's first; a plan made with no GPU here assumes one); off eager (counted no
    faster) and everywhere else: "auto" never refuses."""
    value, p = config.train.fp8_compute, config.pipeline
    if value != "auto":
        return value
    if not p.compile or device_kind != "cuda" or config.adapter.type == "none" or fp8_compute_problem(config) or (
            p.data_parallel_shard and p.data_parallel > 1):
        return False
    return not torch.cuda.is_available() or fp8_matmul_problem(torch.device("cuda", 0), try_product=False) is None


def optimizer_state_bytes(train, optimizer_state: str) -> tuple[float, bool]:
    """What `train.optimizer` keeps per trained parameter, as (bytes held for every parameter, whether it also keeps
    Adafactor's factored second moment: 4 bytes per row and per column of each matrix, per element of a vector:
    UnitCost.factored_state_params). AdamW: its two moments (`moment_bytes`); Prodigy: its moments, s and the
    starting weights, 16 bytes; Adafactor: a first moment only with optimizer_args.beta1."""
    if train.optimizer == "prodigy":
        return 16.0, False
    if train.optimizer == "adafactor":
        return (4.0 if train.optimizer_args.get("beta1") is not None else 0.0), True
    return moment_bytes(optimizer_state), False


def moment_bytes(optimizer_state: str) -> float:
    """AdamW's two moments per trained parameter as memory.optimizer_state holds them: fp32, or 8 bits each with
    an fp32 scale per block of 256 (parameters under 4096 elements, which keep fp32 moments, are not told apart)."""
    return 8.0 if optimizer_state == "fp32" else 2 * (1 + 4 / 256)

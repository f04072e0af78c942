"""diffpipe: pipeline-parallel training of diffusion models on torch.distributed.pipelining.

For a loop of your own: `from diffpipe import describe, plan_split, stage_modules, family_of, feed_of` (api.py);
imported on first use, so `diffpipe --help` does not import torch.
"""

import logging

__version__ = "0.1.0"

# peft imports bitsandbytes where it is installed, whose CPU backend then warns on every import (in every process)
# that an optional 4-bit kernel package is missing; diffpipe uses none of its 4-bit kernels
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# diffusers imports torchao where it is installed (diffpipe's fp8 training of full fine-tunes), which then logs on
# every import that its C++ kernels failed to load where its wheel was built for another torch (a CPU build, 2.11,
# 2.13), diffusers that torchao's serialised tensor types are missing, and torch that torchao registers an enum the
# old way; diffpipe uses none of those (models/fp8_training.py needs torchao's Python float8 training only)
for _name in ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
del _name

_API = ("family_of", "describe", "feed_of", "plan_split", "stage_modules", "stage_specs")
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'diffpipe' has no attribute {name!r}")

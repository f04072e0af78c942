"""A backbone's weights as diffusers writes them: one .safetensors file, or shards named by an index file
(`diffusion_pytorch_model.safetensors.index.json`, whose "weight_map" gives each weight's shard: how every released
FLUX.1, Qwen-Image and Wan 14B transformer folder holds its weights). Read one tensor at a time by name, the whole
never loaded: `with open_weights(path) as reader: reader.get_tensor(name)`.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

__all__ = ["INDEX_SUFFIX", "shard_files", "open_weights", "weight_shapes"]

INDEX_SUFFIX = ".safetensors.index.json"


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a shard index (a JSON object with a weight_map: {exc}); copy it again "
                              "from the model's release") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: its weight_map is not a mapping of weight names to shard files")
    return weight_map


def shard_files(path: Path) -> list[Path]:
    """The .safetensors files of `path`: itself, or the shards its index names (each checked to exist)."""
    if not path.name.endswith(INDEX_SUFFIX):
        return [path]
    shards = [path.parent / name for name in sorted(set(_weight_map(path).values()))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{path} names {len(shards)} shard(s) and {len(missing)} are missing ({', '.join(missing[:3])}); "
                              "copy every shard of the model's release beside it")
    return shards


class _Reader:
    """Every shard open at once: `keys()` and `get_tensor(name)`, as safetensors' own reader of one file."""

    def __init__(self, handles: list):
        self._of = {key: handle for handle in handles for key in handle.keys()}

    def keys(self):
        return self._of.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._of[name].get_tensor(name)


@contextlib.contextmanager
def open_weights(path: Path):
    """A reader of the weights in `path` (a .safetensors file or a shard index)."""
    with contextlib.ExitStack() as stack:
        handles = []
        for shard in shard_files(path):
            try:
                handles.append(stack.enter_context(safe_open(str(shard), framework="pt")))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{shard} is not a readable .safetensors file ({exc}); re-export or re-download "
                                      "it") from None
        yield _Reader(handles)


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, from the files' headers alone."""
    shapes = {}
    for shard in shard_files(path):
        try:
            with safe_open(str(shard), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{shard} is not a readable .safetensors file ({exc}); re-export or re-download "
                                  "it") from None
    return shapes

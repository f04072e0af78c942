"""Files diffpipe writes for the user: whole or not at all, and readable as the user's umask says.

safetensors' `save_file` creates its files with mode 0600 whatever the umask (a run's weights and exports could not
be read by the user's group or a server's other account); `save_tensors` writes beside the target and renames it
in place once whole, with the mode a plain `open` would have given.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["save_tensors", "give_user_mode"]


def _umask() -> int:
    """The process's umask, read without changing it (os.umask can only be read by setting it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def give_user_mode(path: Path) -> None:
    """The mode a new file, or a folder and everything in it, would have under the user's umask."""
    path = Path(path)
    umask = _umask()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~umask)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file at `path`, written whole before it replaces anything there."""
    path = Path(path)
    partial = path.with_name(path.name + ".part")
    save_file(tensors, str(partial), metadata=metadata)
    give_user_mode(partial)
    os.replace(partial, path)
    return path

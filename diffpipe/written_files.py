"""Files diffpipe writes for the user: whole or not at all, readable as the user's umask says, and never over what
diffpipe did not write (`check_target`: the rule every writer shares with the run folder's `--overwrite`).

safetensors' `save_file` creates its files with mode 0600 whatever the umask (a run's weights and exports could not
be read by the user's group or a server's other account); `save_tensors` writes beside the target and renames it
in place once whole, with the mode a plain `open` would have given.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CommandError

__all__ = ["cache_home", "save_tensors", "give_user_mode", "check_target", "is_image", "mark_export", "written_by_export", "RUN_MARK",
           "EXPORT_MARK", "EXPORT_KEY"]



def cache_home() -> Path:
    """Where diffpipe keeps what it can make again (converted single files, data caches): $XDG_CACHE_HOME/diffpipe,
    else ~/.cache/diffpipe, as Hugging Face's libraries keep theirs; never inside a user's own folders."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffpipe"

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


# The marks by which diffpipe knows what it wrote, and so what it may replace: a run folder (run_folder.py), a folder
# an export wrote, and a .safetensors file an export wrote (this key in its header's metadata).
RUN_MARK = ".diffpipe-run"
EXPORT_MARK = ".diffpipe-export"
EXPORT_KEY = "diffpipe.export"


def mark_export(folder: Path, fmt: str) -> None:
    """Mark `folder` as written by `diffpipe export --format fmt`: a later --force may replace it."""
    (Path(folder) / EXPORT_MARK).write_text(json.dumps({"made_by": "diffpipe export", "format": fmt}))


def written_by_export(path: Path) -> bool:
    """Whether an earlier `diffpipe export` wrote `path`: a folder with its mark, or a .safetensors file whose header
    names it."""
    path = Path(path)
    if path.is_dir():
        return (path / EXPORT_MARK).is_file()
    try:
        with safe_open(str(path), framework="pt") as f:
            return EXPORT_KEY in (f.metadata() or {})
    except Exception:  # not a safetensors file (safetensors raises its own error types for a bad header)
        return False


def is_image(path: Path) -> bool:
    """Whether `path` is a picture (what `sample --force` and the plots' --force may replace)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            return True
    except (UnidentifiedImageError, OSError):
        return False


def check_target(out: Path, force: bool, replaceable: Callable[[Path], bool], what_replaces: str,
                 protected: Iterable[tuple[str, Path]] = ()) -> None:
    """The one rule for what a writer (`export --out`, `sample --out`) may write over, checked before any work:
    never a run folder's own files or anything in or around a `protected` path ((what it is, path) pairs: the run
    read from, its base model); an existing target only with `force`, and then only one that `replaceable` accepts
    (what diffpipe wrote, or for a picture any picture: `what_replaces` names it in the refusal). An empty folder is
    no loss."""
    out = Path(out)
    target = out.resolve()
    run = next((folder for folder in [target, *target.parents] if (folder / RUN_MARK).is_file()), None)
    if run is not None:
        raise CommandError(f"--out {out} is in the run folder {run}, whose files only its run writes; write it "
                           "somewhere else")
    for what, path in protected:
        path = Path(path).resolve()
        if target == path or path in target.parents or target in path.parents:
            raise CommandError(f"--out {out} is in or around {what} {path}; write it somewhere else")
    if not out.exists() and not out.is_symlink() or out.is_dir() and not any(out.iterdir()):
        return
    if not force:
        raise CommandError(f"--out {out} already exists; choose another path, or add --force to replace it")
    if not replaceable(out):
        held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        more = f" and {len(held) - 5} more" if len(held) > 5 else ""
        shown = f" (it holds {', '.join(held[:5])}{more})" if held else ""
        raise CommandError(f"--out {out} exists{shown}, and --force replaces only {what_replaces}: it is left as it "
                           "is; choose another --out, or move it yourself")

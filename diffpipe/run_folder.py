"""A run folder: the mark that says diffpipe made it, what diffpipe writes into it, and the lock a run holds on it.

`--overwrite` deletes only what diffpipe wrote, and only in a folder it marked: a user's project folder that
happens to hold a `config.toml` is refused, naming what it holds. A run that stopped before its first step (a
config error in a worker, Ctrl-C while building) left nothing worth keeping: the same command starts it again.
The lock (an flock on `.diffpipe-lock`, held by the process that prepared the run until it exits) refuses a second
run or resume of the same folder, naming the first one's pid.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from .errors import RunFolderError
from .written_files import RUN_MARK

__all__ = ["RunFolderError", "RunLock", "MARK", "WRITTEN", "prepare_new_run", "is_marked",
           "has_started"]

MARK = RUN_MARK
_LOCK = ".diffpipe-lock"
# everything diffpipe writes into a run folder (trainer, observer, evaluation, checkpoints, the end of `train`)
WRITTEN = frozenset({MARK, _LOCK, "config.toml", "metrics.jsonl", "stage_times.jsonl", "timeline.json",
                     "timeline.png", "loss.png", "samples.png", "samples", "tensorboard", "checkpoints",
                     "model.safetensors", "lora.safetensors", "model_config.json", "text_encoder", "exports",
                     "report.png"})


class RunLock:
    """An exclusive flock on the run folder, held while this object lives (or until `release`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / _LOCK
        self._file = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise RunFolderError(f"{run_dir} is in use by diffpipe process {holder}; wait for it to end or stop it "
                                 "(kill PID), or choose another folder with --output-dir") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def is_marked(run_dir: Path) -> bool:
    return (run_dir / MARK).is_file()


def has_started(run_dir: Path) -> bool:
    """Whether a marked run got as far as a step: a metrics line, a checkpoint or weights."""
    metrics = run_dir / "metrics.jsonl"
    checkpoints = run_dir / "checkpoints"
    return ((metrics.is_file() and metrics.stat().st_size > 0) or (run_dir / "model.safetensors").exists()
            or (checkpoints.is_dir() and any(checkpoints.iterdir())))


def prepare_new_run(run_dir: Path, overwrite: bool) -> RunLock:
    """An empty, marked and locked folder for a new run. A marked run that never reached a step is started again;
    a finished one is replaced with `overwrite` (what diffpipe wrote, nothing else); anything else is refused."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"{run_dir} is a file, not a folder; choose a run folder with --output-dir")
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if entries:
        _check_replaceable(run_dir, entries, overwrite)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
    except OSError as exc:
        raise RunFolderError(f"cannot write the run folder {run_dir} ({exc.strerror}); choose another with "
                             "--output-dir") from None
    try:
        for name in entries:
            if name != _LOCK:
                _remove(run_dir / name)
        (run_dir / MARK).write_text(json.dumps({"made_by": "diffpipe", "pid": os.getpid(), "time": time.time()}))
    except BaseException:
        lock.release()
        raise
    return lock


def _check_replaceable(run_dir: Path, entries: list[str], overwrite: bool) -> None:
    if not is_marked(run_dir):
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise RunFolderError(f"{run_dir} is not empty and diffpipe did not make it (it holds {shown}; no {MARK}); "
                             "it is left as it is: choose another folder with --output-dir"
                             + ("" if overwrite else f", or continue a run there with --resume {run_dir}"))
    strangers = [name for name in entries if name not in WRITTEN]
    if strangers:
        raise RunFolderError(f"{run_dir} is a run folder but also holds {', '.join(strangers)}, which diffpipe did "
                             "not write; it is left as it is: move those elsewhere, or choose another --output-dir")
    if has_started(run_dir) and not overwrite:
        raise RunFolderError(f"{run_dir} already holds a run; choose another folder with --output-dir, add "
                             f"--overwrite to replace it, or continue it with --resume {run_dir}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()

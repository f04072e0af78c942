"""Stopping a run from outside loses nothing and leaves nothing running: Ctrl-C or SIGTERM to the launcher alone
checkpoints the step every process is at and exits non-zero with the resume command; a training process killed
with SIGKILL brings the launcher and every other process down within seconds, with one line saying which."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "digits.toml"
LONG = ["--set", "train.max_steps=5000", "--set", "train.batch_size=16", "--set", "observe.log_every=0",
        "--set", "checkpoint.every=0", "--set", "output.sample_every_end=false"]


def _as_from_a_terminal() -> None:
    """Ctrl-C's default action in the launcher: a suite started as a background job of a non-interactive shell
    (`pytest ... &`) passes on SIGINT ignored, and the launcher would never see it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def start():
    """Starts `diffpipe train` on the long digits run; whatever a failed test leaves running is killed after it (a
    5000-step run left behind slows every later test)."""
    started = []

    def _start(run: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "diffpipe", "train", str(EXAMPLE), "--output-dir", str(run), *LONG]
        started.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True, preexec_fn=_as_from_a_terminal))
        return started[-1]

    yield _start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_steps(run: Path, proc: subprocess.Popen, steps: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.5)
    pytest.fail(f"fewer than {steps} steps in {timeout_s} s")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _workers(launcher: int) -> list[int]:
    """The launcher's training processes: its own children where it spawns them (a machine with a GPU), the
    children of its fork server where it forks them (without): those carrying the server's own command line (forked,
    not exec'd: a helper the server runs while importing, seen once with an empty one 5 s before the training
    processes, would have the test stop the launcher in its checks instead); not multiprocessing's resource tracker."""
    def command(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone since it was listed
            return ""

    children = [c for c in _children(launcher) if "resource_tracker" not in command(c)]
    servers = [c for c in children if "forkserver" in command(c)]
    forked = [w for server in servers for w in _children(server) if command(w) == command(server)]
    return [c for c in children if c not in servers] + forked


def _group_gone(pgid: int, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    os.killpg(pgid, signal.SIGKILL)
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_to_the_launcher_checkpoints_and_stops_every_process(tmp_path, start, sig):
    run = tmp_path / "run"
    proc = start(run)
    _wait_for_steps(run, proc, 3)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    os.kill(proc.pid, sig)  # the launcher alone, not its process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    assert "interrupted after step" in err and f"--resume {run}" in err
    assert _group_gone(proc.pid)
    checkpoints = [p for p in (run / "checkpoints").glob("step-*") if (p / "complete.json").is_file()]
    assert len(checkpoints) == 1  # checkpoint.every = 0: this one is the interruption's
    step = json.loads((checkpoints[0] / "complete.json").read_text())["next_step"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step - 1  # the checkpoint is of the last step recorded


def test_a_killed_training_process_ends_the_run_within_a_minute(tmp_path, start):
    run = tmp_path / "run"
    proc = start(run)
    _wait_for_steps(run, proc, 3)
    started = time.monotonic()
    os.kill(_workers(proc.pid)[-1], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - started < 60
    assert proc.returncode == 1
    assert "a training process failed" in err and "SIGKILL" in err
    assert "Traceback" not in err
    assert _group_gone(proc.pid)


def test_ctrl_c_while_the_processes_build_the_model_stops_them_with_one_line(tmp_path, start):
    proc = start(tmp_path / "run")
    for line in proc.stdout:  # printed just before the training processes start, which then build for seconds
        if line.startswith("training "):
            break
    deadline = time.monotonic() + 60
    while not (launched := _workers(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step yet: they are still building
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted before training began; nothing was saved" in err and "Traceback" not in err, err[-2000:]
    assert launched and not any(Path(f"/proc/{pid}").exists() for pid in launched)
    again = start(tmp_path / "run")  # "Run the same command to start again": it starts, in the same folder
    for line in again.stdout:
        if line.startswith("training "):
            break
    assert again.poll() is None, again.communicate()[1][-2000:]


def test_a_second_run_of_a_folder_in_use_is_refused_naming_the_first(tmp_path, start, capsys):
    from diffpipe.cli import main

    run = tmp_path / "run"
    proc = start(run)
    _wait_for_steps(run, proc, 1)
    assert main(["train", str(EXAMPLE), "--resume", str(run), *LONG]) == 2
    assert f"in use by diffpipe process {proc.pid}" in capsys.readouterr().err
    assert main(["train", str(EXAMPLE), "--output-dir", str(run), "--overwrite", *LONG]) == 2
    assert f"in use by diffpipe process {proc.pid}" in capsys.readouterr().err
    assert proc.poll() is None and (run / "metrics.jsonl").is_file()  # the first run goes on, untouched

"""Run folders lose nothing: --overwrite deletes only what diffpipe wrote into a folder it marked, a run that never
reached a step is started again by the same command, and a second process cannot take a folder in use."""
from __future__ import annotations

import pytest

from diffpipe.run_folder import MARK, RunFolderError, prepare_new_run


def _finished_run(path):
    lock = prepare_new_run(path, overwrite=False)
    lock.release()
    (path / "config.toml").write_text("")
    (path / "metrics.jsonl").write_text('{"step": 0}\n')
    (path / "checkpoints" / "step-00000001").mkdir(parents=True)
    (path / "model.safetensors").write_text("old weights")
    return path


def test_overwrite_refuses_a_project_folder_that_holds_a_config_toml(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("precious")
    (project / "config.toml").write_text("[tool]\n")
    with pytest.raises(RunFolderError, match=r"diffpipe did not make it \(it holds config.toml, src;"):
        prepare_new_run(project, overwrite=True)
    assert (project / "src" / "main.py").read_text() == "precious" and (project / "config.toml").is_file()


def test_overwrite_replaces_a_finished_run_and_nothing_else(tmp_path):
    run = _finished_run(tmp_path / "run")
    with pytest.raises(RunFolderError, match="already holds a run"):
        prepare_new_run(run, overwrite=False)
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match="also holds notes.txt, which diffpipe did not write"):
        prepare_new_run(run, overwrite=True)
    assert (run / "model.safetensors").read_text() == "old weights"
    (run / "notes.txt").unlink()
    lock = prepare_new_run(run, overwrite=True)
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == sorted([MARK, ".diffpipe-lock"])


def test_a_run_that_never_reached_a_step_is_started_again_without_overwrite(tmp_path):
    run = tmp_path / "run"
    prepare_new_run(run, overwrite=False).release()
    (run / "config.toml").write_text("")  # written before the processes started; they failed before step 0
    (run / "tensorboard").mkdir()
    prepare_new_run(run, overwrite=False).release()
    assert not (run / "config.toml").exists()


def test_a_folder_in_use_is_refused_naming_the_process(tmp_path):
    import os

    run = tmp_path / "run"
    held = prepare_new_run(run, overwrite=False)
    with pytest.raises(RunFolderError, match=f"in use by diffpipe process {os.getpid()} "):
        prepare_new_run(run, overwrite=True)
    held.release()
    prepare_new_run(run, overwrite=True).release()

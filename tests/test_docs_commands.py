"""The commands README.md, docs/*.md and the examples' headers give a user work as written (issues 55, 56): every
fenced `diffpipe ...` line (and every `#   diffpipe ...` line of an example's header) parses with the CLI's own
parser and, where it names an example config, that config loads with its --set values;
the README's `train` lines run two steps each on the tiny folders and its `plan` lines run whole. Lines that use a
shell variable (docs/benchmarks.md's `$S`, set a line before) are left out; `RUN` and `CONFIG` stand for the user's
run folder and config and are parsed as given."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from diffpipe.cli import _parser
from diffpipe.config_files import load_config

from .helpers import run_command

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_commands(page: Path) -> list[str]:
    """The `diffpipe ...` (or `python -m diffpipe ...`) lines of the page's fenced code blocks, continuation lines
    joined and any comment after the command dropped."""
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("python -m ")
            if line.startswith("diffpipe ") and "$" not in line:
                commands.append(shlex.join(shlex.split(line, comments=True)))
    return commands


def header_commands(example: Path) -> list[str]:
    """The command lines of an example's header (`#   diffpipe ...`), without a comment or a remark in brackets
    after the command."""
    commands = []
    for line in example.read_text().splitlines():
        words = line.removeprefix("#").strip().split(" (")[0]
        if line.startswith("#  ") and words.startswith("diffpipe ") and "$" not in words:
            commands.append(shlex.join(shlex.split(words, comments=True)))
    return commands


def _all_commands() -> list[tuple[str, str]]:
    return ([(page.name, command) for page in DOCS for command in fenced_commands(page)]
            + [(example.name, command) for example in sorted((ROOT / "examples").glob("*.toml"))
               for command in header_commands(example)])


def test_the_pages_have_commands_to_check():
    assert len(fenced_commands(ROOT / "README.md")) >= 8  # a change to how pages write commands would test nothing
    assert len(_all_commands()) >= 40
    assert len([c for page, c in _all_commands() if page.endswith(".toml")]) >= 40  # the examples' headers


@pytest.mark.parametrize("page,command", _all_commands())
def test_a_documented_command_parses_and_its_config_loads(page, command, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pages name examples/... from the project's root
    args = _parser().parse_args(shlex.split(command)[1:])
    config = getattr(args, "config", None)
    if config and config.startswith("examples/"):
        assert Path(config).is_file(), f"{page}: {command}: no {config}"
        load_config(config, args.set or [])


def _readme(verb: str) -> list[str]:
    return [c for c in fenced_commands(ROOT / "README.md") if c.startswith(f"diffpipe {verb} examples/")]


@pytest.mark.parametrize("command", _readme("train"))
def test_a_readme_train_line_trains(command, tmp_path, monkeypatch):
    """Two steps of each, without samples: the whole main job and photos job run in their own tests."""
    monkeypatch.chdir(ROOT)
    args = shlex.split(command)[1:]
    ran = run_command([*args, "--output-dir", str(tmp_path / "run"), "--set", "train.max_steps=2",
                       "--set", "sample.every=0", "--set", "output.sample_every_end=false"])
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("command", _readme("plan"))
def test_a_readme_plan_line_plans(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    ran = run_command(shlex.split(command)[1:])
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "stage" in ran.stdout

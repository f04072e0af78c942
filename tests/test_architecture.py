"""The rooms of docs/architecture.md, held to the code: no module imports from a room above its own (at module level
or inside a function), except the exceptions the document argues, each of which must still exist; no two rooms
import from each other."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "diffpipe"

# bottom to top, as docs/architecture.md draws them; a room may import from its own level and below
ROOMS = [
    {"distributed", "torch_support", "written_files", "errors"},
    {"config", "seeds", "diffusion"},
    {"models", "data", "precision"},
    {"pipeline"},
    {"build", "observe", "config_files"},
    {"planner"},
    {"preflight", "sampling", "grids"},
    {"train", "export", "run_folder", "config_reference"},
    {"commands", "cli", "api", "__main__", "__init__"},
]
LEVEL = {room: level for level, rooms in enumerate(ROOMS) for room in rooms}

# (importing room, imported room): why, in docs/architecture.md's last section
ARGUED = {
    ("config", "data"),      # data/sources.py's SOURCES: the registry that gives data.dataset its names
    ("config", "pipeline"),  # pipeline/schedules.py's SCHEDULES: the names of pipeline.schedule
    ("config", "models"),    # the registry's family names (model.architecture's help)
}


def _room_imports() -> dict[tuple[str, str], set[str]]:
    """(importing room, imported room) -> the files where, for every relative import in the package."""
    found: dict[tuple[str, str], set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            package = list(parts[:-1])[:len(parts) - node.level]
            target = package + (node.module.split(".") if node.module else [node.names[0].name])
            if target[0] != parts[0]:
                found.setdefault((parts[0], target[0]), set()).add(str(path.relative_to(PACKAGE)))
    return found


def test_no_two_rooms_import_from_each_other():
    edges = set(_room_imports()) - ARGUED  # the registries' names: config imports them, they import its sections
    both_ways = sorted({tuple(sorted(edge)) for edge in edges if edge[::-1] in edges})
    assert not both_ways, f"rooms that import from each other: {both_ways}"


def test_every_room_is_drawn():
    rooms = {p.relative_to(PACKAGE).with_suffix("").parts[0] for p in PACKAGE.rglob("*.py")}
    assert rooms <= set(LEVEL), f"rooms not in docs/architecture.md's drawing: {sorted(rooms - set(LEVEL))}"


def test_no_room_imports_from_a_room_above_it():
    upward = {edge: files for edge, files in _room_imports().items() if LEVEL[edge[0]] < LEVEL[edge[1]]}
    unargued = {f"{a} -> {b}": sorted(files) for (a, b), files in upward.items() if (a, b) not in ARGUED}
    assert not unargued, f"imports from a room above: {unargued}"
    assert ARGUED <= set(upward), f"argued exceptions that no longer exist (drop them): {ARGUED - set(upward)}"

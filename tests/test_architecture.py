"""The rooms of docs/architecture.md, held to the code: no module imports from a room above its own (at module level
or inside a function), except the exceptions the document argues, each of which must still exist; no two rooms
import from each other; no two modules import each other, through any chain (counting imports inside functions and
those for type annotations only); each model family's package reads the model room's shared modules and its own,
never another family's; no module takes another's private (underscored) names."""
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

# (importing room, imported room): why, in docs/architecture.md's last section (none now: the registries' names reach
# the config through config_files' build step, REGISTRY_KEYS)
ARGUED: set[tuple[str, str]] = set()
FAMILIES = PACKAGE / "models" / "families"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every relative import in `path`, anywhere in the file; the module
    as a dotted name within the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            names = [a.name for a in node.names]
            if node.module:
                found.append((".".join(base + node.module.split(".")), names))
            else:  # `from . import x`: x a module of the package
                found += [(".".join(base + [name]), []) for name in names]
    return found


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package's __init__ stands for the package)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _imports(path):
            # `from .pkg import mod` takes a module; `from .mod import name` a name of a module
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                    targets.add(target)
        graph[name] = targets
    return graph


def test_no_module_imports_itself_through_others():
    graph = _module_graph()
    circles = []
    for start in sorted(graph):
        path, seen = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:  # depth-first from each module: a path back to it is a circle
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                path.pop()
            elif step == start:
                circles.append(" -> ".join(path + [start]))
                break
            elif step not in seen:
                seen.add(step)
                path.append(step)
                stack.append(iter(sorted(graph[step])))
    assert not circles, "modules that import themselves through others:\n" + "\n".join(circles)


def test_a_family_reads_the_shared_model_room_and_its_own_package_only():
    graph = _module_graph()
    crossing = {}
    for module, targets in graph.items():
        if module.startswith("models.families.") and module.count(".") >= 3:
            own = ".".join(module.split(".")[:3])
            crossing[module] = sorted(t for t in targets if t.startswith("models.families.") and
                                      t != own and not t.startswith(own + "."))
    assert crossing and not any(crossing.values()), {m: t for m, t in crossing.items() if t}
    shared = {m: sorted(t for t in targets if t.startswith("models.families."))
              for m, targets in graph.items() if m.startswith("models.") and not m.startswith("models.families")}
    assert not any(shared.values()), f"shared model modules that read a family: {shared}"


def test_no_module_takes_another_modules_private_names():
    taken = [f"{path.relative_to(PACKAGE)}: {module} {name}" for path in PACKAGE.rglob("*.py")
             for module, names in _imports(path) for name in names if name.startswith("_")]
    assert not taken, taken


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

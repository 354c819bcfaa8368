"""The package's floors import only downward: every import inside unicoll (function-level ones
included) goes to the same floor or one below, and no modules import each other in a circle.

:data:`FLOORS` is the one place the order is written; docs/architecture.md shows it, and
:func:`test_the_architecture_page_shows_the_floors` holds the page to it. A new module must be
placed on a floor before this test passes."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundations",
        ("unicoll.errors", "unicoll.arrays", "unicoll.session", "unicoll.group", "unicoll.forking",
         "unicoll.cache", "unicoll.memory", "unicoll.workspace", "unicoll.counts", "unicoll.reference",
         "unicoll.libraries", "unicoll.libraries.*", "unicoll.checksums", "unicoll.records"),
    ),
    (
        "transports",
        ("unicoll.backends.base", "unicoll.backends.blocks", "unicoll.backends.host", "unicoll.backends.layout",
         "unicoll.backends.float_keys", "unicoll.backends.once",
         "unicoll.backends.rendezvous", "unicoll.backends.stub", "unicoll.backends.wrapped", "unicoll.backends.torch",
         "unicoll.backends.torch.compat", "unicoll.backends.torch.errors", "unicoll.backends.torch.gloo_world",
         "unicoll.backends.torch.liveness",
         "unicoll.backends.torch.transport", "unicoll.backends.torch.workers", "unicoll.backends.mpi",
         "unicoll.backends.mpi.abort", "unicoll.backends.mpi.bfloat16", "unicoll.backends.mpi.inflight",
         "unicoll.backends.mpi.transport", "unicoll.backends.cupy", "unicoll.backends.cupy.packages",
         "unicoll.backends.cupy.rows", "unicoll.backends.cupy.schedule", "unicoll.backends.cupy.torch_bridge",
         "unicoll.backends.cupy.transport"),
    ),
    ("descriptions", ("unicoll.device_routing", "unicoll.routing", "unicoll.static_layout", "unicoll.once_blocks",
                      "unicoll.kinds", "unicoll.spec", "unicoll.spec.*", "unicoll.check")),
    (
        "backend factories",
        ("unicoll.backends.torch.gloo", "unicoll.backends.torch.nccl", "unicoll.backends.mpi.mpi",
         "unicoll.backends.cupy.nccl", "unicoll.registry", "unicoll.backends"),
    ),
    ("the lock", ("unicoll.entry",)),
    ("the session", ("unicoll.runtime", "unicoll.validate", "unicoll.task", "unicoll.verify")),
    ("eager", ("unicoll.eager", "unicoll.eager.*")),
    ("compile", ("unicoll.compiled", "unicoll.compiled.*")),
    ("carry", ("unicoll.carry",)),
    ("public face", ("unicoll.face",)),
    ("names and tools", ("unicoll", "unicoll.moe", "unicoll.nn", "unicoll.paddle_moe", "unicoll.__main__",
                         "unicoll.cli", "unicoll.cli.*",
                         "unicoll.launch", "unicoll.launch.*", "unicoll.testing", "unicoll.testing.*")),
)  # fmt: skip
"""The floors, bottom first, and the modules on each (``fnmatch`` patterns)."""


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (``backends/`` is ``unicoll.backends``)."""
    found = {}
    for folder, package in ((ROOT / "unicoll", "unicoll"), (ROOT / "backends", "unicoll.backends")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imported(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it (``from . import x`` counts
    as importing x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            wanted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in wanted:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


IMPORTS = {name: _imported(name, path) for name, path in MODULES.items()}


def floor_of(name: str) -> int:
    """The floor ``name`` lives on; fails unless exactly one floor's patterns match it."""
    floors = [i for i, (_, patterns) in enumerate(FLOORS) if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    assert len(floors) == 1, f"{name} is on {len(floors)} floors of FLOORS; place it on exactly one"
    return floors[0]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports_only_its_floor_and_below(name: str) -> None:
    floor = floor_of(name)
    upward = sorted(t for t in IMPORTS[name] if floor_of(t) > floor)
    assert not upward, f"{name} ({FLOORS[floor][0]}) imports from above: " + ", ".join(
        f"{t} ({FLOORS[floor_of(t)][0]})" for t in upward
    )


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Depth-first search for a back edge; the message names the circle."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "open"
        path.append(name)
        for target in sorted(IMPORTS[name]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (circle := visit(target)):
                return circle
        state[name] = "done"
        path.pop()
        return None

    for name in sorted(MODULES):
        if name not in state and (circle := visit(name)):
            pytest.fail("an import circle: " + " -> ".join(circle))


def test_the_floors_catch_what_they_are_for() -> None:
    """The test's reading of imports sees the kinds of import that made the old circle."""
    assert "unicoll.eager.ops" in IMPORTS["unicoll.face"]  # from .eager import moe, ops
    assert "unicoll.eager.autograd" in IMPORTS["unicoll.eager.ops"]  # inside a function
    assert "unicoll.compiled.traced" in IMPORTS["unicoll.face"]  # inside a function, on the first traced call
    assert floor_of("unicoll.face") > floor_of("unicoll.compiled.traced") > floor_of("unicoll.eager.ops")
    assert floor_of("unicoll.eager.ops") > floor_of("unicoll.entry")


def test_the_architecture_page_shows_the_floors() -> None:
    """docs/architecture.md lists the floors bottom first, each with its modules, as FLOORS has them."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    shown = "\n".join(
        f"{i}. {title}: " + ", ".join(f"`{p}`" for p in patterns) for i, (title, patterns) in enumerate(FLOORS)
    )
    assert shown in page, f"docs/architecture.md should show the floors as:\n{shown}"


@pytest.mark.parametrize(
    "name", ["unicoll.entry", *(m for m in sorted(MODULES) if floor_of(m) == floor_of("unicoll.eager"))]
)
def test_the_lock_and_the_eager_operators_know_nothing_of_compile(name: str) -> None:
    """Neither the lock nor the eager floor asks torch.compile anything: Dynamo's modules and
    torch.compiler are the compile floor's and the public face's."""
    source = MODULES[name].read_text()
    assert "_dynamo" not in source and "torch.compiler" not in source and "is_compiling" not in source, name

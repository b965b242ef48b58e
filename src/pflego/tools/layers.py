"""The package's layers, and a check that its imports only ever look down.

Each module belongs to one layer (the longest prefix in :data:`LAYERS` that names it). A module may
import modules of its own layer or of a layer below it, never one above, and no set of modules may
import each other in a circle. Every import counts, also those inside functions; only imports under
``if TYPE_CHECKING:`` are left out, since they never run.

Run ``python -m pflego.tools.layers`` to print the layers and any violation (exit code 1 if any);
the default test suite runs the same check.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

#: The layers from the bottom up: each entry is a layer's name and the module prefixes it holds.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "pflego._version",
            "pflego.types",
            "pflego.tree",
            "pflego.errors",
            "pflego.fields",
            "pflego.rng",
            "pflego.environment",
        ),
    ),
    (
        "foundations",
        (
            "pflego.config",
            "pflego.history",
            "pflego.trackers",
            "pflego.plots",
            "pflego.data",
            "pflego.models",
            "pflego.optim",
            "pflego.graphs",
        ),
    ),
    (
        "local training",
        (
            "pflego.loss",
            "pflego.program",
            "pflego.fused_passes",
            "pflego.fused",
            "pflego.fused_bilevel",
            "pflego.local",
        ),
    ),
    ("algorithms", ("pflego.algorithms",)),
    ("simulation", ("pflego.sim",)),
    ("experiments", ("pflego.experiments", "pflego.bench", "pflego.comm")),
    ("flower", ("pflego.flower",)),
    ("command line", ("pflego.cli",)),
    ("package face", ("pflego", "pflego.tools", "pflego.configs")),
)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Violation:
    """One import that breaks the layering: an upward import, or one arrow of a circle."""

    kind: str
    importer: str
    imported: str

    def __str__(self) -> str:
        if self.kind == "upward":
            return (
                f"upward import: {self.importer} ({layer_of(self.importer)}) imports "
                f"{self.imported} ({layer_of(self.imported)})"
            )
        return f"circle: {self.importer} -> {self.imported}"


def layer_index(module: str) -> int:
    """The position of ``module``'s layer in :data:`LAYERS` (0 is the bottom)."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise ValueError(f"{module} belongs to no layer: add its prefix to LAYERS in {__name__}")
    return best


def layer_of(module: str) -> str:
    """The name of ``module``'s layer."""
    return LAYERS[layer_index(module)][0]


def modules(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (at ``path``) imports."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(
                resolve(alias.name) for alias in node.names if alias.name.startswith("pflego")
            )
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "pflego" or source.startswith("pflego."):
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    found.add(submodule if submodule in known else resolve(source))
    found.discard(None)
    found.discard(name)
    return {module for module in found if module is not None}


def graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """The import graph of the package: module -> the package's modules it imports."""
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The sets of two or more modules that each reach all the others by imports, each sorted."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for succ in edges.get(todo.pop(), ()):
                if succ not in seen:
                    seen.add(succ)
                    todo.append(succ)
        return seen

    reachable = {node: reach(node) for node in edges}
    found = {
        tuple(sorted(n for n in reachable[node] if node in reachable.get(n, ()))) for node in edges
    }
    return sorted(list(c) for c in found if len(c) > 1)


def violations(edges: dict[str, set[str]]) -> list[Violation]:
    """Every upward import, then every arrow inside a circle."""
    found = [
        Violation("upward", importer, imported)
        for importer in sorted(edges)
        for imported in sorted(edges[importer])
        if layer_index(imported) > layer_index(importer)
    ]
    for component in circles(edges):
        members = set(component)
        found += [
            Violation("circle", importer, imported)
            for importer in component
            for imported in sorted(edges[importer] & members)
        ]
    return found


def main() -> int:
    """Print the layers with their modules and sizes, then every violation; 1 if there is any."""
    edges = graph()
    known = modules()
    for index, (name, _) in reversed(list(enumerate(LAYERS))):
        members = sorted(module for module in edges if layer_index(module) == index)
        sizes = ", ".join(f"{m} {len(known[m].read_text().splitlines())}" for m in members)
        print(f"{index} {name}: {sizes}")
    found = violations(edges)
    for violation in found:
        print(violation)
    largest = max(known, key=lambda m: len(known[m].read_text().splitlines()))
    print(
        f"{len(known)} modules, largest {largest} ({len(known[largest].read_text().splitlines())} "
        f"lines), {len(circles(edges))} circles, "
        f"{sum(v.kind == 'upward' for v in found)} upward imports"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

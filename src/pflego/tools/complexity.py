"""Cyclomatic complexity of every function of the package, and the limit the suite keeps.

A function's complexity is 1 plus its branches: ``if``, ``for``, ``while``, each ``except``
handler, each comprehension and its ``if`` clauses, each extra operand of ``and`` / ``or``, each
conditional expression and each ``match`` case. A nested function's branches count in its parent
too (and on their own).

Run ``python -m pflego.tools.complexity [FOLDER] [--top N]`` to print the N most complex functions
(the highest last); the default test suite checks that none is above :data:`LIMIT`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from pflego.tools.layers import PACKAGE_ROOT

#: The highest complexity a function of the package may have.
LIMIT = 20

_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler, ast.match_case)


def complexity(function: ast.AST) -> int:
    """1 plus the branches of ``function`` (an ``ast`` function node), nested ones included."""
    score = 1
    for node in ast.walk(function):
        if isinstance(node, _BRANCHES):
            score += 1
        elif isinstance(node, ast.BoolOp):
            score += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            score += 1 + len(node.ifs)
    return score


def functions(root: Path = PACKAGE_ROOT) -> Iterator[tuple[str, int]]:
    """``("path/to/module.py:name", complexity)`` for every function under ``root``."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{path.relative_to(root.parent).as_posix()}:{node.name}", complexity(node)


def main(argv: list[str] | None = None) -> int:
    """Print the most complex functions, the highest last; 1 if any is above :data:`LIMIT`."""
    args = list(sys.argv[1:] if argv is None else argv)
    top = 10
    if "--top" in args:
        at = args.index("--top")
        top = int(args[at + 1])
        del args[at : at + 2]
    root = Path(args[0]) if args else PACKAGE_ROOT
    rows = sorted(functions(root), key=lambda row: (row[1], row[0]))
    for name, score in rows[-top:]:
        print(score, name)
    return 1 if rows and rows[-1][1] > LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())

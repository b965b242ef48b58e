"""The README's test command installs every optional package that the suite needs.

A green CI once hid two install defects: the README's test command left out an extra that the
suite imports. Here the extras that the README's test command names are held against every
third-party package that the tests and the package import, so the two cannot drift apart again.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_COMMAND_HEADING = "# 2. install, then run the tests"


def readme_test_command() -> str:
    """The line after the README's test heading (the line `.ci/run` runs)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return lines[lines.index(TEST_COMMAND_HEADING) + 1]


def extras_named(command: str) -> set[str]:
    """The extras of ``-e ".[a,b]"`` in an install command."""
    match = re.search(r"-e \"?\.\[([^\]]*)\]", command)
    return set(match[1].split(",")) if match else set()


def slow_tier_extras() -> set[str]:
    """The extras `.ci/run` installs after the README's test command, before ``pytest -m slow``."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return set().union(*(extras_named(line) for line in lines if line.startswith("pip install")))


def requirement_name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (``flwr>=1.41`` -> ``flwr``)."""
    name = re.match(r"[A-Za-z0-9_.-]+", requirement)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


#: Distributions whose module is not named after them, for when they are not installed (the
#: slow tier's extras are absent from the default suite's environment).
MODULE_NAMES = {"mlflow-skinny": {"mlflow"}}


def modules_of(distribution: str) -> set[str]:
    """The top-level modules a distribution provides (its name, and what it installed)."""
    installed = MODULE_NAMES.get(distribution, set()) | {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if distribution in {requirement_name(owner) for owner in owners}
    }
    return installed | {distribution.replace("-", "_")}


def imported_modules(paths: list[Path], lazy: bool = True) -> set[str]:
    """The top-level names of every absolute import in ``paths`` (``lazy``: also inside
    functions; else only those a module runs when it is imported)."""
    found = set()
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree) if lazy else tree.body:
            if isinstance(node, ast.Import):
                found.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    return found - set(sys.stdlib_module_names)


def test_the_readme_test_command_is_an_install_then_pytest():
    command = readme_test_command()
    assert command.startswith("pip install torch==2.13.0 -e "), command
    assert command.endswith("&& python -m pytest"), command


def test_the_readme_test_command_installs_every_extra_the_suite_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = extras_named(readme_test_command())
    assert named <= set(extras), f"the README names extras that do not exist: {named - set(extras)}"
    imported = imported_modules([*ROOT.glob("tests/*.py"), *ROOT.glob("src/pflego/**/*.py")])
    requirements = [*project["dependencies"], "torch"]
    requirements += [r for extra in named & set(extras) for r in extras[extra]]
    installed = set().union(*(modules_of(requirement_name(r)) for r in requirements))
    # An extra is needed if it provides an imported module that the command does not install
    # otherwise (flower-sim adds Ray to flower; Ray runs in Flower's processes, never imported).
    needed = {
        extra
        for extra, requirements in extras.items()
        if any(modules_of(requirement_name(r)) & (imported - installed) for r in requirements)
    }
    # Extras of the slow tier alone (.ci/run installs them) are imported only inside functions
    # (the default suite's tests of them skip or are slow), never when a module is imported.
    slow_only = needed & slow_tier_extras() - named
    assert needed - slow_only <= named, (
        f"the suite imports packages of the extras {sorted(needed - named)}, which the README's "
        f"test command does not install: {readme_test_command()}"
    )
    eager = imported_modules([*ROOT.glob("tests/*.py"), *ROOT.glob("src/pflego/**/*.py")], False)
    for extra in slow_only:
        modules = set().union(*(modules_of(requirement_name(r)) for r in extras[extra]))
        assert not modules & eager - installed, f"a module imports [{extra}] when it is imported"


def test_every_third_party_import_is_a_dependency_or_in_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], "torch"]
    requirements += [r for group in project["optional-dependencies"].values() for r in group]
    provided = set().union(*(modules_of(requirement_name(r)) for r in requirements))
    imported = imported_modules([*ROOT.glob("tests/*.py"), *ROOT.glob("src/pflego/**/*.py")])
    local = {"pflego", "data_formats", "flower_scenario", "conftest"} | {
        path.stem for path in (ROOT / "tests").glob("*.py")
    }
    assert imported - provided - local == set()

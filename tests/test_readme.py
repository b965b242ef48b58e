"""The README's examples, and those of docs/cli.md (the command line in full), run as written,
so neither can drift from the code; the README's tables are those its results print.

Every ``pflego ...`` line of a page's ``bash`` blocks runs in order in an empty folder, with
``~/data`` pointing at small files in the official MNIST format and with fewer rounds and local
steps (``shrink``); ``pflego flower`` (daemons) and ``pflego bench`` (minutes) are only parsed
here, and the bench and the smallest Flower try run in the slow tier. A ``pflego reproduce`` of a
paper's experiment (hours) is parsed and its preset's every run checked, without training; its
``--quick`` and ``--list`` forms run. The console examples (``$ pflego ...`` and the line it
prints) must print exactly that line, and the README's Python block runs too. The README stays
under 200 lines, keeps the test command that ``.ci/run`` reads, names every registered method,
and its main table equals what ``benchmarks/readme_table.py`` prints from ``results/main``.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from data_formats import mnist_arrays, write_idx_set

from pflego.algorithms import ALGORITHMS
from pflego.cli import build_parser, main
from pflego.config import TRACKERS
from pflego.experiments.presets import load_preset
from pflego.experiments.runs import build_plan

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose examples run: the README and the command line in full.
PAGES = [README, ROOT / "docs" / "cli.md"]
#: Commands that start daemons or take minutes: parsed only in the default tier.
HEAVY = ("flower", "bench")


def bash_commands(text: str) -> list[list[str]]:
    """The ``pflego`` command lines of the README's ``bash`` blocks, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("pflego "):
                commands.append(shlex.split(line, comments=True))
    return commands


def console_examples(text: str) -> list[tuple[list[str], str]]:
    """``$ pflego ...`` lines of plain code blocks and the line printed after each."""
    return [
        (shlex.split(command), printed.strip())
        for command, printed in re.findall(r"^\$ (pflego [^\n]*)\n([^\n]+)", text, re.M)
    ]


def fewer(rounds: int) -> int:
    """Far fewer rounds that still grow with the README's (20 -> 1, 40 -> 2, 200 -> 4)."""
    return max(1, round(math.log2(rounds / 10)))


def hugging_face_folder(folder: Path) -> Path:
    """docs/cli.md's ``hf:./my-set``: a small tabular set of 12 writers (fewer than the default
    50 clients) saved with save_to_disk."""
    import datasets

    if not folder.exists():
        rng = np.random.default_rng(0)
        n = 240
        table = {f"x{j}": rng.normal(size=n).tolist() for j in range(4)}
        table["label"] = rng.integers(0, 3, n).tolist()
        table["writer_id"] = [f"w{i % 12}" for i in range(n)]
        datasets.Dataset.from_dict(table).save_to_disk(str(folder))
    return folder


def shrink(argv: list[str], data_dir: Path) -> list[str]:
    """The command with ``~/data`` in a temporary folder, few rounds and few local steps."""
    argv = [str(data_dir) if a == "~/data" else a for a in argv[1:]]
    argv = [
        f"hf:{hugging_face_folder(data_dir / 'my-set')}" if a == "hf:./my-set" else a for a in argv
    ]
    argv = [
        str(fewer(int(a))) if i and argv[i - 1] == "--rounds" else a for i, a in enumerate(argv)
    ]
    if argv[0] in ("run", "compare", "tune") and "--resume" not in argv:
        argv += [] if "--rounds" in argv else ["--rounds", "1"]
        argv += ["--inner-steps", "2"]
    return argv + (["--quiet"] if argv[0] in ("run", "compare", "tune", "reproduce") else [])


def needs_slow_tier_extras(args: list[str]) -> bool:
    """A ``--log`` line whose trackers are not installed (the slow tier installs and reads them
    back, tests/test_trackers.py)."""
    if "--log" not in args:
        return False
    names = args[args.index("--log") + 1].split(",")
    return any(importlib.util.find_spec(TRACKERS[name]) is None for name in names)


def is_paper_experiment(args: list[str]) -> bool:
    """A full ``pflego reproduce NAME``: hours of training."""
    return args[0] == "reproduce" and not {"--quick", "--list"} & set(args)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache of decoded arrays for the module (mnist5k is decoded once)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def session(tmp_path, monkeypatch, cache):
    """An empty working folder, offline, with small MNIST files in ``data/mnist``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    monkeypatch.setenv("PFLEGO_CACHE", str(cache))
    write_idx_set(tmp_path / "data" / "mnist", mnist_arrays(2000, 500))
    return tmp_path / "data"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_readme_command_lines_run(page, session, capsys):
    commands = bash_commands(page.read_text())
    assert len(commands) >= 5
    parser = build_parser()
    for argv in commands:
        args = shrink(argv, session)
        if args[0] in HEAVY or needs_slow_tier_extras(args):
            parser.parse_args(args)  # the flags exist
            continue
        if is_paper_experiment(args):
            build_plan(load_preset(parser.parse_args(args).name), "reproduce")  # every run valid
            continue
        code = main(args)
        err = capsys.readouterr().err
        assert code == 0, f"{shlex.join(argv)} -> {err}"
        assert "Traceback" not in err


def test_readme_console_examples_print_what_it_shows(session, capsys):
    examples = [example for page in PAGES for example in console_examples(page.read_text())]
    assert examples
    for argv, printed in examples:
        main(argv[1:])
        captured = capsys.readouterr()
        assert printed in (captured.err + captured.out).splitlines(), argv


def test_readme_python_example_runs(session, capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    fewer = re.sub(r'("rounds": |rounds=)\d+', r"\g<1>2", block)
    exec(compile(fewer, str(README), "exec"), {})
    assert (session.parent / "runs" / "demo" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_readme_heavy_commands_run(session, capsys):
    """``pflego bench`` on the small MNIST files, and the smallest ``pflego flower local``."""
    pytest.importorskip("flwr")
    for argv in [argv for page in PAGES for argv in bash_commands(page.read_text())]:
        args = shrink(argv, session)
        if args[0] == "bench":
            args += ["--rounds", "1", "--taus", "5", "--memory-clients", "200"]
        elif args[:2] == ["flower", "local"] and args[args.index("--nodes") + 1] == "2":
            args += ["--inner-steps", "2", "--quiet"]
        else:
            continue
        code = main(args)
        assert code == 0, f"{shlex.join(argv)} -> {capsys.readouterr().err}"


def test_readme_fits_on_a_screen_and_keeps_the_ci_test_command():
    lines = README.read_text().splitlines()
    assert len(lines) < 200
    heading = lines.index("# 2. install, then run the tests")
    command = 'pip install torch==2.13.0 -e ".[dev,flower,dp,hf]" && python -m pytest'
    assert lines[heading + 1] == command


def test_readme_names_every_method_and_counts_them():
    text = README.read_text()
    listed = re.findall(r"`([a-z0-9+-]+)`", text.split("## Methods")[1].split("\n## ")[0])
    assert sorted(listed) == sorted(ALGORITHMS)
    for page in (README, ROOT / "docs" / "algorithms.md"):
        counts = {int(n) for n in re.findall(r"(\d+) methods", page.read_text())}
        assert counts == {len(ALGORITHMS)}, page.name


def readme_table():
    """``benchmarks/readme_table.py``, imported."""
    spec = importlib.util.spec_from_file_location(
        "readme_table", ROOT / "benchmarks" / "readme_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_table(text: str, header: str) -> str:
    """The table of ``text`` whose first line starts with ``header``."""
    start = text.index(header)
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else None].strip()


def test_readme_tables_are_what_the_committed_results_print():
    """The README's main table and the leaderboard of docs/experiments.md equal, to the last
    digit, what ``benchmarks/readme_table.py`` prints from the committed runs."""
    tables = readme_table()
    main_table = tables.table(ROOT / "results" / "main")
    assert markdown_table(README.read_text(), "| algorithm | test_acc") == main_table
    assert "python benchmarks/readme_table.py results/main" in README.read_text()
    board = tables.ranked(ROOT / "results" / "leaderboard-mnist-offline")
    experiments = (ROOT / "docs" / "experiments.md").read_text()
    assert markdown_table(experiments, "| rank | method |") == board
    assert "| 1 | fedphp | 97.31 | 93.83 | 37 | fedmd | 93.30 | 86.81 |" in board

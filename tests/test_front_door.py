"""The front door: ``pflego --help`` and ``--version`` answer without importing torch, the
top-level help lists each command with the help its own module gives it, and a run's
``environment.json`` names the backend that produced its numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY

import pflego
from pflego.cli import COMMANDS, build_parser

SRC = str(Path(pflego.__file__).parents[1])


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_import_no_torch(flag):
    code = (
        "import sys, contextlib, io, pflego.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    code = pflego.cli.main([{flag!r}])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "commands = sorted(m for m in sys.modules if m.startswith('pflego.cli.') and "
        "m not in ('pflego.cli.parsing', 'pflego.cli.session'))\n"
        "assert code == 0 and out.getvalue(), (code, out.getvalue())\n"
        "assert not heavy and not commands, (heavy[:5], commands)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr


def test_lazy_help_lists_what_the_commands_say():
    """``COMMANDS``' one-line helps equal those the modules give their commands."""
    full = build_parser()
    assert build_parser(lazy=True).format_help() == full.format_help()
    listed = {a.dest: a.help for a in full._subparsers._group_actions[0]._choices_actions}
    assert listed == {name: text for name, (text, _) in COMMANDS.items()}


def test_a_chosen_command_gets_its_flags():
    args = build_parser(lazy=True).parse_args(["run", "--rounds", "3", "--threads", "1"])
    assert args.rounds == "3" and args.threads == 1 and args.handler.__name__ == "cmd_run"


@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_environment_records_the_backend_that_ran_the_rounds(tmp_path, backend):
    """``environment.json`` names the backend of the checkpoint (``auto``: the one it chose), and
    a resumption's entry its own."""
    out = tmp_path / "run"
    pflego.run({**TINY, "backend": backend}, out=out, progress=False)
    chosen = torch.load(out / "checkpoint.pt", weights_only=False)["backend"]
    environment = json.loads((out / "environment.json").read_text())
    assert environment["client_backend"] == chosen != "auto"
    assert backend == "auto" or chosen == backend
    pflego.resume(out, rounds=TINY["rounds"] + 2, progress=False)
    environment = json.loads((out / "environment.json").read_text())
    assert environment["client_backend"] == environment["resumed"][-1]["client_backend"] == chosen

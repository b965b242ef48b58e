"""The ``pflego`` command: run, compare, plot, list, reproduce, tune, report, bench and flower.

Every user error ends with a one-line message on stderr and exit code 2, never a traceback.
Every flag's help shows its default and its choices; abbreviated flags are refused. A command's
parser imports torch and the registries, so :class:`Commands` builds it only when that command is
chosen: ``pflego --help`` and ``pflego --version`` import neither torch nor a command module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from pflego._version import __version__
from pflego.cli.parsing import Parser, leaf_parsers
from pflego.cli.session import Interrupted, command_environment
from pflego.errors import PflegoError

#: Every command, in the order of ``pflego --help``: its one-line help there (and atop its own
#: ``--help``), and the function (``module:name``) that adds it and its flags.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run one experiment", "pflego.cli.run:add_command"),
    "compare": (
        "run several algorithms and compare them (no flags: the main experiment)",
        "pflego.cli.compare:add_command",
    ),
    "plot": (
        "plot runs' training loss and test accuracy (mean, bottom decile)",
        "pflego.cli.tools:add_commands",
    ),
    "list": (
        "list algorithms (with their step sizes and options), datasets and models",
        "pflego.cli.tools:add_commands",
    ),
    "reproduce": (
        "run a paper experiment (a preset) and write its table beside the paper's numbers",
        "pflego.cli.experiments:add_commands",
    ),
    "tune": (
        "grid search on validation data, then rerun the choice with --seeds",
        "pflego.cli.experiments:add_commands",
    ),
    "report": (
        "rebuild a comparison table and figure from existing run directories",
        "pflego.cli.experiments:add_commands",
    ),
    "bench": (
        "measure simulator speed, client FLOPs and memory, or compare with the usual way",
        "pflego.bench.command:add_commands",
    ),
    "flower": ("run on Flower (needs pflego[flower])", "pflego.cli.flower:add_commands"),
}


class Commands(argparse._SubParsersAction):
    """The sub-commands of ``pflego``, each an empty stand-in until it is chosen (or
    :meth:`build` is called), when the function of :data:`COMMANDS` adds it with its flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in COMMANDS:
            self.add_parser(name)
        self.pending = dict.fromkeys(COMMANDS)

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A command's parser, with its one-line help of :data:`COMMANDS`."""
        kwargs.setdefault("help", COMMANDS[name][0])
        return super().add_parser(name, **kwargs)

    def build(self, name: str) -> None:
        """Replace the stand-ins of ``name``'s module by the real parsers (with ``--threads``)."""
        from pflego.cli.flags import add_threads_flag

        if name not in self.pending:
            return
        adder = COMMANDS[name][1]
        names = [other for other, (_, spec) in COMMANDS.items() if spec == adder]
        for other in names:
            del self._name_parser_map[other], self.pending[other]
        self._choices_actions = [a for a in self._choices_actions if a.dest not in names]
        module, function = adder.split(":")
        getattr(importlib.import_module(module), function)(self)
        for other in names:
            for leaf in leaf_parsers(self._name_parser_map[other]):
                if "--threads" not in leaf._option_string_actions:
                    add_threads_flag(leaf)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        self.build(values[0])
        super().__call__(parser, namespace, values, option_string)


def build_parser(lazy: bool = False) -> argparse.ArgumentParser:
    """The parser of the ``pflego`` command and all its commands (imports torch and the
    registries); ``lazy``: each command's parser is built when it is chosen."""
    parser = Parser(
        prog="pflego",
        description="Personalized federated learning: PFLEGO and the methods it is compared with.",
    )
    parser.add_argument("--version", action="version", version=f"pflego {__version__}")
    commands = parser.add_subparsers(
        dest="command", parser_class=Parser, metavar="COMMAND", action=Commands
    )
    if not lazy:
        for name in COMMANDS:
            commands.build(name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pflego`` console script."""
    try:
        parser = build_parser(lazy=True)  # the chosen command's parser imports torch
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already reported in one line
        return int(exc.code or 0)
    except KeyboardInterrupt:
        print(
            "pflego: interrupted before the command started; nothing was written", file=sys.stderr
        )
        return 130
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        with command_environment(args):
            return args.handler(args)
    except PflegoError as exc:
        print(f"pflego: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "allocate" not in str(exc):
            raise
        print(
            f"pflego: error: out of memory ({type(exc).__name__}); lower clients, batch_size, "
            "local_epochs or chunk_size (the checkpoints written so far are kept: --resume)",
            file=sys.stderr,
        )
        return 2
    except Interrupted as exc:
        if str(exc):
            print(f"pflego: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("pflego: interrupted", file=sys.stderr)
        return 130

"""The small commands around experiments: ``pflego plot`` (runs' curves in one figure) and
``pflego list`` (the algorithms, datasets and models there are).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pflego.cli.flags import add_flag


def cmd_plot(args: argparse.Namespace) -> int:
    from pflego.history import History, check_writable
    from pflego.plots import plot_histories

    check_writable(args.out.parent, f"{args.out.parent}, the folder of --out {args.out}")
    histories = {Path(d).name: History.load(d) for d in args.runs}
    print(plot_histories(histories, args.out, args.title))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from pflego.algorithms import ALGORITHMS, hyperparameters
    from pflego.data import DATASETS, FAMILIES
    from pflego.models import ARCHITECTURES

    print("algorithms (default step sizes, then options):")
    width = max(map(len, ALGORITHMS), default=0)
    for name, cls in sorted(ALGORITHMS.items()):
        steps = f"client_lr={cls.default_client_lr:g} server_lr={cls.default_server_lr:g}"
        options = ", ".join(f"{k}={v!r}" for k, v in hyperparameters(cls).items())
        print(f"  {name:{width}s}  {steps}" + (f"  {options}" if options else ""))
    print("datasets:")
    width = max(map(len, [*DATASETS, *(f.usage for f in FAMILIES.values())]), default=0)
    for name, info in sorted(DATASETS.items()):
        print(f"  {name:{width}s}  {info.description} (model: {info.default_model})")
    for family in FAMILIES.values():
        print(f"  {family.usage:{width}s}  {family.description}")
    print("models:", ", ".join(sorted(ARCHITECTURES)), "or mlp<N> (N hidden units)")
    return 0


def add_commands(sub: Any) -> None:
    """Add ``plot`` and ``list`` to the ``pflego`` command's subparsers."""
    plot = sub.add_parser("plot")
    plot.add_argument("runs", nargs="+", help="run directories")
    add_flag(plot, "--out", default=Path("comparison.png"), help="PNG file to write")
    plot.add_argument("--title", help="figure title (default: the runs' algorithms and dataset)")
    plot.set_defaults(handler=cmd_plot)

    sub.add_parser("list").set_defaults(handler=cmd_list)

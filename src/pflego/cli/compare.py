"""``pflego compare``: several algorithms on the same setting (no flags: the paper's main
experiment), finished with ``--resume`` after a stop, and the table that compares them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pflego.cli.flags import (
    add_flag,
    add_flags,
    add_run_flags,
    check_target,
    settings_from_args,
    workers_from_args,
)
from pflego.cli.session import interrupted_experiment
from pflego.errors import ConfigError


def finished(report: Any) -> int:
    """Exit code 1, with a warning on stderr, when some of a report's runs did not finish
    (diverged, failed, stopped); else 0."""
    unfinished = report.unfinished()
    if not unfinished:
        return 0
    print(
        f"pflego: warning: {len(unfinished)} of {len(report.rows)} rows did not finish every run: "
        + "; ".join(unfinished),
        file=sys.stderr,
    )
    return 1


def cmd_compare(args: argparse.Namespace) -> int:
    """``pflego compare``: validate everything first, run, print the main table."""
    from pflego.experiments.folders import stamp
    from pflego.experiments.report import build_report
    from pflego.experiments.reproduce import compare
    from pflego.experiments.seeds import parse_seeds

    settings = settings_from_args(args)
    if "algorithm" in settings:
        raise ConfigError(
            "compare takes --algorithms (comma-separated, e.g. --algorithms pflego,fedavg), "
            "not --algorithm"
        )
    names = None  # the file's rows; an empty list is refused by compare()
    if args.algorithms is not None:
        names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    given = args.algorithms is not None or settings or args.config or args.seeds or args.out
    if args.resume and (given or args.overwrite):
        raise ConfigError(
            f"compare --resume {args.resume} finishes that comparison as it was started; "
            "give no other settings"
        )
    if args.resume and not Path(args.resume).is_dir():
        raise ConfigError(f"comparison directory {args.resume} does not exist")
    root = args.resume or args.out or Path("runs") / f"compare-{stamp()}"
    try:
        table, _ = compare(
            names,
            args.config,
            None if args.resume else root,
            not args.quiet,
            seeds=parse_seeds(args.seeds),
            resume=args.resume,
            target_acc=check_target(args.target_acc),
            workers=workers_from_args(args),
            overwrite=args.overwrite,
            **settings,
        )
    except KeyboardInterrupt:
        return interrupted_experiment(f"`pflego compare --resume {root}` finishes it")
    print(table)
    print(f"\ncomparison.md, comparison.csv, comparison.png and every run in {root}")
    return finished(build_report(Path(root)))


def defaults() -> dict[str, str]:
    """How ``compare --help`` shows its defaults: the main experiment's settings, and its rows'
    step sizes on its dataset (on another dataset, and for another row, the algorithm's own)."""
    from pflego.experiments.presets import load_preset
    from pflego.experiments.reproduce import MAIN_PRESET, STEP_SIZES

    main = load_preset(MAIN_PRESET)
    shown = {k: f"{v}, the main experiment's" for k, v in main.settings.items()}
    for key in STEP_SIZES:
        rows = ", ".join(
            f"{name} {row.settings[key]:g}"
            for name, row in main.rows.items()
            if key in row.settings
        )
        shown[key] = (
            f"the comparison file's rows', for the main experiment {rows} on "
            f"{main.settings['dataset']}; on another --dataset, and for any other row, the "
            "algorithm's own (`pflego list`)"
        )
    return shown


def add_command(sub: Any) -> None:
    """Add ``compare`` to the ``pflego`` command's subparsers."""
    parser = sub.add_parser("compare")
    add_run_flags(
        parser,
        without=("algorithm",),
        defaults=defaults(),
        out="output directory (default: runs/compare-<date>-<time>)",
    )
    # refused with a pointer to --algorithms (cmd_compare), and never listed
    parser.add_argument("--algorithm", dest="algorithm", help=argparse.SUPPRESS)
    parser.add_argument(
        "--algorithms",
        help="comma-separated names (default: the preset's; for the main experiment "
        "pflego,fedavg,fedper)",
    )
    add_flag(parser, "--seeds")
    add_flags(parser, "--jobs", "--devices")
    add_flag(parser, "--target-acc")
    add_flag(
        parser,
        "--resume",
        help="finish an interrupted comparison in DIR (finished runs are not repeated; default: "
        "start a new one)",
    )
    add_flag(parser, "--overwrite")
    parser.set_defaults(handler=cmd_compare)

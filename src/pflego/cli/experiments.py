"""The experiment commands: ``pflego reproduce`` (a paper experiment, from a preset), ``tune`` (a
grid search on validation data) and ``report`` (the tables of finished runs, rebuilt).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pflego.cli.compare import finished
from pflego.cli.flags import (
    add_flag,
    add_flags,
    add_run_flags,
    add_run_setting,
    check_target,
    parse_names,
    settings_from_args,
    workers_from_args,
)
from pflego.cli.session import interrupted_experiment
from pflego.errors import ConfigError

#: command -> the description atop its own ``--help``
DESCRIPTIONS = {
    "reproduce": "Run every row of a preset and write report.md (paper vs ours, mean ± std over "
    "seeds), report.csv, report.png and every run directory. Rerunning the same command finishes "
    "an interrupted reproduction without repeating finished runs.",
    "tune": "Run every grid point for the same rounds, choose the highest mean validation accuracy "
    "of the last evaluations (test data is never read), rerun the choice with --seeds and "
    "report its test accuracy. Writes tune.md and chosen.yaml.",
    "report": "Rebuild report.md / report.csv / report.png from an experiment directory (reproduce, "
    "compare, run --seeds) or from run directories (runs equal but for the seed form one "
    "row). Nothing is trained.",
}


# --- reproduce -----------------------------------------------------------------------------------


def cmd_reproduce(args: argparse.Namespace) -> int:
    from pflego.experiments.presets import list_presets
    from pflego.experiments.reproduce import default_reproduce_out, reproduce
    from pflego.experiments.seeds import parse_seeds

    if args.list:
        print_presets(list_presets())
        return 0
    if not args.name:
        raise ConfigError("name a preset (`pflego reproduce --list` shows them)")
    root = args.out or default_reproduce_out(args.name, args.quick, args.offline, args.tune)
    try:
        report = reproduce(
            args.name,
            seeds=parse_seeds(args.seeds),
            rounds=args.rounds,
            quick=args.quick,
            offline=args.offline,
            data_dir=args.data_dir,
            out=root,
            tune=args.tune,
            tune_seeds=parse_seeds(args.tune_seeds),
            tune_rounds=args.tune_rounds,
            target_acc=check_target(args.target_acc),
            overrides=settings_from_args(args),  # --set and --log
            blocks=parse_names(args.blocks),
            rows=parse_names(args.rows),
            progress=not args.quiet,
            workers=workers_from_args(args),
            overwrite=args.overwrite,
        )
    except KeyboardInterrupt:
        return interrupted_experiment("rerun the same command (same --out) to finish it")
    print(report.summary())
    print(f"\nreport.md, report.csv, report.png and every run directory in {root}")
    return finished(report)


def print_presets(presets: list) -> None:
    from pflego.data import DATASETS

    width = max(len(p.name) for p in presets)
    for preset in presets:
        named = [*preset.data, *(d for block in preset.block_data.values() for d in block)]
        named = list(dict.fromkeys(named)) or [preset.settings.get("dataset", "mnist5k")]
        data = ", ".join(
            f"{d}" + ("" if DATASETS[d].needs_data_dir else " (built in)") for d in named
        )
        print(f"  {preset.name:{width}s}  {preset.description or '(no description)'}")
        print(f"  {'':{width}s}  data: {data}")


def add_reproduce(sub: Any) -> None:
    p = sub.add_parser("reproduce", description=DESCRIPTIONS["reproduce"])
    p.add_argument("name", nargs="?", help="preset name (see --list) or a preset YAML file")
    p.add_argument("--list", action="store_true", help="list the presets and the data each needs")
    add_flag(p, "--seeds")
    add_flags(p, "--jobs", "--devices")
    p.add_argument(
        "--rounds", type=int, help="replace every run's number of rounds (default: the preset's)"
    )
    p.add_argument("--quick", action="store_true", help="the preset's small version (smoke test)")
    p.add_argument(
        "--offline",
        action="store_true",
        help="use the preset's offline stand-in data (stated in the report; not the paper's data)",
    )
    add_run_setting(p, "data_dir")
    add_flag(p, "--out", help="output directory (default runs/<name>[-quick][-offline][-tuned])")
    add_flag(p, "--overwrite")
    p.add_argument(
        "--tune",
        action="store_true",
        help="first tune the rows with a tune grid on validation data, then run with the choice",
    )
    add_flag(p, "--tune-seeds", help="seeds of the tuning runs (default 0)")
    p.add_argument(
        "--tune-rounds", type=int, help="rounds of every tuning run (default the runs' own)"
    )
    p.add_argument("--blocks", metavar="B1,B2", help="only these blocks (default all)")
    p.add_argument("--rows", metavar="R1,R2", help="only these rows (default all)")
    add_flag(p, "--target-acc")
    add_flag(p, "--set", help="override a setting of every run, e.g. --set device=cuda")
    add_run_setting(p, "log")
    add_flag(p, "--quiet", help="no progress bars")
    add_flags(p, "--no-verify")
    p.set_defaults(handler=cmd_reproduce)


# --- tune ----------------------------------------------------------------------------------------


def cmd_tune(args: argparse.Namespace) -> int:
    from pflego.config import read_yaml
    from pflego.experiments.presets import flatten, grid_points, merge
    from pflego.experiments.seeds import parse_seeds
    from pflego.experiments.tune import parse_grid, tune

    flags = settings_from_args(args)
    if "seed" in flags:
        raise ConfigError(
            "tune takes --tune-seeds (grid runs) and --seeds (final runs), not --seed"
        )
    grid = parse_grid(args.grid)
    grid_keys = {key for point in grid_points(grid) for key in flatten(point)}
    clash = sorted(grid_keys & set(flatten(flags)))
    if clash:
        raise ConfigError(f"{clash[0]} is both a flag and a --grid dimension; give it once")
    settings = merge(read_yaml(args.config) if args.config else {}, flags)
    try:
        choice, table = tune(
            settings,
            grid,
            seeds=parse_seeds(args.seeds),
            tune_seeds=parse_seeds(args.tune_seeds),
            out=args.out,
            progress=not args.quiet,
            workers=workers_from_args(args),
            overwrite=args.overwrite,
        )
    except KeyboardInterrupt:
        return interrupted_experiment("rerun the same command with the same --out to finish it")
    print(f"chosen on {choice['metric']}: {choice['label']} ({100 * choice['score']:.2f}%)")
    print(table)
    return 0


def add_tune(sub: Any) -> None:
    p = sub.add_parser("tune", description=DESCRIPTIONS["tune"])
    add_run_flags(
        p, without=("seed",), out="output directory (default: runs/tune-<algorithm>-<date>-<time>)"
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a grid dimension, e.g. client_lr=0.01,0.1 or options.mu=0.1,1 or the joint "
        "server_optimizer+server_lr=sgd/0.1,adam/0.001 (repeat for more)",
    )
    add_flag(p, "--seeds")
    add_flags(p, "--jobs", "--devices")
    add_flag(p, "--tune-seeds")
    add_flag(p, "--overwrite")
    p.set_defaults(handler=cmd_tune)


# --- report --------------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    from pflego.experiments.folders import check_out, clear_out
    from pflego.experiments.report import FORMATS, plan_from_directories, write_report

    if args.format not in FORMATS:
        raise ConfigError(f"--format {args.format!r} is not one of {', '.join(FORMATS)}")
    plan, root = plan_from_directories([Path(d) for d in args.dirs])
    out = args.out or (Path(args.dirs[0]) if plan.kind != "runs" else Path("report"))
    if plan.kind == "runs" or out.resolve() != root.resolve():  # not the experiment's own folder
        check_out(out, "report", args.overwrite)
        if args.overwrite:
            clear_out(out)
    report = write_report(
        root, plan, check_target(args.target_acc), out, latex=args.format == "latex"
    )
    print(report.text(args.format), end="")
    print(f"\nreport files in {out}", file=sys.stderr)
    return 0


def add_report(sub: Any) -> None:
    p = sub.add_parser("report", description=DESCRIPTIONS["report"])
    p.add_argument(
        "dirs", nargs="+", metavar="DIR", help="an experiment directory or run directories"
    )
    p.add_argument("--format", default="md", help="what to print: md | csv | latex (default md)")
    add_flag(
        p, "--out", help="where to write the files (default the experiment directory, or ./report)"
    )
    add_flag(p, "--overwrite")
    add_flag(p, "--target-acc")
    p.set_defaults(handler=cmd_report)


def add_commands(sub: Any) -> None:
    """Add ``reproduce``, ``tune`` and ``report`` to the ``pflego`` command's subparsers."""
    add_reproduce(sub)
    add_tune(sub)
    add_report(sub)

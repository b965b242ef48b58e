"""``pflego run``: one experiment, continued with ``--resume`` or repeated over ``--seeds``, and
the two-line :func:`summary` of a finished run that it prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from pflego.cli.compare import finished
from pflego.cli.flags import (
    add_flag,
    add_flags,
    add_run_flags,
    resume_rounds,
    settings_from_args,
    workers_from_args,
)
from pflego.cli.session import Interrupted, interrupted_experiment
from pflego.errors import ConfigError, PflegoError

#: The accuracies the summary prints (with ``participation_gap`` where clients never trained).
CONSOLE_ACCURACIES = (
    "test_acc",
    "test_acc_weighted",
    "test_acc_p10",
    "test_acc_p90",
    "test_acc_std",
)


def summary(history) -> str:
    """Two lines on a finished run: its final evaluation, named as in ``metrics.jsonl``."""
    from pflego.experiments.measures import best_validation

    last = history.records[-1]
    metrics = ", ".join(
        f"{key} {100 * last[key]:.2f}%"
        for key in (*CONSOLE_ACCURACIES, "participation_gap")
        if last.get(key) is not None
    )
    if best := best_validation(history, "test_acc"):
        metrics += f", test_acc {100 * best[1]:.2f}% at the best val_acc (round {best[0]})"
    if last.get("dp_epsilon") is not None:
        metrics += f", dp_epsilon {last['dp_epsilon']:.3g} at dp_delta {last['dp_delta']:g}"
    loss = last.get("train_loss")
    loss_text = f"{loss:.4f}" if loss is not None else "non-finite"
    return (
        f"{last['algorithm']} on {last['dataset']}, final evaluation (round {last['round']}): "
        f"{metrics}, train_loss {loss_text}\n"
        f"run directory {history.run_dir} (metrics.jsonl: every evaluation, "
        "accuracies as fractions in [0, 1])"
    )


def _resumable(out: Path) -> Interrupted:
    return Interrupted(f"interrupted; continue with `pflego run --resume {out}`")


def _start(args: argparse.Namespace, progress: bool) -> Any:
    """A new run of the flags' settings (over ``--nproc`` processes where asked); its history."""
    from pflego.config import load_config, to_dict
    from pflego.experiments.folders import check_out, clear_out, kind_of
    from pflego.history import claim_run_dir, release_run_dir
    from pflego.sim import Profile, build_experiment, default_out, process_age, run, run_experiment
    from pflego.sim.distributed import distributed

    config = load_config(args.config, **settings_from_args(args))
    out = Path(args.out or config.out or default_out(config)).expanduser()
    if kind_of(out) not in (None, "run"):  # a run there is claim_run_dir's to refuse
        check_out(out, "run", args.overwrite)  # an experiment, tuning or report: --overwrite
        clear_out(out)
    distributed_run = distributed(args.nproc)  # --nproc N, or one process torchrun started
    created = None if distributed_run else claim_run_dir(out, to_dict(config), args.overwrite)
    try:
        if distributed_run:
            return run(
                config, out, progress, args.overwrite, args.profile, args.nproc, args.threads
            )
        profile = Profile(startup=process_age()) if args.profile else None
        with profile.part("data") if profile else contextlib.nullcontext():
            experiment = build_experiment(config)
        return run_experiment(experiment, out, progress, profile)
    except KeyboardInterrupt:
        raise _resumable(out) from None
    except PflegoError:
        if created is not None:
            release_run_dir(out, created)  # when it failed before it started
        raise


def cmd_run(args: argparse.Namespace) -> int:
    from pflego.sim import resume

    if args.seeds is not None:
        if args.profile:
            raise ConfigError("--profile times a single run; remove --seeds or --profile")
        if args.nproc is not None:
            raise ConfigError("--nproc spreads a single run; remove --seeds or --nproc")
        return cmd_run_seeds(args)
    progress = not args.quiet
    if args.resume:
        given = [f for f, v in (("--config", args.config), ("--out", args.out)) if v is not None]
        given += ["--overwrite"] * args.overwrite + ["--profile"] * args.profile
        rounds = resume_rounds(args, given, "its config.yaml")
        say = lambda line: print(f"pflego: {line}", file=sys.stderr, flush=True)  # noqa: E731
        try:
            history = resume(
                args.resume, progress, rounds, say, nproc=args.nproc, threads=args.threads
            )
        except KeyboardInterrupt:
            raise _resumable(args.resume) from None
    else:
        history = _start(args, progress)
    if history.run_dir is None:  # a process of a distributed run other than rank 0
        return 0
    print(summary(history))
    if args.profile:
        seconds = json.loads((history.run_dir / "profile.json").read_text())["seconds"]
        print("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()))
    return 0


def cmd_run_seeds(args: argparse.Namespace) -> int:
    """``pflego run --seeds``: the same setting with several seeds, and a report over them."""
    from pflego.experiments.folders import stamp
    from pflego.experiments.reproduce import run_seeds
    from pflego.experiments.seeds import parse_seeds

    settings = settings_from_args(args)
    if getattr(args, "resume", None):
        raise ConfigError("--seeds cannot be combined with --resume")
    if "seed" in settings:
        raise ConfigError("give either --seed or --seeds")
    seeds = parse_seeds(args.seeds)
    root = args.out or Path("runs") / f"{settings.get('algorithm', 'pflego')}-seeds-{stamp()}"
    try:
        report = run_seeds(
            args.config,
            seeds,
            root,
            not args.quiet,
            workers=workers_from_args(args),
            overwrite=args.overwrite,
            **settings,
        )
    except KeyboardInterrupt:
        return interrupted_experiment(
            f"rerun with --out {root} into a new folder, or resume each seed-<s>"
        )
    print(report.summary())
    print(f"\nreport.md, report.csv, report.png and the runs seed-<s>/ in {root}")
    return finished(report)


def add_command(sub: Any) -> None:
    """Add ``run`` to the ``pflego`` command's subparsers."""
    parser = sub.add_parser("run")
    add_run_flags(parser)
    add_flag(
        parser,
        "--resume",
        help="continue a stopped run from its directory; only --rounds may be given with it, "
        "to extend the run (default: start a new run)",
    )
    add_flag(parser, "--overwrite")
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="spread the run over N processes of this machine with torch.distributed (each "
        "trains and evaluates its share of the clients; the numbers are one process's), each "
        "with --threads threads (default there: the cores shared out); for several machines "
        "start `torchrun ... -m pflego run` instead, see docs/distributed.md (default: 1)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write profile.json into the run directory: seconds spent on startup, data, train, "
        "evaluate, checkpoint and the rest",
    )
    add_flag(parser, "--seeds")
    add_flags(parser, "--jobs", "--devices")
    parser.set_defaults(handler=cmd_run)

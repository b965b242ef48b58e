"""The ``pflego bench`` subcommand: its flags and the handler that turns them into a run."""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from pflego.bench.against import AGAINST_ALGORITHMS, AGAINST_MODELS
from pflego.bench.fresh_process import SCALE_CLIENTS
from pflego.bench.report import SPEED_SECTIONS, run_bench

DESCRIPTION = (
    "``pflego bench``: speed, client FLOPs and memory of the simulator, measured in one process."
)


def _handler(args: argparse.Namespace) -> int:
    sections = args.sections
    if args.against == "conventional":
        sections = ["against"]
    elif args.clients > SCALE_CLIENTS and sections is None:
        sections = ["scale"]
    flags = inspect.signature(run_bench).parameters  # run_bench's parameters are the flags
    settings = {k: v for k, v in vars(args).items() if k in flags}
    run_bench(**{**settings, "sections": sections or list(SPEED_SECTIONS)})
    return 0


def add_commands(subparsers: Any) -> None:
    """Add ``bench`` to an argparse subparsers object (its handler returns an exit code)."""
    parser = subparsers.add_parser("bench", description=DESCRIPTION)
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder holding mnist/ (official IDX files) (default: $PFLEGO_DATA, else "
        "~/.cache/pflego/data)",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=100,
        help=f"number of clients I (above {SCALE_CLIENTS:,}: peak memory and seconds per round of "
        "PFLEGO and FedAvg on that many generated clients, 100 and 1,000 per round)",
    )
    parser.add_argument(
        "--participation", type=float, default=0.2, help="fraction of clients per round"
    )
    parser.add_argument(
        "--taus", type=int, nargs="+", default=[5, 25, 50, 100], help="local steps tau to time"
    )
    parser.add_argument(
        "--backend-tau", type=int, default=50, help="full-batch tau of the vmap-vs-loop section"
    )
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per cell")
    parser.add_argument(
        "--memory-clients",
        type=int,
        default=10_000,
        help="population of the peak-memory section",
    )
    parser.add_argument("--out", default="bench.md", help="Markdown file to write")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="use local dataset files even when they do not match the official checksums",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=["backends", "tau", "memory", "against", "scale", "parallel"],
        default=None,
        help="sections to run: backends | tau | memory | against | scale | parallel (default: "
        "backends tau "
        "memory; against with --against, scale with --clients above "
        f"{SCALE_CLIENTS:,})",
    )
    parser.add_argument(
        "--against",
        choices=["conventional"],
        help="compare with benchmarks/conventional.py (deep-copied modules, DataLoader, "
        "torch.optim.SGD) on the same split and seed (default: no comparison)",
    )
    parser.add_argument(
        "--against-rounds", type=int, default=4, help="rounds per comparison (first: warm-up)"
    )
    parser.add_argument(
        "--models", nargs="+", default=list(AGAINST_MODELS), help="models of the comparison"
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=list(AGAINST_ALGORITHMS),
        help="algorithms of the comparison",
    )
    parser.add_argument(
        "--parallel-rounds",
        type=int,
        default=20,
        help="rounds of every run of the parallel section (reproduce main, 2 seeds)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the against section runs both sides, e.g. cuda or cuda:1 (the other sections "
        "run on the CPU)",
    )
    parser.set_defaults(handler=_handler)

"""The ``pflego flower`` commands: ``local`` (a whole deployment on 127.0.0.1, run by
:mod:`pflego.cli.flower_local`), ``simulate`` (Flower's simulation engine on Ray, run by
:mod:`pflego.cli.flower_simulate`), ``certs`` and ``run-config``.

``pflego flower run-config`` writes the TOML run config of an experiment for ``flwr run`` (a
deployment on several machines, ``docs/flower.md``); ``pflego flower certs`` the certificates and
keys of a local deployment with TLS and SuperNode authentication.

This module imports neither flwr nor torch at import time, so ``pflego --help`` works without
the ``flower`` extra.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pflego.cli.flags import (
    add_flag,
    add_flags,
    add_run_flags,
    add_server_flags,
    server_run_config,
)
from pflego.cli.flower_local import cmd_local, flower_config
from pflego.cli.flower_simulate import add_simulate
from pflego.errors import ConfigError


def add_commands(subparsers: Any) -> None:
    """Add the ``flower`` command group (``local``, ``simulate``, ``certs``, ``run-config``) to
    ``subparsers``."""
    flower = subparsers.add_parser("flower")  # its help: pflego.cli.COMMANDS
    commands = flower.add_subparsers(dest="flower_command", metavar="COMMAND")
    add_local(commands)
    add_simulate(commands)
    add_certs(commands)
    add_run_config(commands)
    flower.set_defaults(handler=lambda args: (flower.print_help(), 2)[1])


def add_local(commands: Any) -> None:
    """``pflego flower local``: its flags are those of ``pflego run`` and of the deployment."""
    local = commands.add_parser(
        "local", help="run an experiment on a SuperLink and N SuperNodes on 127.0.0.1"
    )
    add_flag(local, "--nodes")
    add_run_flags(local)
    add_server_flags(local)
    local.add_argument(
        "--sites",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="one SuperNode per folder, each serving its own data (the server loads none) "
        "(default: --nodes partitions of --dataset)",
    )
    local.add_argument(
        "--site-format",
        default="imagefolder",
        choices=("imagefolder", "npz", "csv", "idx"),
        help="format of the --sites data",
    )
    local.add_argument("--label-column", default="label", help="label column of csv sites")
    add_flag(
        local,
        "--resume",
        help="continue the Flower run in DIR after a stop; only --rounds may change "
        "(default: start a new run)",
    )
    add_flag(
        local,
        "--overwrite",
        help="replace the run already in --out (a fresh start; --resume continues it)",
    )
    local.add_argument("--tls", action="store_true", help="TLS between nodes and SuperLink")
    local.add_argument(
        "--auth", action="store_true", help="SuperNode authentication (implies --tls)"
    )
    local.add_argument(
        "--certs",
        type=Path,
        help="folder from `pflego flower certs` (default: fresh ones in the work folder)",
    )
    add_flags(local, "--timeout", "--workdir", "--no-netns")
    local.add_argument("--plan", type=Path, help=argparse.SUPPRESS)  # the re-run in the netns
    local.set_defaults(handler=cmd_local)


def add_certs(commands: Any) -> None:
    """``pflego flower certs``."""
    certs = commands.add_parser(
        "certs", help="generate a CA, a server certificate and SuperNode keys for local use"
    )
    certs.add_argument("--dir", type=Path, required=True, help="folder to write them to (required)")
    certs.add_argument("--nodes", type=int, default=2, help="number of SuperNode key pairs")
    certs.add_argument("--days", type=int, default=30, help="days the certificates are valid")
    certs.add_argument(
        "--server-name",
        action="append",
        metavar="NAME",
        help="host name or IP address the nodes reach the SuperLink by (repeat; default "
        "localhost and 127.0.0.1)",
    )
    certs.set_defaults(handler=cmd_certs)


def add_run_config(commands: Any) -> None:
    """``pflego flower run-config``."""
    run_config = commands.add_parser(
        "run-config",
        help="write the run config (TOML) of an experiment for `flwr run --run-config`",
    )
    add_run_flags(run_config)
    add_server_flags(run_config)
    run_config.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its checkpoint"
    )
    run_config.add_argument(
        "--join-timeout", type=float, default=120.0, help="seconds to wait for the nodes at start"
    )
    run_config.add_argument("--file", type=Path, required=True, help="TOML file to write")
    run_config.set_defaults(handler=cmd_run_config)


def cmd_run_config(args: argparse.Namespace) -> int:
    """Write the TOML run config that ``flwr run <app> <connection> --run-config FILE`` takes."""
    import tomli_w

    from pflego.flower.records import encode_config
    from pflego.flower.unsupported import refuse_unsupported

    config = flower_config(args)
    refuse_unsupported(config, args.secure_aggregation)
    if args.out is None:
        raise ConfigError("--out names the run directory on the server's machine; give it")
    run = {
        "pflego-config": encode_config(config),
        "out": str(Path(args.out).resolve()),
        "round-timeout": float(args.round_timeout),
        "join-timeout": float(args.join_timeout),
        "resume": bool(args.resume),
        **server_run_config(args),
    }
    args.file.write_text(tomli_w.dumps(run))
    print(f"wrote {args.file}: flwr run <app folder> <connection> --run-config {args.file}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    """Write ``ca.crt``, ``server.pem``, ``server.key`` and ``node<k>`` / ``node<k>.pub``."""
    from pflego.flower.certs import LOCAL_NAMES, generate

    if args.nodes < 1:
        raise ConfigError(f"--nodes={args.nodes} must be at least 1")
    creds = generate(args.dir, args.nodes, args.days, args.server_name or LOCAL_NAMES)
    print(
        f"wrote {creds.ca_cert}, {creds.server_cert}, {creds.server_key} and "
        f"{args.nodes} node key pairs in {creds.directory}"
    )
    return 0

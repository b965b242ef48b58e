"""``pflego flower simulate``: an experiment on Flower's simulation engine (Ray).

It checks the experiment as ``pflego run`` would, writes its run config and federation config
(one virtual SuperNode per client, :mod:`pflego.flower.simulation`) into the run directory, runs
it on a SuperLink in simulation mode, inside a private network namespace where the machine allows
(Ray probes outside addresses when it starts), and writes the same run directory as ``pflego
flower local``. ``--dry-run`` writes the two files and prints the ``flwr run`` command only.

This module imports neither flwr, Ray nor torch at import time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Any

from pflego.cli.flags import add_flag, add_flags, add_run_flags, add_server_flags
from pflego.cli.flower_local import (
    FEDERATION_FILE,
    RUN_CONFIG_FILE,
    Plan,
    _require_flower,
    _rerun_in_netns,
    flower_config,
    new_plan,
    run_plan,
)
from pflego.cli.session import Interrupted
from pflego.errors import ConfigError, PflegoError


def add_simulate(commands: Any) -> None:
    """``pflego flower simulate``: the flags of ``pflego run``, of the server and of Ray."""
    simulate = commands.add_parser(
        "simulate",
        help="run an experiment on Flower's simulation engine (Ray; needs pflego[flower-sim])",
    )
    add_flag(
        simulate,
        "--nodes",
        help="number of virtual SuperNodes, one client each (default: --clients)",
    )
    add_run_flags(simulate)
    add_server_flags(simulate)
    simulate.add_argument(
        "--cpus-per-client",
        type=int,
        default=1,
        metavar="N",
        help="CPU cores Ray reserves for each client's ClientApp (default: 1)",
    )
    simulate.add_argument(
        "--gpus-per-client",
        type=float,
        default=0.0,
        metavar="F",
        help="fraction of a GPU Ray reserves for each client, e.g. 0.25 (default: 0, none)",
    )
    simulate.add_argument(
        "--ray-cpus", type=int, metavar="N", help="CPU cores Ray may use (default: every core)"
    )
    simulate.add_argument(
        "--ray-gpus", type=int, metavar="N", help="GPUs Ray may use (default: every visible GPU)"
    )
    add_flag(simulate, "--overwrite", help="replace the run already in --out")
    add_flags(simulate, "--timeout", "--workdir", "--no-netns")
    simulate.add_argument(
        "--dry-run",
        action="store_true",
        help=f"write {RUN_CONFIG_FILE} and {FEDERATION_FILE} into --out and print the `flwr run` "
        "command; start nothing",
    )
    simulate.add_argument("--plan", type=Path, help=argparse.SUPPRESS)  # the re-run in the netns
    simulate.set_defaults(handler=cmd_simulate)


def make_simulation_plan(args: argparse.Namespace) -> Plan:
    """Check the command (config, algorithm, resources, flags), resolve it into a :class:`Plan`
    and write its run config and federation config."""
    from pflego.flower.simulation import Resources, federation_config, write_toml
    from pflego.flower.unsupported import refuse_unsupported

    config = flower_config(args)
    refuse_unsupported(config, args.secure_aggregation)
    resources = Resources(args.cpus_per_client, args.gpus_per_client, args.ray_cpus, args.ray_gpus)
    resources.check(config.device)
    for flag, value in (("--round-timeout", args.round_timeout), ("--timeout", args.timeout)):
        if not value > 0:
            raise ConfigError(f"{flag}={value:g} must be above 0 seconds")
    plan = new_plan(args, config, federation=federation_config(config.clients, resources))
    write_toml(Path(plan.out) / RUN_CONFIG_FILE, plan.run_config())
    write_toml(Path(plan.out) / FEDERATION_FILE, plan.federation)
    return plan


def _require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise PflegoError(
            "Flower's simulation engine needs Ray; install the extra: pip install "
            "'pflego[flower-sim]' (or run on SuperNode daemons: pflego flower local)"
        )


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the experiment on Flower's simulation engine and write its run directory."""
    _require_flower()
    from pflego.flower.deploy import NETNS_MARK, app_dir, netns_available

    if args.plan is not None:  # the re-run inside the network namespace
        from pflego.flower.simulation import in_private_namespace

        if os.environ.get(NETNS_MARK) == "1" and not in_private_namespace():
            raise PflegoError("the re-run meant for a private network namespace is not in one")
        try:
            return run_simulation(Plan.load(args.plan))
        except KeyboardInterrupt:  # the outer command reports it
            raise Interrupted("") from None
    plan = make_simulation_plan(args)
    out = Path(plan.out)
    if args.dry_run:
        print(
            f"wrote {out / RUN_CONFIG_FILE} and {out / FEDERATION_FILE}; start the simulation "
            f"with\n  flwr run {app_dir()} <connection> --run-config {out / RUN_CONFIG_FILE} "
            f"--federation-config {out / FEDERATION_FILE}\nwhere <connection> names a SuperLink "
            "started with `flower-superlink --simulation` (`pflego flower simulate` without "
            "--dry-run does all of it, in a private network namespace where it can)"
        )
        return 0
    _require_ray()
    try:
        if args.netns and os.environ.get(NETNS_MARK) != "1":
            if netns_available():
                print(
                    "pflego: Flower's simulation engine runs in a private network namespace "
                    "(loopback only): Ray cannot reach any other address",
                    flush=True,
                )
                return _rerun_in_netns(plan)
            print(
                "pflego: no private network namespace here (`unshare -n` needs root or user "
                "namespaces); Ray runs on this machine's network and probes outside addresses "
                "when it starts",
                flush=True,
            )
        return run_simulation(plan)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted; every process of the simulation was stopped; the run so far is in {out}"
        ) from None


def run_simulation(plan: Plan) -> int:
    """Start the SuperLink in simulation mode in this process's network namespace, run the
    experiment on Ray's virtual SuperNodes, stop everything."""
    from pflego.flower.simulation import LocalSimulation, reap_namespace

    fed = plan.federation
    started = (
        f" on {fed['num-supernodes']} virtual SuperNodes ({fed['client-resources-num-cpus']} CPU, "
        f"{fed['client-resources-num-gpus']:g} GPU each)"
    )
    try:
        return run_plan(
            plan, lambda workdir, say, stop: LocalSimulation(workdir, fed, say, stop), started
        )
    finally:
        left = reap_namespace()  # what Ray left in this private namespace; a no-op outside one
        if left:
            names = ", ".join(sorted(set(left.values())))
            print(
                f"pflego: ended {len(left)} process(es) left in the private network namespace "
                f"({names})",
                flush=True,
            )

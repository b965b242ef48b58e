"""``pflego flower local``: an experiment on a whole Flower deployment on this machine.

``pflego flower local --nodes N [run flags]`` starts a SuperLink and N SuperNodes (node k holds
partition k; ``--sites DIR ...`` gives each node its own data folder instead), runs the
experiment configured exactly as ``pflego run`` would be, writes the same run directory (plus
``flower.jsonl``, which lists each round's sampled, answered and missing clients, bytes and
seconds per phase), and stops every process it started, also on failure, Ctrl-C or SIGTERM
(exit code 130: the signal only sets a flag that every wait polls). ``--resume DIR`` continues a
run after a stop. Where the machine allows (root or user namespaces), the whole deployment runs
inside a private network namespace that has only a loopback interface.

Everything is checked and resolved into a :class:`Plan` before any daemon starts. This module
imports neither flwr nor torch at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pflego.cli.flags import resume_rounds, server_run_config, settings_from_args
from pflego.cli.run import summary
from pflego.cli.session import Interrupted
from pflego.errors import ConfigError, DivergedError, PflegoError

if TYPE_CHECKING:
    from pflego.config import Config
    from pflego.flower.deploy import LocalDeployment, StopFlag


def _require_flower() -> None:
    if importlib.util.find_spec("flwr") is None:
        raise PflegoError(
            "Flower is not installed; install the extra: pip install 'pflego[flower]'"
        )


#: The launch settings a local run keeps in its run directory, so ``--resume DIR`` restarts the
#: same deployment (and its nodes find their clients' states under ``flower-nodes``).
PLAN_FILE = "flower-local.json"
NODE_STATES = "flower-nodes"
#: The run config and federation config that ``pflego flower simulate`` writes into the run.
RUN_CONFIG_FILE = "flower-run-config.toml"
FEDERATION_FILE = "flower-federation.toml"


@dataclass
class Plan:
    """Everything a local deployment or simulation needs, resolved before any process starts.

    ``federation`` is the federation config of a run on Flower's simulation engine (Ray's virtual
    SuperNodes, ``pflego flower simulate``); ``None`` for SuperNode daemons.
    """

    config: dict[str, Any]
    out: str
    sites: list[dict[str, Any]] | None = None
    run: dict[str, Any] = field(default_factory=dict)  # extra run config (task, SecAgg+)
    tls: bool = False
    auth: bool = False
    certs: str | None = None
    workdir: str | None = None
    round_timeout: float = 120.0
    timeout: float = 3600.0
    resume: bool = False
    federation: dict[str, Any] | None = None

    @property
    def nodes(self) -> int:
        return len(self.sites) if self.sites is not None else int(self.config["clients"])

    def run_config(self) -> dict[str, Any]:
        """The run config of ``flwr run --run-config`` (the app's keys only)."""
        from pflego.config import load_config
        from pflego.flower.records import encode_config

        return {
            "pflego-config": encode_config(load_config(self.config)),
            "out": self.out,
            "round-timeout": float(self.round_timeout),
            "join-timeout": 120.0,
            "state-dir": str(Path(self.out) / NODE_STATES),
            "resume": self.resume,
            **self.run,
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls(**json.loads(path.read_text()))


def site_configs(folders: Sequence[Path], fmt: str, label_column: str) -> list[dict[str, Any]]:
    """Node configs of site folders (named after the folder, or its path when names repeat)."""
    folders = [Path(f).resolve() for f in folders]
    names = [f.name for f in folders]
    unique = len(set(names)) == len(names)
    return [
        {
            "data": str(f),
            "format": fmt,
            "label-column": label_column,
            "site": n if unique else str(f),
        }
        for f, n in zip(folders, names)
    ]


def flower_config(args: argparse.Namespace) -> Config:
    """The experiment's settings, flags over ``--config``, with one client per SuperNode."""
    from pflego.config import load_config

    settings = settings_from_args(args)
    sites = getattr(args, "sites", None)
    nodes = len(sites) if sites else getattr(args, "nodes", None)
    if nodes is not None:
        given = f"--sites gives {nodes} node(s)" if sites else f"--nodes={nodes}"
        if nodes < 1:
            raise ConfigError(f"{given} must be at least 1")
        if "clients" in settings and int(settings["clients"]) != nodes:
            raise ConfigError(
                f"{given} but --clients={settings['clients']}: each SuperNode "
                "holds one client, so give one of them or equal values"
            )
        settings["clients"] = nodes
    return load_config(args.config, **settings)


def check_new_flower_dir(out: Path, overwrite: bool) -> None:
    """Refuse a folder that holds a run unless ``overwrite`` (naming the right ``--resume``)."""
    from pflego.history import RUN_FILES, check_new_run_dir

    started = any((out / name).exists() for name in RUN_FILES)
    if not overwrite and started and (out / PLAN_FILE).is_file():
        raise ConfigError(
            f"{out} already holds a Flower run; continue it with `pflego flower local --resume "
            f"{out}` (add --rounds N to extend it), or pass --overwrite to replace it"
        )
    check_new_run_dir(out, overwrite)


def clear_flower_dir(out: Path) -> None:
    """Remove the files of the run that ``--overwrite`` replaces, the nodes' states included."""
    from pflego.history import RUN_OUTPUTS

    for name in (*RUN_OUTPUTS, "flower.jsonl", PLAN_FILE, RUN_CONFIG_FILE, FEDERATION_FILE):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / NODE_STATES, ignore_errors=True)


def flower_resume_rounds(args: argparse.Namespace) -> int | None:
    """``--rounds`` given with ``--resume``; a setting of the run is refused with one line (as by
    ``pflego run --resume``): the run continues with its ``config.yaml`` and its launch plan."""
    named = (("--config", args.config), ("--out", args.out), ("--nodes", args.nodes))
    named += (("--sites", args.sites), ("--input-shape", args.input_shape))
    named += (("--label-names", args.label_names),)
    given = [flag for flag, value in named if value]
    given += ["--overwrite"] * args.overwrite + ["--secure-aggregation"] * args.secure_aggregation
    return resume_rounds(args, given, f"its config.yaml and {PLAN_FILE}")


def new_plan(args: argparse.Namespace, config: Config, **fields: Any) -> Plan:
    """The plan of a new run of ``config`` in ``--out`` (refused when that holds a run, unless
    ``--overwrite``), with the server's flags; its data is checked before anything starts."""
    from pflego.config import to_dict
    from pflego.sim import build_experiment, default_out

    out = Path(args.out or config.out or default_out(config)).expanduser().resolve()
    check_new_flower_dir(out, args.overwrite)
    if fields.get("sites") is None:
        build_experiment(config)  # fail on a bad config or missing data before anything starts
    if args.overwrite:
        clear_flower_dir(out)
    return Plan(
        to_dict(config),
        str(out),
        run=server_run_config(args),
        workdir=str(Path(args.workdir).resolve()) if args.workdir else None,
        round_timeout=float(args.round_timeout),
        timeout=float(args.timeout),
        **fields,
    )


def make_plan(args: argparse.Namespace) -> Plan:
    """Check the command (config, algorithm, sites, flags) and resolve it into a :class:`Plan`."""
    from pflego.config import load_config, read_yaml, to_dict
    from pflego.flower.unsupported import refuse_unsupported

    if args.resume is not None:
        rounds = flower_resume_rounds(args)
        directory = Path(args.resume).resolve()
        if not (directory / PLAN_FILE).is_file():
            raise ConfigError(f"{directory} holds no Flower run of `pflego flower local` to resume")
        plan = Plan.load(directory / PLAN_FILE)
        config = load_config(read_yaml(directory / "config.yaml"))
        if rounds is not None:
            config = config.replace(rounds=rounds)
        plan.config, plan.resume, plan.out = to_dict(config), True, str(directory)
        refuse_unsupported(config, bool(plan.run.get("secure-aggregation")))
        return plan
    config = flower_config(args)
    refuse_unsupported(config, args.secure_aggregation)
    sites = None
    if args.sites:
        from pflego.flower.sitedata import read_site

        sites = site_configs(args.sites, args.site_format, args.label_column)
        for site in sites:  # one-line errors before any daemon starts (and a warm cache)
            read_site(site["data"], site["format"], site["label-column"])
    certs = str(Path(args.certs).resolve()) if args.certs else None
    return new_plan(args, config, sites=sites, tls=args.tls, auth=args.auth, certs=certs)


def cmd_local(args: argparse.Namespace) -> int:
    """Run the experiment on a local deployment and write its run directory."""
    _require_flower()
    from pflego.flower.deploy import NETNS_MARK, netns_available

    if args.plan is not None:  # the re-run inside the network namespace
        try:
            return run_local(Plan.load(args.plan))
        except KeyboardInterrupt:  # the outer command reports it
            raise Interrupted("") from None
    plan = make_plan(args)
    try:
        if args.netns and os.environ.get(NETNS_MARK) != "1":
            if netns_available():
                return _rerun_in_netns(plan)
            print("pflego: no private network namespace here; the daemons listen on 127.0.0.1 only")
        return run_local(plan)
    except KeyboardInterrupt:
        raise Interrupted(
            "interrupted; every Flower process was stopped; continue the run with "
            f"`pflego flower local --resume {plan.out}`"
        ) from None


def _rerun_in_netns(plan: Plan) -> int:
    """Run the plan again (``pflego flower local|simulate --plan FILE``) inside a new network
    namespace (only loopback) and wait for it.

    Ctrl-C and SIGTERM only set a flag (:func:`~pflego.flower.deploy.stop_on_signals`); the wait
    polls it, passes SIGTERM on to the child (which stops its deployment) and returns 130.
    """
    from pflego.flower.deploy import NETNS_MARK, NETNS_OUTER, netns_command, stop_on_signals

    scratch = Path(tempfile.mkdtemp(prefix="pflego-flower-"))
    plan.save(scratch / "plan.json")
    subcommand = "local" if plan.federation is None else "simulate"
    command = [sys.executable, "-m", "pflego.cli", "flower", subcommand]
    command += ["--plan", str(scratch / "plan.json")]
    env = {**os.environ, NETNS_MARK: "1", NETNS_OUTER: os.readlink("/proc/self/ns/net")}
    source = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    try:
        with stop_on_signals() as stop:
            child = subprocess.Popen(netns_command(command), env=env)
            while child.poll() is None:
                if stop.is_set():
                    with contextlib.suppress(ProcessLookupError):
                        child.send_signal(signal.SIGTERM)
                    try:
                        child.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait()
                    raise KeyboardInterrupt
                stop.wait(0.2)
            return child.returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_local(plan: Plan) -> int:
    """Start the deployment in this process's network namespace, run, stop everything."""
    return run_plan(plan, functools.partial(local_deployment, plan))


@contextlib.contextmanager
def local_deployment(plan: Plan, workdir: Path, say, stop) -> Iterator[LocalDeployment]:
    """The plan's SuperLink and SuperNodes (TLS and authentication as planned), running; the
    plan is saved in the run directory for ``--resume``."""
    from pflego.flower.certs import Credentials, generate
    from pflego.flower.deploy import LocalDeployment

    credentials = None
    if plan.tls or plan.auth or plan.certs is not None:
        credentials = (
            Credentials(Path(plan.certs)) if plan.certs else generate(workdir / "certs", plan.nodes)
        )
    out = Path(plan.out)
    plan.save(out / PLAN_FILE)
    with LocalDeployment(workdir, credentials, plan.auth, say, stop=stop) as deployment:
        deployment.start_nodes(plan.nodes, sites=plan.sites, state_root=out / NODE_STATES)
        yield deployment


def run_plan(
    plan: Plan,
    open_deployment: Callable[[Path, Callable[[str], None], StopFlag], Any],
    started: str = "",
) -> int:
    """Run the plan's experiment on ``open_deployment(workdir, say, stop)`` (a context manager
    whose exit stops every process it started) and print the run's summary."""
    from pflego.flower.deploy import stop_on_signals
    from pflego.history import History

    out = Path(plan.out)
    keep = plan.workdir is not None
    workdir = Path(plan.workdir or tempfile.mkdtemp(prefix="pflego-flower-")).resolve()
    say = lambda line: print(f"pflego: {line}", flush=True)  # noqa: E731
    try:
        out.mkdir(parents=True, exist_ok=True)
        with stop_on_signals() as stop, open_deployment(workdir, say, stop) as deployment:
            run_id = deployment.submit(plan.run_config())
            say(f"run {run_id} started{started}; run directory {out}")
            status = follow(deployment, run_id, out, plan.timeout, say)
            check_completed(deployment, run_id, status, out, workdir)
    except KeyboardInterrupt:  # every process is stopped by now, and there is nothing to keep
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    # on other failures the folder stays: the error names it, for Flower's logs
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    print(summary(History.load(out)))
    return 0


def divergence(out: Path) -> str | None:
    """The one-line message of a run that stopped because it diverged, read from ``flower.jsonl``."""
    path = out / "flower.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return events[-1]["error"] if events and events[-1].get("phase") == "diverged" else None


def check_completed(deployment, run_id: int, status: str, out: Path, workdir: Path) -> None:
    """Raise unless run ``run_id`` completed: ``DivergedError`` with its one line when it diverged,
    else a ``DeploymentError`` with the end of Flower's log."""
    from pflego.flower.deploy import DeploymentError

    if status == "finished:completed":
        return
    diverged = divergence(out)
    if diverged:
        raise DivergedError(diverged)
    raise DeploymentError(
        f"run {run_id} ended as {status!r} (Flower's logs are kept in {workdir}); "
        f"its log:\n{deployment.run_log(run_id)[-4000:]}"
    )


def follow(deployment, run_id: int, out: Path, timeout: float, say) -> str:
    """Wait for the run, echoing each new evaluation and round status as it is logged."""
    seen = {"metrics.jsonl": 0, "flower.jsonl": 0}

    def echo() -> None:
        for name in seen:
            path = out / name
            lines = path.read_text().splitlines() if path.is_file() else []
            for line in lines[seen[name] :]:
                _echo(name, json.loads(line), say)
            seen[name] = max(seen[name], len(lines))

    status = deployment.wait(run_id, timeout, each=echo)
    return status if status.startswith("finished") else f"still {status} after {timeout:g} s"


def _echo(name: str, record: dict[str, Any], say) -> None:
    from pflego.flower.status import status_line

    if name == "metrics.jsonl":
        say(
            f"round {record['round']}: train_loss {record['train_loss']:.4f}, "
            f"test_acc {100 * record['test_acc']:.2f}%"
        )
    elif record.get("phase") == "train":
        say(status_line(record))
    elif record.get("missing"):
        say(f"round {record['round']} {record['phase']}: missing clients {record['missing']}")

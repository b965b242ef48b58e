"""A Flower deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1.

Every Flower process gets ``FLWR_HOME`` (a private directory), ``FLWR_TELEMETRY_ENABLED=0``,
``FLWR_DISABLE_UPDATE_CHECK=1`` and ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``, listens on
127.0.0.1 only, and runs in its own process group; :meth:`LocalDeployment.stop` ends those groups
(SIGTERM, then SIGKILL) and nothing else. Each daemon also dies with the process that started it
(``PR_SET_PDEATHSIG``), so even a killed launcher leaves nothing behind.

To keep all traffic off the network, run the launcher inside a private network namespace (see
:func:`netns_command`): the daemons inherit it and only a loopback interface exists there.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from pflego.errors import PflegoError
from pflego.flower.certs import Credentials

NETNS_MARK = "PFLEGO_IN_NETNS"
#: The network namespace of the launcher that made the private one (``net:[inode]``).
NETNS_OUTER = "PFLEGO_OUTER_NETNS"


class DeploymentError(PflegoError):
    """A daemon did not start, a run failed, or Flower is missing."""


def app_dir() -> Path:
    """The Flower app folder shipped with pflego (a ``pyproject.toml`` only)."""
    return Path(str(resources.files("pflego.flower") / "app"))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound to port 0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every Flower process: a private home, no telemetry, no updates.

    ``PYTHONPATH`` starts with the folder this ``pflego`` was imported from, so the ServerApp
    and ClientApp processes that Flower starts run this same code.
    """
    env = dict(os.environ if base is None else base)
    source = str(Path(__file__).resolve().parents[2])
    env.update(
        FLWR_HOME=str(home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PYTHONPATH=os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
    )
    return env


def netns_available() -> bool:
    """Whether this process may create a private network namespace (``unshare -n``)."""
    try:
        done = subprocess.run(
            ["unshare", "-n", "sh", "-c", "ip link set lo up"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def netns_command(command: Sequence[str]) -> list[str]:
    """``command`` wrapped to run in a new network namespace with only loopback up."""
    quoted = " ".join(shlex.quote(c) for c in command)
    return ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {quoted}"]


def superlink_healthy(port: int, ca_cert: Path | None = None) -> bool:
    """Whether the SuperLink on 127.0.0.1:``port`` answers its health check (HTTPS when given
    the CA that signed its certificate)."""
    scheme, context = "http", None
    if ca_cert is not None:
        scheme, context = "https", ssl.create_default_context(cafile=ca_cert)
    try:
        with urllib.request.urlopen(
            f"{scheme}://127.0.0.1:{port}/health", timeout=2, context=context
        ) as answer:
            return answer.status == 200
    except OSError:
        return False


def node_config_text(values: Mapping[str, Any]) -> str:
    """A ``--node-config`` value: ``key=value`` pairs, strings quoted (TOML values)."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            value = json.dumps(str(value))  # a TOML basic string
        parts.append(f"{key}={value}")
    return " ".join(parts)


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launching process dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class StopFlag(threading.Event):
    """Set by this process's own SIGINT / SIGTERM handler; every long wait polls it.

    The handler only sets the flag, so a signal can never interrupt the launcher halfway through
    a subprocess call or a file write; the waits raise ``KeyboardInterrupt`` at a safe point
    instead, the deployment's context manager stops every process it started, and the command
    exits with 130.
    """

    def sleep(self, seconds: float) -> None:
        """Sleep, or raise ``KeyboardInterrupt`` as soon as a stop is requested."""
        if self.wait(seconds):
            raise KeyboardInterrupt


@contextlib.contextmanager
def _on_signals(handler: Any) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` inside the block (main thread; elsewhere a no-op)."""
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """A :class:`StopFlag` that SIGINT and SIGTERM set (main thread; elsewhere never set)."""
    flag = StopFlag()
    with _on_signals(lambda signum, frame: flag.set()):
        yield flag


def run_command(
    command: Sequence[str], timeout: float, stop: StopFlag | None = None, **popen: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run`` that also ends the child (and raises ``KeyboardInterrupt``) when
    ``stop`` is set; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                stdout, stderr = process.communicate(timeout=0.2)
                return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                if stop is not None:
                    stop.sleep(0)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout) from None
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@dataclass
class Daemon:
    """A process this deployment started, with its log file."""

    process: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Kill its process group (a crash) and wait for it to end."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def tail(self, lines: int = 20) -> str:
        if not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class LocalDeployment:
    """A SuperLink and SuperNodes on 127.0.0.1, with optional TLS and node authentication.

    Use as a context manager: everything started is stopped on exit, also on errors and Ctrl-C.

    Args:
        workdir: Holds ``FLWR_HOME``, the logs, node state and the run-config file.
        credentials: TLS files and node keys (see :mod:`pflego.flower.certs`), or ``None`` for an
            insecure deployment.
        authenticate: Require registered SuperNode keys (needs ``credentials``).
        say: Where progress lines go.
        start_timeout: Seconds a daemon may take to come up.
        stop: A flag that makes every wait raise ``KeyboardInterrupt`` when set.
        extra_env: Environment variables added for every Flower process.
    """

    #: The name of this SuperLink in ``$FLWR_HOME/config.toml`` (``flwr run <app> <connection>``).
    connection = "local-deployment"

    def __init__(
        self,
        workdir: str | Path,
        credentials: Credentials | None = None,
        authenticate: bool = False,
        say: Callable[[str], None] = lambda line: None,
        start_timeout: float = 30.0,
        stop: StopFlag | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        if authenticate and credentials is None:
            raise DeploymentError("SuperNode authentication needs TLS credentials")
        self.workdir = Path(workdir).resolve()
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.credentials = credentials
        self.authenticate = authenticate
        self.say = say
        self.start_timeout = start_timeout
        self.stop_flag = stop or StopFlag()
        self.extra_env = dict(extra_env or {})
        self.port = 0
        self.daemons: list[Daemon] = []
        self.nodes: dict[int, Daemon] = {}
        self.node_commands: dict[int, list[str]] = {}
        self.env: dict[str, str] = {}

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalDeployment:
        try:
            self.start_superlink()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, command: Sequence[str]) -> Daemon:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        with log.open("ab") as handle:  # the child keeps its own copy of the file
            process = subprocess.Popen(
                list(command),
                env=self.env,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509  (only prctl; no locks taken)
            )
        daemon = Daemon(process, log)
        self.daemons.append(daemon)
        return daemon

    def start_superlink(self) -> None:
        """Start the SuperLink on a free loopback port (the same one when it restarts) and wait
        for its health check."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {**flower_env(self.home), **self.extra_env}
        self.port = self.port or free_port()
        self.superlink = self._spawn("superlink", self.superlink_command())
        self.write_cli_config()
        self.wait_healthy(self.superlink)
        self.say(f"SuperLink up on 127.0.0.1:{self.port} (log {self.superlink.log})")

    def superlink_command(self) -> list[str]:
        """The SuperLink's command line: loopback ports, this deployment's database and the
        :meth:`superlink_options`."""
        command = ["flower-superlink", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--database", str(self.workdir / "superlink.db")]
        return [*command, "--disable-runtime-dependency-installation", *self.superlink_options()]

    def superlink_options(self) -> list[str]:
        """Fleet and Control API on loopback; TLS and SuperNode authentication as configured."""
        options = ["--fleet-api-address", f"127.0.0.1:{free_port()}"]
        options += ["--control-api-address", f"127.0.0.1:{free_port()}"]
        c = self.credentials
        if c is None:
            return [*options, "--insecure"]
        options += ["--ssl-ca-certfile", str(c.ca_cert), "--ssl-certfile", str(c.server_cert)]
        options += ["--ssl-keyfile", str(c.server_key)]
        return options + ["--enable-supernode-auth"] * self.authenticate

    def write_cli_config(self) -> None:
        """``$FLWR_HOME/config.toml`` naming this SuperLink :attr:`connection`."""
        connection: dict[str, Any] = {"address": f"127.0.0.1:{self.port}"}
        if self.credentials is None:
            connection["insecure"] = True
        else:
            connection["root-certificates"] = str(self.credentials.ca_cert)
        text = tomli_w.dumps({"superlink": {self.connection: connection}})
        (self.home / "config.toml").write_text(text)

    def wait_healthy(self, daemon: Daemon) -> None:
        """Poll the SuperLink's ``/health`` until it answers (bounded by ``start_timeout``)."""
        ca_cert = self.credentials.ca_cert if self.credentials is not None else None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not daemon.alive:
                raise DeploymentError(f"the SuperLink exited early:\n{daemon.tail()}")
            if superlink_healthy(self.port, ca_cert):
                return
            self.stop_flag.sleep(0.3)
        raise DeploymentError(f"the SuperLink gave no health answer in {self.start_timeout:g} s")

    def start_node(
        self,
        k: int,
        partition: int | None = None,
        partitions: int | None = None,
        key: Path | None | bool = True,
        max_wait: float = 60.0,
        state_dir: Path | None = None,
        node_config: Mapping[str, Any] | None = None,
    ) -> Daemon:
        """Start SuperNode k, holding client ``partition`` of ``partitions`` or the data that
        ``node_config`` names (``data``, ``format``, ``site``, ...).

        Args:
            k: Node index (its log, port and default key).
            partition: Client id i (``partition-id``).
            partitions: Number of clients I (``num-partitions``).
            key: Private key to authenticate with: ``True`` for node k's key when the
                deployment authenticates, a path for another key, ``None``/``False`` for none.
            max_wait: Seconds the node keeps trying to reach the SuperLink.
            state_dir: Where the node saves client states (default ``workdir/state/node<k>``).
            node_config: The node config instead of a partition (site data).
        """
        values = dict(node_config or {"partition-id": partition, "num-partitions": partitions})
        values["state-dir"] = str(state_dir or self.workdir / "state" / f"node{k}")
        command = ["flower-supernode", "--superlink", f"127.0.0.1:{self.port}"]
        command += ["--host", "127.0.0.1", "--port", str(free_port())]
        command += ["--max-wait-time", str(max_wait), "--node-config", node_config_text(values)]
        if self.credentials is None:
            command.append("--insecure")
        else:
            command += ["--root-certificates", str(self.credentials.ca_cert)]
            if key is True and self.authenticate:
                key = self.credentials.node_key(k)
            if isinstance(key, Path):
                command += ["--auth-supernode-private-key", str(key)]
        daemon = self._spawn(f"supernode{k}", command)
        self.nodes[k] = daemon
        self.node_commands[k] = command
        return daemon

    def start_nodes(
        self,
        count: int,
        sites: Sequence[Mapping[str, Any]] | None = None,
        state_root: Path | None = None,
    ) -> None:
        """Register (with authentication) and start SuperNodes: ``count`` holding partitions
        0..count-1, or one per node config of ``sites`` (site data).

        ``state_root`` holds each node's state folder ``node<k>`` (default ``workdir/state``).
        """
        configs = list(sites) if sites is not None else [None] * count
        for k, node_config in enumerate(configs):
            if self.authenticate:  # register its public key with the SuperLink
                public_key = str(self.credentials.node_public_key(k))
                self.flwr(["supernode", "register", public_key, self.connection], timeout=60)
            state = state_root / f"node{k}" if state_root is not None else None
            self.start_node(k, k, count, state_dir=state, node_config=node_config)
        self.say(f"{len(configs)} SuperNodes started (logs in {self.logs})")

    def restart_superlink(self) -> None:
        """Kill the SuperLink with the ServerApp it runs (a server crash) and start it again on
        the same port and database; nodes that gave up meanwhile are restarted."""
        self.superlink.kill()
        self.start_superlink()
        for k, daemon in self.nodes.items():
            if not daemon.alive:
                self.nodes[k] = self._spawn(f"supernode{k}", self.node_commands[k])

    def kill_node(self, k: int) -> None:
        """Kill SuperNode k and the processes it started (a crash, for fault tests)."""
        self.nodes[k].kill()

    def stop(self) -> None:
        """End every process group this deployment started: SIGTERM, wait, then SIGKILL.

        A second Ctrl-C or SIGTERM during the shutdown is ignored, so it always completes.
        """
        with _on_signals(signal.SIG_IGN):
            self._stop()

    def _stop(self) -> None:
        for daemon in self.daemons:
            if daemon.alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for daemon in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for daemon in self.daemons:
            # The group may hold children (ServerApp / ClientApp processes) after its leader left.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(daemon.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.process.wait(timeout=5)

    # --- runs ---------------------------------------------------------------------------------

    def flwr(self, args: Sequence[str], timeout: float = 120.0) -> str:
        """Run the ``flwr`` CLI against this deployment; returns its output."""
        try:
            done = run_command(
                ["flwr", *args],
                timeout,
                self.stop_flag,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            raise DeploymentError(f"flwr {' '.join(args[:2])} took over {timeout:g} s") from None
        if done.returncode != 0:
            raise DeploymentError(
                f"flwr {' '.join(args[:2])} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).strip()[-2000:]}"
            )
        return done.stdout

    def submit(self, run_config: Mapping[str, Any]) -> int:
        """Start a run of the pflego app with ``run_config``; returns the run id."""
        overrides = self.workdir / f"run-config-{time.time_ns()}.toml"
        overrides.write_text(tomli_w.dumps(dict(run_config)))
        run = ["run", str(app_dir()), self.connection, "--run-config", str(overrides)]
        output = self.flwr([*run, "--format", "json", *self.run_options()])
        try:
            answer = json.loads(output[output.index("{") :])
            return int(answer["run-id"])
        except (ValueError, KeyError) as exc:
            raise DeploymentError(f"flwr run gave no run id ({exc}): {output[-2000:]}") from None

    def run_options(self) -> list[str]:
        """Options that ``flwr run`` gets besides the app, the connection and the run config."""
        return []

    def status(self, run_id: int) -> str:
        """The run's status as ``flwr ls`` reports it (for example ``finished:completed``)."""
        output = self.flwr(["ls", self.connection, "--run-id", str(run_id), "--format", "json"])
        answer = json.loads(output[output.index("{") :])
        runs = answer.get("runs", [])
        return str(runs[0].get("status", "unknown")) if runs else "unknown"

    def run_log(self, run_id: int) -> str:
        """The run's log (the ServerApp's output) as the SuperLink keeps it."""
        try:
            return self.flwr(["log", str(run_id), self.connection, "--show"], timeout=60)
        except DeploymentError as exc:
            return str(exc)

    def wait(self, run_id: int, timeout: float, each: Callable[[], None] = lambda: None) -> str:
        """Wait until the run finishes (or ``timeout`` passes), calling ``each`` after every look
        at its status; returns its last status."""
        deadline = time.monotonic() + timeout
        status = "unknown"
        while time.monotonic() < deadline:
            status = self.status(run_id)
            each()
            if status.startswith("finished"):
                return status
            if not self.superlink.alive:
                raise DeploymentError(f"the SuperLink exited:\n{self.superlink.tail()}")
            self.stop_flag.sleep(2.0)
        return status

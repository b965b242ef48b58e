"""Flower's simulation engine on this machine: a SuperLink in simulation mode and Ray's virtual
SuperNodes, running the same ServerApp and ClientApp as a deployment.

:class:`LocalSimulation` starts ``flower-superlink --simulation`` on free loopback ports with a
private ``FLWR_HOME`` whose ``config.toml`` names it ``local-simulation``; a run is then
``flwr run <pflego app> local-simulation --run-config RUN.toml --federation-config FED.toml``.
For each run the SuperLink's SuperExec starts ``flwr-simulation``, which runs the ServerApp
(:data:`pflego.flower.apps.server_app`) and, on Ray, one virtual SuperNode per client: node k has
the node config ``partition-id=k num-partitions=N``, so it serves client k of the run's
partition, as SuperNode k of ``pflego flower local`` does. Ray actors run the ClientApp
(:data:`pflego.flower.apps.client_app`) for whichever node a message is for; a node's
``context.state`` travels with the message, and its client states are also saved under the run
config's ``state-dir``.

Ray probes addresses off the machine when it starts (a DNS look-up, 8.8.8.8), whatever its
settings. Run the launcher inside a private network namespace (:func:`pflego.flower.deploy.
netns_command`); :func:`reap_namespace` then ends every process left in that namespace (Ray's
daemons detach from their parents), and only there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from pflego.errors import ConfigError
from pflego.flower.deploy import NETNS_OUTER, LocalDeployment, StopFlag


@dataclass(frozen=True)
class Resources:
    """What Ray gives each virtual SuperNode and the whole simulation.

    Args:
        cpus_per_client: CPU cores a ClientApp actor reserves (Ray runs
            ``ray_cpus // cpus_per_client`` clients at once).
        gpus_per_client: Fraction of a GPU each actor reserves (0: none; 0.5: two share one).
        ray_cpus: CPU cores Ray may use (``None``: Ray's default, every core).
        ray_gpus: GPUs Ray may use (``None``: Ray's default, every visible GPU).
    """

    cpus_per_client: int = 1
    gpus_per_client: float = 0.0
    ray_cpus: int | None = None
    ray_gpus: int | None = None

    def check(self, device: str = "cpu") -> None:
        """Refuse settings Ray could not run, in one line."""
        if self.cpus_per_client < 1:
            raise ConfigError(f"--cpus-per-client={self.cpus_per_client} must be at least 1")
        if not self.gpus_per_client >= 0:  # NaN too
            raise ConfigError(f"--gpus-per-client={self.gpus_per_client:g} must be at least 0")
        if self.ray_cpus is not None and self.ray_cpus < self.cpus_per_client:
            raise ConfigError(
                f"--ray-cpus={self.ray_cpus} leaves no room for one client of "
                f"--cpus-per-client={self.cpus_per_client}"
            )
        if self.ray_gpus is not None and self.ray_gpus < 0:
            raise ConfigError(f"--ray-gpus={self.ray_gpus} must be at least 0")
        if device.startswith("cuda") and self.gpus_per_client <= 0:
            raise ConfigError(
                f"--device {device} needs --gpus-per-client above 0 (Ray hides the GPUs from "
                "actors that reserve none), e.g. --gpus-per-client 0.5"
            )


def federation_config(nodes: int, resources: Resources) -> dict[str, Any]:
    """The federation config (``flwr run --federation-config``) of a simulation: ``nodes``
    virtual SuperNodes on Ray with ``resources``."""
    values: dict[str, Any] = {
        "num-supernodes": int(nodes),
        "backend": "ray",
        "client-resources-num-cpus": int(resources.cpus_per_client),
        "client-resources-num-gpus": float(resources.gpus_per_client),
        "init-args-logging-level": "WARNING",
        "init-args-log-to-driver": True,
    }
    if resources.ray_cpus is not None:
        values["init-args-num-cpus"] = int(resources.ray_cpus)
    if resources.ray_gpus is not None:
        values["init-args-num-gpus"] = int(resources.ray_gpus)
    return values


def write_toml(path: Path, values: Mapping[str, Any]) -> Path:
    """Write ``values`` as a TOML file (a run config or a federation config)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(dict(values)))
    return path


def simulation_env(ray_tmp: Path) -> dict[str, str]:
    """Environment for Ray: a new local Ray instance (never a cluster named by ``RAY_ADDRESS``
    or one found in the default temporary folder) with its files under ``ray_tmp`` (a short
    path: Ray's Unix sockets live there), no usage statistics, no uv hook."""
    return {
        "RAY_ADDRESS": "",  # empty counts as unset for Ray
        "RAY_TMPDIR": str(ray_tmp),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    }


class LocalSimulation(LocalDeployment):
    """A SuperLink in simulation mode on 127.0.0.1 (no SuperNode daemons: Ray's virtual ones).

    A context manager, with the arguments of :class:`~pflego.flower.deploy.LocalDeployment` and
    ``federation``, the federation config of every run (:func:`federation_config`). Ray's files
    go to a short temporary folder, removed on exit.
    """

    connection = "local-simulation"

    def __init__(
        self,
        workdir: str | Path,
        federation: Mapping[str, Any],
        say=lambda line: None,
        stop: StopFlag | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="pflego-ray-"))
        env = {**simulation_env(self.ray_tmp), **(extra_env or {})}
        super().__init__(workdir, say=say, stop=stop, extra_env=env, start_timeout=60.0)
        self.federation = dict(federation)

    def stop(self) -> None:
        """Stop every process this simulation started and remove Ray's temporary files."""
        super().stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def superlink_options(self) -> list[str]:
        """Simulation mode, with no Fleet API."""
        return ["--insecure", "--simulation"]

    def run_options(self) -> list[str]:
        """The federation config, as a file (``--federation-config FED.toml``)."""
        path = write_toml(self.workdir / f"federation-{time.time_ns()}.toml", self.federation)
        return ["--federation-config", str(path)]


def _net_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def in_private_namespace() -> bool:
    """Whether this process runs in the private network namespace its launcher made: one other
    than the launcher's (``$PFLEGO_OUTER_NETNS``) with no interface but loopback."""
    own, outer = _net_namespace("self"), os.environ.get(NETNS_OUTER)
    if own is None or not outer or own == outer:
        return False
    return all(name == "lo" for _, name in socket.if_nameindex())


def namespace_processes() -> list[int]:
    """The other processes of this process's network namespace, if it is a private one.

    Returns none unless :func:`in_private_namespace`, so it never names a process outside the
    namespace that this process's launcher made.
    """
    if not in_private_namespace():
        return []
    own = _net_namespace("self")
    ancestors, pid = set(), os.getpid()
    while pid > 1 and pid not in ancestors:
        ancestors.add(pid)
        fields = _stat(pid)
        pid = int(fields[1]) if len(fields) > 1 else 0
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ancestors:
            continue
        if _net_namespace(entry.name) == own and _stat(entry.name)[:1] not in (["Z"], []):
            found.append(int(entry.name))  # zombies are gone already, only not yet reaped
    return found


def process_name(pid: int) -> str:
    """The command name of a process (``raylet``), or ``?`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def reap_namespace(grace: float = 5.0) -> dict[int, str]:
    """End every other process of this private network namespace (SIGTERM, then SIGKILL after
    ``grace`` seconds); returns those that were still there, by PID with their names. A no-op
    outside a private one."""
    left = {pid: process_name(pid) for pid in namespace_processes()}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and namespace_processes():
            time.sleep(0.1)
        if not namespace_processes():
            break
    return left

"""One run across processes, GPUs and machines with torch.distributed.

- ``run(config, out, nproc=N)`` and ``resume(run_dir, nproc=N)`` start N processes on this
  machine through torch's elastic launcher (rendezvous on 127.0.0.1); ``nproc`` 1 (or ``None``)
  is the one-process simulator.
- ``torchrun [--nnodes ...] -m pflego run ...``: every process torchrun starts is one rank
  (:func:`~pflego.sim.group.launched_by_torchrun`); ``run`` and ``resume`` then run that rank.

Every process runs the same round loop over the same server state, and computes the numbers one
process would: random streams are keyed by (seed, round, client), so a client trains identically on
any rank. A client's state lives in one process, its owner (``client % world``), so that the store,
and the memory it takes, is split between the processes. In a round each process trains the cohort
members it owns with the usual backend; their uploads, weights, metrics and finiteness flags (and,
for an algorithm that ``mix``es, their new states) are all-gathered in cohort order, and every
process then runs the identical server step and ``mix`` and stores the new states of its own
clients. Evaluation is split the same way (unseen clients too), its rows are all-gathered in client
order and every process summarizes them identically. ``population_metrics`` and checkpoints see the
whole store, gathered into rank 0, which alone writes the run directory; a checkpoint is the
one-process simulator's, so it resumes under any number of processes.

Rank 0 holds the run directory: it claims it or checks the resumption, reads the checkpoint and
writes every file; the other ranks need the data, not the run directory (on several machines only
rank 0's machine has it). gloo carries CPU tensors and NCCL CUDA ones; with ``--device cuda`` each
process takes the GPU of its local rank.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.distributed.elastic.multiprocessing.errors import record

from pflego.algorithms import Algorithm
from pflego.config import Config, load_config, to_dict
from pflego.errors import ConfigError, PflegoError
from pflego.history import History, RunDir, check_new_run_dir, claim_run_dir, release_run_dir
from pflego.sim import checkpoints
from pflego.sim.backends_auto import AutoBackend
from pflego.sim.build import Experiment, build_experiment
from pflego.sim.clients import ClientStore
from pflego.sim.group import Group, check_nproc, launched_by_torchrun
from pflego.sim.guards import Updates, finite_states
from pflego.sim.profile import Profile
from pflego.sim.rounds import Simulation
from pflego.tree import Params
from pflego.types import ClientOut, ClientState, RoundContext

Announce = Callable[[str], None]
#: The loggers of torch's elastic agent whose warnings a local launch leaves out.
AGENT_LOGS = ("agent.server.api", "multiprocessing.api")
UPLOAD, METRIC, STATE, WEIGHT, FINITE = "upload:", "metric:", "state:", "weight", "finite"


@dataclass(frozen=True)
class Job:
    """One run as every rank receives it.

    Attributes:
        out: The run directory (on rank 0's machine).
        settings: A new run's config (``to_dict``); a resumed run's, once prepared.
        resume: Continue the run in ``out`` (``settings`` come from it).
        rounds: With ``resume``: extend the run to this many rounds.
        overwrite: Replace a run that ``out`` already holds.
        progress: Show rank 0's progress bar.
        profile: Write rank 0's ``profile.json``.
        plot: Draw ``curves.png`` at the end (a second or so; sweeps and tests may skip it).
        prepared: The run directory is claimed, or the resumption checked (:func:`prepare`).
        checkpointed: Prepared: ``out`` holds a checkpoint to continue from.
    """

    out: str
    settings: dict[str, Any] | None = None
    resume: bool = False
    rounds: int | None = None
    overwrite: bool = False
    progress: bool = True
    profile: bool = False
    plot: bool = True
    prepared: bool = False
    checkpointed: bool = False


def distributed(nproc: int | None) -> bool:
    """Whether a run with ``nproc`` processes runs across processes (checked first)."""
    check_nproc(nproc)
    return launched_by_torchrun() or (nproc or 1) > 1


def run(
    config: Config | dict[str, Any] | str | Path | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    profile: bool | Profile = False,
    nproc: int | None = None,
    threads: int | None = None,
    **overrides: Any,
) -> History:
    """Run one experiment and write its directory, in this process or across ``nproc`` local
    processes (or torchrun's); every ``nproc`` gives the one-process numbers (up to the order of
    sums).

    Args:
        config: A ``Config``, a dict of settings, a YAML path, or ``None`` for the defaults.
        out: The run directory (default ``config.out`` or ``runs/<algorithm>-<dataset>-<time>``).
        progress: Show a progress bar.
        overwrite: Replace a run that ``out`` already holds (otherwise a ``ConfigError``).
        profile: Write ``profile.json`` (seconds spent on data, train, evaluate, checkpoint and
            the rest) into the run directory; a :class:`Profile` also counts what came before.
        nproc: Processes (1 or ``None``: this one).
        threads: Torch threads of each process (default: :func:`default_threads`).
        **overrides: Settings that replace those in ``config``.

    Returns:
        The run's :class:`History`.
    """
    several = distributed(nproc)
    cfg = load_config(config, **overrides)
    out = Path(out or cfg.out or checkpoints.default_out(cfg)).expanduser()
    if several:
        job = Job(
            str(out), to_dict(cfg), overwrite=overwrite, progress=progress, profile=bool(profile)
        )
        return run_job(job, nproc, threads=threads)
    timer = profile if isinstance(profile, Profile) else Profile()
    check_new_run_dir(out, overwrite)
    with timer.part("data"):
        experiment = build_experiment(cfg)
    return checkpoints.run_experiment(experiment, out, progress, timer if profile else None)


def resume(
    run_dir: str | Path,
    progress: bool = True,
    rounds: int | None = None,
    announce: Announce | None = None,
    nproc: int | None = None,
    threads: int | None = None,
) -> History:
    """Continue a stopped run from its last checkpoint; the result equals an uninterrupted run.

    A run stopped before its first checkpoint (nothing trained yet) starts again from round 0.
    Checkpoints hold every client's state, so a checkpoint written under any number of processes
    resumes under any other.

    Args:
        run_dir: The run directory.
        progress: Show a progress bar.
        rounds: Extend the run to this many rounds in all (the only setting that may change).
        announce: Called with one line that says what is resumed (for the command line).
        nproc: Processes (1 or ``None``: this one).
        threads: Torch threads of each process (default: :func:`default_threads`).
    """
    if distributed(nproc):
        job = Job(str(run_dir), resume=True, rounds=rounds, progress=progress)
        return run_job(job, nproc, announce, threads)
    plan = checkpoints.plan_resume(run_dir, rounds, announce)
    experiment = build_experiment(plan.config)
    if plan.state is None:
        return checkpoints.run_experiment(experiment, run_dir, progress)
    simulation = Simulation(experiment, plan.directory)
    checkpoints.load_state(simulation, plan.state, plan.directory.checkpoint)
    checkpoints.reopen(plan.directory, simulation, experiment, experiment.environment())
    return simulation.run(progress)


def run_job(
    job: Job, nproc: int | None, announce: Announce | None = None, threads: int | None = None
) -> History:
    """Under torchrun, this process's rank of ``job``; else prepare it here and launch it on
    ``nproc`` processes of ``threads`` threads each."""
    if launched_by_torchrun():
        return run_ranks([job], announce)[0]
    job, created = prepare(job, nproc or 1, announce)
    try:
        return launch([job], nproc or 1, threads)[0]
    except PflegoError:
        if not job.resume:
            release_run_dir(job.out, created)  # when it failed before it started
        raise


def prepare(job: Job, world: int, announce: Announce | None = None) -> tuple[Job, bool]:
    """Claim a new run's directory, or check a resumption (and write its extended config).

    Returns:
        The prepared job, and whether its folder was created (see ``release_run_dir``).
    """
    if job.prepared:
        return job, False
    if job.resume:
        plan = checkpoints.plan_resume(job.out, job.rounds, announce)
        check_settings(plan.config, world)
        settings, checkpointed = to_dict(plan.config), plan.state is not None
        return replace(job, settings=settings, prepared=True, checkpointed=checkpointed), False
    cfg = load_config(job.settings)
    check_settings(cfg, world)
    created = claim_run_dir(job.out, to_dict(cfg), job.overwrite)
    return replace(job, settings=to_dict(cfg), prepared=True), created


def check_settings(config: Config, world: int) -> None:
    """Refuse a run that cannot be spread over ``world`` processes, in one line."""
    device = torch.device(config.device)
    if world > 1 and device.type == "cuda" and device.index is not None:
        raise ConfigError(
            f"--device {config.device} names one GPU, but {world} processes need one each: "
            "use --device cuda (each process takes the GPU of its local rank)"
        )


def default_threads(nproc: int) -> int:
    """Torch threads of each of ``nproc`` local processes: the cores shared out, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 1) // nproc))


def launch(jobs: Sequence[Job], nproc: int, threads: int | None = None) -> list[History]:
    """Run ``jobs`` one after another on ``nproc`` processes of this machine.

    Each job is prepared here first (:func:`prepare`). The processes are started once, through
    torch's elastic launcher with a rendezvous on 127.0.0.1, and run ``threads`` torch threads
    each (default: :func:`default_threads`). A script that calls this needs the
    ``if __name__ == "__main__":`` guard of Python's ``spawn`` start method.

    Returns:
        Rank 0's history of each job.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_nproc(nproc)
    jobs = [prepare(job, nproc)[0] for job in jobs]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"pflego-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    quiet = [logging.getLogger(f"torch.distributed.elastic.{name}") for name in AGENT_LOGS]
    levels = [log.level for log in quiet]
    for log in quiet:  # their warnings on Ctrl-C ("Received 2 death signal...") add nothing
        log.setLevel(logging.ERROR)
    try:
        results = elastic_launch(config, rank_entry)(list(jobs), threads or default_threads(nproc))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise RuntimeError(f"process {rank} of {nproc} failed: {failure_line(failure)}") from None
    except SignalException:
        raise KeyboardInterrupt from None
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    first = results[0]
    if isinstance(first, BaseException):
        raise first
    return first


def failure_line(failure: Any) -> str:
    """One line of a failed process's error (the traceback is in its own output)."""
    message = failure.message
    if isinstance(message, dict):  # the error file of @record: message and call stack
        message = message.get("message", "")
    return " ".join(str(message).split()) or f"exit code {failure.exitcode}"


@record
def rank_entry(jobs: list[Job], threads: int) -> list[History] | PflegoError:
    """What each launched process runs: the jobs, or the ``PflegoError`` that stopped them (every
    rank stops with the same one)."""
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, stop_quietly)
    try:
        return run_ranks(jobs)
    except PflegoError as exc:
        return exc
    except KeyboardInterrupt:  # held by a block that writes state, raised at its end
        raise SystemExit(130) from None


def stop_quietly(signum: int, frame: Any) -> None:
    """Ctrl-C in a launched process: exit with code 130 (cleanup blocks run) and ignore the
    launcher's own SIGINT that follows the terminal's; the launcher reports the interruption."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(130)


def run_ranks(jobs: Sequence[Job], announce: Announce | None = None) -> list[History]:
    """This process's rank of each job, in a process group joined once."""
    group = Group.start("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return [run_rank(job, group, announce) for job in jobs]
    finally:
        group.close()


def run_rank(job: Job, group: Group, announce: Announce | None = None) -> History:
    """One rank of a job: build the experiment, start or load the run, run it."""
    created: list[bool] = []

    def ready() -> Job:  # on rank 0
        prepared, made = prepare(job, group.world, announce)
        created.append(made)
        return prepared

    job = group.decided(ready)
    try:
        return run_prepared(job, group)
    except PflegoError:
        if group.first and created and not job.resume:
            release_run_dir(job.out, created[0])  # when it failed before it started
        raise


def run_prepared(job: Job, group: Group) -> History:
    """One rank of a prepared job. Each step that may fail with a one-line error runs on every
    rank together, so that all stop with it rather than wait for the one that stopped."""
    cfg = load_config(job.settings)
    profile = Profile()
    with profile.part("data"):
        experiment = group.together(lambda: built(cfg, group))

    def simulation_of_rank() -> tuple[RunDir | None, ShardedSimulation]:
        run_dir = RunDir(job.out) if group.first else None
        return run_dir, ShardedSimulation(experiment, run_dir, group, profile)

    run_dir, simulation = group.together(simulation_of_rank)
    simulation.plots = job.plot
    if job.checkpointed:
        simulation.load_from_first(run_dir, Path(job.out) / "checkpoint.pt")
    environment = experiment.environment() | {"processes": group.world, "backend": group.backend}

    def open_run() -> None:  # on rank 0
        if run_dir is None:
            return
        if job.checkpointed:
            checkpoints.reopen(run_dir, simulation, experiment, environment)
        else:
            with profile.part("data"):
                config = to_dict(experiment.config)
                run_dir.start(config, experiment.partition_summary(), environment)

    group.together(open_run)
    history = simulation.run(job.progress and group.first)
    if run_dir is not None and job.profile:
        run_dir.write_profile(simulation.profile_summary())
    return history


def built(config: Config, group: Group) -> Experiment:
    """The experiment, on the GPU of this process's local rank for ``--device cuda``."""
    if torch.device(config.device).type == "cuda":
        count = torch.cuda.device_count()
        if group.local_rank >= count:
            raise ConfigError(
                f"process {group.local_rank} on this machine has no GPU of its own ({count} "
                "found): start at most one process per GPU"
            )
        torch.cuda.set_device(group.local_rank)
    return build_experiment(config)


class ShardedSimulation(Simulation):
    """A :class:`Simulation` whose clients are shared out among the processes of ``group``.

    Rank 0 gets the run directory and writes it; the others write nothing. ``auto`` probes on
    every process, which then agree on one backend (:meth:`AutoBackend.agree`).
    """

    def __init__(
        self,
        experiment: Experiment,
        run_dir: RunDir | None,
        group: Group,
        profile: Profile | None = None,
    ) -> None:
        self.group = group
        super().__init__(experiment, run_dir if group.first else None, profile)
        self.speaks = group.first
        ctx = self.context(0)
        first_visit = self.init_state(
            0, self.one_downlink(self.downlink(ctx, np.zeros(1, np.int64)), 0, 0), ctx
        )
        #: Clients keep no state (FedAvg...): a round's members are shared out by their position
        #: in the cohort, evenly, rather than by owner.
        self.stateless = not first_visit and not self.algorithm.mixes
        #: Whether the processes still have to agree on ``auto``'s backend.
        self.agreeing = isinstance(self.backend, AutoBackend)

    def owned(self, clients: np.ndarray) -> np.ndarray:
        return self.group.owned(clients)

    def states(self, clients: np.ndarray, downlink: Params, ctx: RoundContext) -> ClientState:
        """The cohort's states; none when clients keep none (the store's flags are the owners')."""
        return {} if self.stateless else super().states(clients, downlink, ctx)

    # --- a round ----------------------------------------------------------------------------

    def updates(self, t: int, ctx: RoundContext, cohort: np.ndarray) -> Updates:
        """Train this process's share of the cohort: the members it owns, or every world-th
        member when clients keep no state; gather everyone's uploads (and, when the algorithm
        mixes, new states) in cohort order."""
        owners = self.group.owner(cohort)
        trainers = np.arange(len(cohort)) % self.group.world if self.stateless else owners
        share = np.flatnonzero(trainers == self.group.rank)
        keep_states = self.algorithm.mixes or self.stateless  # (stateless: checked to be none)
        states: ClientState = {}
        part: dict[str, Tensor] = {}
        error = None
        try:
            if len(share):
                out, states = self.client_updates(t, ctx, cohort, share)
                part = packed(out, states if keep_states else {}, finite_states(states, share))
        except PflegoError as exc:  # raised on every rank, by the gathering
            error = exc
        out, finite, gathered = unpacked(self.group.rows(part, trainers, self.device, error))
        if self.agreeing:
            auto = self.backend
            self.agreeing = not auto.agree(self.group.all_objects(auto.report_for_group))
        if self.stateless:
            if gathered:
                raise RuntimeError(
                    f"{self.cfg.algorithm}'s clients start without a state but return one; "
                    "a distributed run cannot share them out by position"
                )
            return Updates(cohort, out, {}, np.flatnonzero(owners == self.group.rank), finite)
        if self.algorithm.mixes:
            return Updates(cohort, out, gathered, np.arange(len(cohort)), finite)
        return Updates(cohort, out, states, share, finite)

    # --- evaluation -------------------------------------------------------------------------

    def gather_rows(self, own_rows: Callable[[], list[dict]], order: np.ndarray) -> list[dict]:
        try:
            rows, error = own_rows(), None
        except PflegoError as exc:  # raised on every rank
            rows, error = [], exc
        parts = self.group.all_objects((rows, error))
        raised = [e for _, e in parts if e is not None]
        if raised:
            raise raised[0]
        by_client = {row["client"]: row for part, _ in parts for row in part}
        return [by_client[int(i)] for i in order]

    def population_summary(self) -> dict[str, float]:
        """``population_metrics`` on rank 0 over the gathered store, sent to every rank."""
        if type(self.algorithm).population_metrics is Algorithm.population_metrics:
            return super().population_summary()  # nothing about the population: no gathering
        whole = self.store_state()

        def summary() -> dict[str, float]:  # on rank 0
            store = ClientStore(self.exp.data.num_clients)
            store.load_state_dict(whole)
            metrics = self.algorithm.population_metrics(self.server, store.tensors)
            return {k: float(v) for k, v in metrics.items()}

        return self.group.decided(summary)

    # --- persistence ------------------------------------------------------------------------

    def store_state(self) -> dict[str, Any] | None:
        """The whole store in the one-process format on rank 0 (``None`` elsewhere)."""
        parts = self.group.to_first(self.store.state_dict())
        return merged_store(parts) if parts is not None else None

    def checkpoint(self, wait: bool = False) -> None:
        """Gather the store into rank 0, which writes the checkpoint (every rank takes part)."""
        with self.profile.part("checkpoint"):
            state = self.state_dict()
            if self.writer:
                self.writer.submit(state)
                if wait:
                    self.writer.wait()

    def on_interrupt(self) -> None:
        """Ctrl-C reaches the processes at different moments, so none can gather a consistent
        store: the last scheduled checkpoint is kept (its writing is waited for)."""
        if self.writer:
            self.writer.wait()

    def load_from_first(self, directory: RunDir | None, checkpoint: Path) -> None:
        """Rank 0 reads the checkpoint; every rank gets the server state and the log, and its own
        clients' states."""
        parts: list[dict[str, Any]] = []

        def read() -> dict[str, Any]:
            state = directory.load_checkpoint()
            try:
                store = state.pop("store")
                parts.extend(split_store(store, self.group.world, self.exp.data.num_clients))
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError):
                raise ConfigError(
                    f"{checkpoint} does not fit this run (its client store); start a new run"
                ) from None
            return state

        common = self.group.decided(read)
        mine = self.group.from_first(parts if self.group.first else None)
        self.group.together(
            lambda: checkpoints.load_state(self, {**common, "store": mine}, checkpoint)
        )


def packed(out: ClientOut, states: ClientState, finite: Tensor) -> dict[str, Tensor]:
    """One flat dict of a share's uploads, weights, metrics, finiteness flags and states."""
    return {
        **{UPLOAD + k: v for k, v in out.upload.items()},
        **{METRIC + k: v for k, v in out.metrics.items()},
        **{STATE + k: v for k, v in states.items()},
        WEIGHT: out.weight,
        FINITE: finite,
    }


def unpacked(joined: dict[str, Tensor]) -> tuple[ClientOut, Tensor, ClientState]:
    """The gathered cohort's ``ClientOut``, finiteness flags (host) and states."""

    def prefixed(prefix: str) -> dict[str, Tensor]:
        return {k[len(prefix) :]: v for k, v in joined.items() if k.startswith(prefix)}

    out = ClientOut(prefixed(UPLOAD), joined[WEIGHT], prefixed(METRIC))
    return out, joined[FINITE].cpu(), prefixed(STATE)


def split_store(state: dict[str, Any], world: int, num_clients: int) -> list[dict[str, Any]]:
    """A checkpoint's store split into each rank's own clients (``client % world``)."""
    visited = state["visited"]
    initialized = state.get("initialized", visited)
    if "rows" in state:
        rows, tensors = state["rows"], state["tensors"]
    else:  # full tables (older checkpoints)
        rows = torch.nonzero(initialized).flatten()
        tensors = {k: v[rows] for k, v in state["tensors"].items()}
    if len(initialized) != num_clients:
        raise ValueError(f"the store holds {len(initialized)} clients, not {num_clients}")
    owner, everyone = rows % world, torch.arange(num_clients) % world
    return [
        {
            "rows": rows[owner == r],
            "tensors": {k: v[owner == r] for k, v in tensors.items()},
            "visited": visited & (everyone == r),
            "initialized": initialized & (everyone == r),
        }
        for r in range(world)
    ]


def merged_store(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' stores as one, in the one-process format (rows in increasing order)."""
    rows = torch.cat([p["rows"] for p in parts])
    order = torch.argsort(rows)
    keys = dict.fromkeys(k for p in parts for k in p["tensors"])
    tensors = {k: torch.cat([p["tensors"][k] for p in parts if k in p["tensors"]]) for k in keys}
    return {
        "rows": rows[order],
        "tensors": {k: v[order] for k, v in tensors.items()},
        "visited": torch.stack([p["visited"] for p in parts]).any(0),
        "initialized": torch.stack([p["initialized"] for p in parts]).any(0),
    }

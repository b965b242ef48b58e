"""One process's part of a simulation spread over a torch.distributed group.

Every process runs the same round loop over the same server state. A client's state lives in one
process, its owner (``client % world``), so that the store, and the memory it takes, is split
between the processes. In a round each process trains the cohort members it owns with the usual
backend; their uploads, weights, metrics and finiteness flags (and, for an algorithm that
``mix``es, their new states) are all-gathered in cohort order, and every process then runs the
identical server step and ``mix`` and stores the new states of its own clients. Evaluation is
split the same way (unseen clients too), its rows are all-gathered in client order and every
process summarizes them identically. ``population_metrics`` and checkpoints see the whole store,
gathered into rank 0, which alone writes the run directory; a checkpoint is the one-process
simulator's, so it resumes under any number of processes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pflego.algorithms import Algorithm
from pflego.errors import ConfigError, PflegoError
from pflego.history import RunDir
from pflego.sim.backends_auto import AutoBackend
from pflego.sim.build import Experiment
from pflego.sim.checkpoints import load_state
from pflego.sim.clients import ClientStore
from pflego.sim.group import Group
from pflego.sim.guards import Updates, finite_states
from pflego.sim.profile import Profile
from pflego.sim.rounds import Simulation
from pflego.tree import Params
from pflego.types import ClientOut, ClientState, RoundContext

UPLOAD, METRIC, STATE, WEIGHT, FINITE = "upload:", "metric:", "state:", "weight", "finite"


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
        self.group.together(lambda: load_state(self, {**common, "store": mine}, checkpoint))


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

"""Evaluation inside the round loop: which clients and when, how they personalize first, the
unseen clients, and the ``metrics.jsonl`` record (the metrics themselves: :mod:`pflego.sim.metrics`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import reduce
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from pflego import tree
from pflego.config import Config
from pflego.history import snapshot
from pflego.rng import adapt_rng, seed_for
from pflego.sim.clients import ClientPool, Cohort
from pflego.sim.guards import deferred_interrupts
from pflego.sim.metrics import Personalization, client_rows
from pflego.sim.summary import participation_gap, summarize
from pflego.types import ClientData, Downlink, RoundContext


class Evaluation:
    """The evaluation half of :class:`~pflego.sim.rounds.Simulation` (its attributes: ``cfg``,
    ``exp``, ``algorithm``, ``server``, ``store``, the pools, ``records``...)."""

    def personalization(
        self, completed: int, unseen: bool = False, clients: np.ndarray | None = None
    ) -> Personalization | None:
        """How clients personalize before the evaluation after ``completed`` rounds.

        The evaluation names clients by their position in ``clients`` (by default, their ids).
        """
        if not (unseen or self.algorithm.adapts):
            return None
        pool = (self.unseen_pools if unseen else self.pools)["train"]
        plan = self.algorithm.adapt_schedule(self.run_schedule)
        if unseen and self.cfg.join_epochs is not None:  # e.g. PGFed's new clients: 20 epochs
            plan = plan._replace(local_epochs=self.cfg.join_epochs)
        offset = self.exp.data.num_clients if unseen else 0

        def cohort(ids: np.ndarray) -> Cohort:
            rng = lambda i, stream: adapt_rng(self.cfg.seed, completed, i + offset, stream)  # noqa: E731
            return pool.cohort(ids if clients is None else clients[ids], plan, rng)

        def clients_of(ids: np.ndarray) -> list[ClientData]:
            chunk = cohort(ids)
            return [chunk.client(j) for j in range(len(chunk))]

        return Personalization(
            "join" if unseen else "adapt",
            lambda ids: cohort(ids).data,
            self.context(completed),
            clients_of,
            fused=self.backend_name != "loop",  # loop: the autograd reference, also here
        )

    def evaluate(self, completed: int) -> dict[str, Any]:
        """Evaluate every client (or the fixed sample ``eval_clients``), and every unseen client,
        and log one record."""
        with self.profile.part("evaluate"), self.calibrated(completed):
            summary, rows = self.evaluate_population(completed)
            summary |= self.population_summary()
            if self.unseen_pools is not None:
                unseen_summary, unseen_rows = self.evaluate_unseen(completed)
                summary |= unseen_summary | participation_gap(summary | unseen_summary)
                rows += unseen_rows
        record = evaluation_record(self.cfg, completed, summary, self.seconds)
        if self.algorithm.adapts:
            record["adapted"] = True
        if len(self.eval_ids) < self.exp.data.num_clients:
            record["eval_clients"] = len(self.eval_ids)
        if self.cfg.eval_train_samples is not None:
            record["eval_train_samples"] = self.cfg.eval_train_samples
        if self.privacy is not None:
            record |= self.privacy.record(completed)
        record["dropped"] = self.dropped
        with deferred_interrupts():
            self.records.append(record)
            self.dropped = []
            if self.run_dir:
                self.run_dir.log(record, rows)
        return record

    @contextmanager
    def calibrated(self, completed: int) -> Iterator[None]:
        """Within it, the server state is the algorithm's ``calibrate`` of every training
        client's ``statistics`` (the evaluation downlink over its whole training split, summed),
        for an algorithm that calibrates (CCVR); the server's own state comes back after."""
        if not self.algorithm.calibrates:
            yield
            return
        ctx, ids = self.context(completed), np.arange(self.exp.data.num_clients)
        downlink = self.algorithm.send(self.server, ctx, torch.as_tensor(ids), evaluation=True)
        rng = lambda i, stream: adapt_rng(self.cfg.seed, completed, i, stream)  # noqa: E731
        clients = self.pools["train"].cohort(ids, self.run_schedule, rng)
        parts = (
            self.algorithm.statistics(downlink.of(c), clients.client(c), ctx)
            for c in range(len(ids))
        )
        own = self.server
        self.server = self.algorithm.calibrate(own, reduce(tree.add, parts), ctx)
        try:
            yield
        finally:
            self.server = own

    def evaluate_population(self, completed: int) -> tuple[dict[str, float], list[dict]]:
        """Rows of the evaluated clients; a client whose state did not change since its last
        evaluation keeps its row when the server state did not change either and nothing
        personalizes at evaluation (the numbers would be the same)."""
        ctx, ids = self.context(completed), self.owned(self.eval_ids)

        def own_rows() -> list[dict]:
            missing = self.store.missing(ids)
            if len(missing):  # first-visit states from the round's downlink
                self.initialize(missing, self.downlink(ctx, missing), ctx)
            stale = ids
            if not self.algorithm.adapts:
                unchanged = self.eval_server is not None and same_values(
                    self.server, self.eval_server
                )
                known = np.array([int(i) in self.eval_rows for i in ids], dtype=bool)
                if unchanged:
                    stale = ids[self.store.changed[torch.as_tensor(ids)].numpy() | ~known]
                self.eval_server = snapshot(self.server)
            for row in self.client_rows(stale, completed, ctx):
                self.eval_rows[row["client"]] = row
            self.store.changed[torch.as_tensor(stale, dtype=torch.int64)] = False
            return [self.eval_rows[int(i)] for i in ids]

        rows = self.gather_rows(own_rows, self.eval_ids)
        return summarize(rows), rows

    def owned(self, clients: np.ndarray) -> np.ndarray:
        """Those of ``clients`` whose states this process holds and evaluates: all of them (a
        process of a distributed run holds its share)."""
        return clients

    def gather_rows(self, own_rows: Callable[[], list[dict]], order: np.ndarray) -> list[dict]:
        """The evaluation rows that ``own_rows()`` makes in every process, joined in the order of
        the client ids ``order`` (one process makes them all)."""
        return own_rows()

    def population_summary(self) -> dict[str, float]:
        """The algorithm's ``population_metrics`` over every client's stored state."""
        population = self.algorithm.population_metrics(self.server, self.store.tensors)
        return {k: float(v) for k, v in population.items()}

    def client_rows(self, clients: np.ndarray, completed: int, ctx: RoundContext) -> list[dict]:
        """Evaluation rows of ``clients``: on the pools as they are when that is every client,
        else on pools of just them (a generated population always)."""
        if len(clients) == 0:
            return []
        keep = self.train_subsample if self.cfg.eval_train_samples is not None else None
        pools = self.eval_pools
        if len(clients) < self.exp.data.num_clients or not isinstance(self.train_pool, ClientPool):
            pools = {
                split: pool.select(clients, keep if split == "train" else None)
                for split, pool in self.pools.items()
            }
        first = self.algorithm.send(self.server, ctx, torch.as_tensor(clients[:1]), True)

        def downlink_for(ids: np.ndarray) -> Downlink:
            if not first.per_client:
                return first
            return self.algorithm.send(self.server, ctx, torch.as_tensor(clients[ids]), True)

        rows = client_rows(  # moves the states to the device chunk by chunk
            self.algorithm,
            downlink_for,
            self.store.read(clients),
            pools,
            self.personalization(completed, clients=clients),
            self.cfg.chunk_size,
            counts={"train": self.train_pool.sizes[clients]} if keep else None,
        )
        for row in rows:
            row["client"] = int(clients[row["client"]])
        return rows

    def evaluate_unseen(self, completed: int) -> tuple[dict[str, float], list[dict]]:
        """Clients that never trained join from their first-visit state with ``join``.

        They receive the newcomer's downlink (``downlink`` without client ids); their states are
        built for this evaluation only. Metrics carry the prefix ``unseen_``.
        """
        ctx = self.context(completed)
        offset, count = self.exp.data.num_clients, self.exp.unseen.num_clients
        mine = self.owned(np.arange(offset, offset + count)) - offset
        payload = self.algorithm.evaluation_downlink(self.server, ctx)
        host = tree.to(payload, "cpu")
        newcomer = self.algorithm.received(payload)
        downlink_for = lambda ids: newcomer.sent_to(len(ids))  # noqa: E731

        def own_rows() -> list[dict]:
            if not len(mine):
                return []
            states = tree.stack(self.init_state(offset + int(j), host, ctx) for j in mine)
            pools = self.unseen_pools
            if len(mine) < count:
                pools = {split: pool.select(mine) for split, pool in pools.items()}
            rows = client_rows(
                self.algorithm,
                downlink_for,
                states,
                pools,
                self.personalization(completed, unseen=True, clients=mine),
                self.cfg.chunk_size,
            )
            for row in rows:
                row["client"] = offset + int(mine[row["client"]])
                row["unseen"] = 1
            return rows

        rows = self.gather_rows(own_rows, np.arange(offset, offset + count))
        return summarize(rows, "unseen_"), rows

    def should_evaluate(self, completed: int) -> bool:
        return evaluation_due(self.cfg, completed)


def evaluation_sample(config: Config, num_clients: int) -> np.ndarray:
    """The clients every evaluation covers: all, or ``eval_clients`` of them drawn once."""
    count = config.eval_clients
    if count is None or count >= num_clients:
        return np.arange(num_clients)
    rng = np.random.default_rng(seed_for(config.seed, 9))
    return np.sort(rng.choice(num_clients, count, replace=False))


def same_values(a: Any, b: Any) -> bool:
    """Whether two nested dicts and lists of tensors hold the same structure and values."""
    (left, structure), (right, other) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    return structure == other and all(
        isinstance(y, Tensor) and torch.equal(x, y) if isinstance(x, Tensor) else x == y
        for x, y in zip(left, right, strict=True)
    )


def evaluation_due(config: Config, completed: int) -> bool:
    """Evaluate every ``eval_every`` rounds, at each of the last ``average_last`` and at the end."""
    return (
        completed % config.eval_every == 0
        or completed > config.rounds - config.average_last
        or completed == config.rounds
    )


def evaluation_record(
    config: Config, completed: int, summary: dict[str, float], seconds: float
) -> dict[str, Any]:
    """One line of ``metrics.jsonl``."""
    return {
        "round": completed,
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        **summary,
        "seconds": round(seconds, 3),
    }

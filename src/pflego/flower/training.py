"""A Flower server's training round: the transports of the engine's round, plain or SecAgg+.

Each sampled client's node gets the downlink and the round's ``RoundContext``; the uploads that
arrived within ``round_timeout`` seconds go, in client order, to the algorithm's ``server_round``
(or are summed with SecAgg+, :mod:`.secure`). The engine scales the cohort size by the realized
response rate ``q̂ = |answered| / |sampled|`` (why this keeps PFLEGO's shared-parameter step
unbiased: :mod:`pflego.flower`); a round with no answer changes nothing. An answer whose upload
(checked on the server) or new state (checked on the node) is not finite is dropped like a
missing one and logged as ``dropped``. Under central differential privacy the server clips and
noises the aggregate itself; under ``dp_local`` each node clips and noises its own upload.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pflego.flower.records import client_out_from_record
from pflego.flower.secure import cohort_factor, run_protocol, secure_outs
from pflego.flower.status import timed
from pflego.sim.backends import stack_outs
from pflego.sim.guards import Updates
from pflego.types import ClientState, RoundContext, ServerState

if TYPE_CHECKING:
    from pflego.flower.server import FlowerServer

log = logging.getLogger("pflego.flower")


class PlainTransport:
    """The round's uploads, each sent in the clear: the node checks its upload and new state,
    the engine checks the upload again on the server."""

    def __init__(self, rounds: FlowerServer, phases: dict[str, float]) -> None:
        self.rounds, self.phases = rounds, phases
        self.event: dict[str, Any] = {}
        self.trained = 0.0

    def answered(self, t: int, answered: list[int], missing: dict[int, str]) -> None:
        """Log and record who answered and who is missing, and why."""
        self.rounds.note_missing(t, "train", missing)
        self.event |= {"answered": answered, "missing": {str(c): w for c, w in missing.items()}}
        self.trained = time.perf_counter()

    def updates(self, t: int, ctx: RoundContext, cohort: np.ndarray) -> Updates | None:
        rounds = self.rounds
        with timed(self.phases, "downlink"):
            contents = rounds.contents([int(c) for c in cohort], ctx)
        with timed(self.phases, "train"):
            replies, missing = rounds.exchange(contents, "train", f"train-{t}")
        answered = sorted(replies)
        self.answered(t, answered, missing)
        if not answered:
            log.warning("round %d: no client answered; the server state is unchanged", t)
            return None
        outs = stack_outs([client_out_from_record(replies[c].content["out"]) for c in answered])
        finite = torch.tensor([bool(replies[c].content["pflego"]["finite"]) for c in answered])
        return Updates(np.array(answered, np.int64), outs, {}, np.zeros(0, np.int64), finite)

    def commit(self, server: ServerState, clients: np.ndarray, states: ClientState) -> None:
        """Keep the new server state (client states stay on the nodes)."""
        self.rounds.server = server
        self.phases["aggregate"] = round(time.perf_counter() - self.trained, 4)


class SecureTransport(PlainTransport):
    """The round's sum through SecAgg+ (see :mod:`.secure`), as a pseudo-cohort of the answering
    clients whose aggregate is the secure one."""

    def updates(self, t: int, ctx: RoundContext, cohort: np.ndarray) -> Updates | None:
        rounds, members = self.rounds, self.rounds.population.members
        scale = float(max(members[c].n_train for c in cohort))  # M
        with timed(self.phases, "downlink"):
            reachable = [int(c) for c in cohort if c in rounds.nodes]
            instructions = {
                rounds.nodes[c]: (
                    {k: dict(v) for k, v in rounds.client_records(c, ctx).items()},
                    payload,
                )
                for c, payload in zip(reachable, rounds.payloads(reachable, ctx))
            }
        with timed(self.phases, "train"):
            result = run_protocol(
                rounds.secure, rounds.grid, t, instructions, scale, rounds.round_timeout
            )
        client_of = {rounds.nodes[c]: c for c in reachable}
        answered = sorted(client_of[n] for n in result.answered if n in client_of)
        missing = {
            int(c): "no node holds this client"
            if c not in rounds.nodes
            else "failed, timed out or dropped out of secure aggregation"
            for c in cohort
            if c not in answered
        }
        self.answered(t, answered, missing)
        if result.mean is None or not answered:
            log.warning(
                "round %d: secure aggregation gave no sum (it needs at least 2 answering "
                "clients); the server state is unchanged",
                t,
            )
            self.event["answered"] = []
            return None
        metrics = [result.answered[rounds.nodes[c]] for c in answered]
        out, counts = secure_outs(result, metrics, scale, rounds.dtype)
        real = ctx.realized(len(cohort), len(answered))
        self.note_bound(
            t, cohort_factor(rounds.algorithm, out.weight, counts, real), scale, metrics
        )
        everyone = torch.ones(len(answered), dtype=torch.bool)
        return Updates(np.array(answered, np.int64), out, {}, np.zeros(0, np.int64), everyone)

    def note_bound(
        self, t: int, factor: float, scale: float, metrics: list[dict[str, Any]]
    ) -> None:
        """Record the round's SecAgg+ error bound (the aggregate is ``factor`` times the sum of
        ``len(metrics)`` answers of weight scale M = ``scale``) and warn of clipped entries."""
        secure = self.rounds.secure
        bound = abs(factor) * len(metrics) * scale * secure.step
        clipped = sum(int(m["clipped"]) for m in metrics)
        if clipped:
            log.warning(
                "round %d: %d uploaded entries exceeded secagg-clipping-range=%g and were "
                "clipped; raise it",
                t,
                clipped,
                secure.clipping_range,
            )
        self.rounds.secure_errors.append(bound)
        self.event["secagg"] = {"step": secure.step, "error_bound": bound, "clipped": clipped}

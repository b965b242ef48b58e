"""The data types that flow between the round loop and an algorithm."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pflego.tree import Params

ClientState = dict[str, Tensor]
ServerState = dict[str, Params]


class Schedule(NamedTuple):
    """How many local steps a client takes and on how many samples each.

    Attributes:
        inner_steps: Number of steps (when ``local_epochs`` is unset).
        batch_size: Samples per step, or ``None`` for the whole local set every step.
        local_epochs: Passes over the local set instead of a fixed step count (with minibatches,
            ``ceil(epochs * n / batch_size)`` steps; full batch, ``ceil(epochs)`` steps).
    """

    inner_steps: int
    batch_size: int | None = None
    local_epochs: float | None = None

    def phase(self, steps: int | None = None, epochs: float | None = None) -> Schedule:
        """A schedule of this batch size and its own length: ``epochs`` passes over the local
        set, else ``steps`` steps, else this schedule's own length (an algorithm's named phase)."""
        if epochs is not None:
            return Schedule(self.inner_steps, self.batch_size, float(epochs))
        if steps is not None:
            return Schedule(int(steps), self.batch_size, None)
        return self


class ClientData(NamedTuple):
    """One client's data for a round, as tensors (stacked with a leading cohort axis under vmap).

    Attributes:
        x: Inputs ``[n, ...]``, padded to the cohort's largest client in the vectorized backend.
        y: Labels ``[n]`` in the algorithm's label space (global ids, or local ids for personal heads).
        mask: ``[n]``, 1 for real samples and 0 for padding.
        batches: ``[S, B]`` indices into ``x``: the minibatch of each local step.
        batch_mask: ``[S, B]``, 1 for real entries; a step whose row is all zero does nothing.
            Padding steps come first, so the last step is real for every client.
        label_mask: ``[K]``, 1 for the logits this client's head really has (personal heads are
            padded to K_max), all ones for a shared head.
        num_samples: Scalar N_i, the client's number of training samples.
        schedules: The algorithm's extra named schedules (``Algorithm.schedules``), each an
            ``(batches, batch_mask)`` pair laid out like ``batches`` / ``batch_mask``.
        validation: For an algorithm with ``uses_validation``, the client's validation split
            (``val_fraction`` of its training data, held out): ``x``, ``y`` (same label space)
            and ``mask`` (padding 0), or its training split when the run has no validation split.
            Empty otherwise.
    """

    x: Tensor
    y: Tensor
    mask: Tensor
    batches: Tensor
    batch_mask: Tensor
    label_mask: Tensor
    num_samples: Tensor
    schedules: dict[str, tuple[Tensor, Tensor]] = {}
    validation: dict[str, Tensor] = {}

    def using(self, name: str) -> ClientData:
        """The same data with the named extra schedule as its minibatch schedule."""
        batches, batch_mask = self.schedules[name]
        return self._replace(batches=batches, batch_mask=batch_mask)


class ClientOut(NamedTuple):
    """What a client sends back.

    Attributes:
        upload: The pseudo-gradient (``w_global - w_local``) or gradient the server descends along.
        weight: The client's aggregation weight (N_i, or alpha_i = N_i / N for PFLEGO).
        metrics: Scalars for logging, such as the local training loss.
    """

    upload: Params
    weight: Tensor
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class RoundContext:
    """What the maths needs to know about the population in round ``round``.

    Attributes:
        round: Round index t (0-based).
        num_clients: Population size I.
        cohort_size: Cohort size r: I * p for Bernoulli participation (its expectation), the
            round's own draw r_t for ``uniform-count`` sampling (see ``Simulation.context``).
        total_samples: N, training samples over ALL clients (alpha_i = N_i / N).
        client_lr: The client step size (beta) this round.
        server_lr: The server step size (rho_t) this round.
        seed: The run's seed, for server-side draws that must follow it (pFedMe's choice of
            which clients' models the server mixes); the simulator and Flower pass the same.
    """

    round: int
    num_clients: int
    cohort_size: float
    total_samples: int
    client_lr: float
    server_lr: float
    seed: int = 0

    @property
    def inverse_inclusion(self) -> float:
        """I / r, the inverse of every client's probability of being sampled."""
        return self.num_clients / self.cohort_size

    def realized(self, sampled: int, kept: int) -> RoundContext:
        """This context with the cohort size scaled by the share of sampled clients ``kept``.

        Used when some sampled clients' updates are lost (a failed node, a non-finite update):
        if losses do not depend on which client is lost, the scaled (I/r) keeps the expected
        step of the clients that remain equal to the full cohort's.
        """
        if kept == sampled:
            return self
        return replace(self, cohort_size=self.cohort_size * kept / sampled)


@dataclass(frozen=True)
class Downlink:
    """What the server sends a round's clients: one ``payload`` for all of them, or
    (``per_client``) one per client, stacked on axis 0 in the order the clients were asked for.

    Attributes:
        payload: The shared payload, or the stacked per-client payloads.
        per_client: Whether ``payload`` holds one payload per client.
    """

    payload: Params
    per_client: bool = False

    def of(self, position: int) -> Params:
        """The payload of the client at ``position`` among those asked for."""
        if not self.per_client:
            return self.payload
        return {k: v[position] for k, v in self.payload.items()}

    def select(self, positions: Sequence[int] | np.ndarray) -> Downlink:
        """The downlink of the clients at ``positions`` among those asked for, in that order."""
        if not self.per_client:
            return self
        index = torch.as_tensor(np.asarray(positions, dtype=np.int64))
        return Downlink({k: v[index.to(v.device)] for k, v in self.payload.items()}, True)

    def sent_to(self, count: int) -> Downlink:
        """This downlink's payload, one client's (as a newcomer receives it), sent to ``count``
        clients: stacked for each of them when the algorithm sends per client (a view, no
        copy), shared as it is otherwise."""
        if not self.per_client:
            return self
        return Downlink({k: v.expand(count, *v.shape) for k, v in self.payload.items()}, True)

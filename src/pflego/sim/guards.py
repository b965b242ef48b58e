"""What keeps a run's state whole: Ctrl-C held while state is written, the checks that stop a
run whose updates or server parameters stop being finite or whose training loss explodes, and a
round's updates as they are checked (:class:`Updates`)."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from pflego import tree
from pflego.errors import DivergedError
from pflego.types import ClientOut, ClientState, RoundContext, ServerState


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends, so a state update is never half written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def step_sizes(ctx: RoundContext) -> str:
    return f"client_lr={ctx.client_lr:g}, server_lr={ctx.server_lr:g}"


def every_update_non_finite(t: int, ctx: RoundContext) -> DivergedError:
    """The error of a round in which no client's update was finite."""
    return DivergedError(
        f"every sampled client's update was non-finite in round {t} ({step_sizes(ctx)}); "
        "lower the step sizes (the run directory keeps the last good checkpoint)"
    )


def check_finite_server(server: ServerState, t: int, ctx: RoundContext) -> None:
    """Stop the run (``DivergedError``) when the server's parameters are no longer finite."""
    if not tree.all_finite(server["params"]):
        raise DivergedError(
            f"the server's parameters became non-finite in round {t} ({step_sizes(ctx)}); "
            "lower the step sizes (the run directory keeps the last good checkpoint)"
        )


#: A run diverged when its training loss exceeds this many times its scale ...
DIVERGENCE_FACTOR = 100.0
#: ... at this many consecutive evaluations.
DIVERGENCE_EVALUATIONS = 2


def divergence_threshold(first_loss: float | None, classes: int) -> float:
    """The training loss above which an evaluation counts towards divergence.

    It is ``DIVERGENCE_FACTOR`` (100) times the larger of the run's first evaluated training loss
    and ``log(classes)``, the cross-entropy of a uniform guess over the head's classes. Why:

    * A trained classifier's loss lies below a uniform guess's; 100 x log C (230 for 10
      classes, 69 for 2) means the true class gets probability e^-230 on average: the logits
      have blown up. No run that learns passes it, while the explosions seen here pass it
      within a few evaluations (issue 25: 0.69 to 7.4e5 by round 10, a factor 1e6).
    * The ``log C`` floor keeps a run that starts with a small loss (a warm start, a model
      whose initial guess is already good) from being stopped by a factor of its tiny first
      value; the ratio keeps the rule meaningful for losses that do not start near ``log C``.
    * 100 rather than 1000: either stops every explosion seen here (they grow by 1e5 and more),
      and 100 stops them two evaluations sooner, before hours of a GPU run are spent on them.

    Args:
        first_loss: The run's first evaluated training loss (round 0: the initial model), or
            ``None`` before it is known.
        classes: Width of the head (C); below 2 there is no chance level and only the ratio
            applies.

    Returns:
        The threshold; ``inf`` when ``first_loss`` is unknown or not finite (the rule does not
        apply).
    """
    if first_loss is None or not math.isfinite(first_loss):
        return math.inf
    chance = math.log(classes) if classes >= 2 else 0.0
    return DIVERGENCE_FACTOR * max(first_loss, chance)


def loss_diverged(
    losses: Sequence[float], threshold: float, evaluations: int = DIVERGENCE_EVALUATIONS
) -> bool:
    """Whether the last ``evaluations`` training losses all exceed ``threshold``.

    Requiring consecutive evaluations lets a run whose loss spikes once and recovers go on. A
    NaN loss does not count (non-finite parameters and updates have their own checks); an
    infinite one does.
    """
    recent = losses[-evaluations:] if evaluations > 0 else []
    return len(recent) == evaluations > 0 and all(loss > threshold for loss in recent)


def loss_exploded(
    first_loss: float, loss: float, completed: int, ctx: RoundContext
) -> DivergedError:
    """The error of a run whose training loss grew past :func:`divergence_threshold`."""
    return DivergedError(
        f"the training loss grew from {first_loss:.4g} to {loss:.4g} by round {completed} "
        f"({step_sizes(ctx)}); lower the step sizes, or --set divergence=warn to train on "
        "(the run directory keeps its last checkpoint)"
    )


def finite_rows(*stacked: dict[str, Tensor]) -> Tensor:
    """``[C]`` booleans: which clients' stacked tensors are all finite."""
    leaves = [v for t in stacked for v in t.values()]
    if not leaves:
        return torch.ones(0, dtype=torch.bool)
    return torch.stack([finite_by_row(v.reshape(v.shape[0], -1)) for v in leaves]).all(0).cpu()


def finite_by_row(matrix: Tensor) -> Tensor:
    """``[C]`` booleans: which rows of a ``[C, n]`` tensor are all finite.

    A row's sum is finite only when all of its entries are (a NaN or an infinity makes it NaN or
    infinite), and summing reads the row once without the boolean copy that ``isfinite`` writes
    (several times faster); only when some sum is not finite (an entry is not, or a finite row
    overflowed) are the entries themselves checked.
    """
    if not (matrix.is_floating_point() or matrix.is_complex()):  # integers are finite
        return torch.ones(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    sums = matrix.sum(1)
    if bool(torch.isfinite(sums).all()):
        return torch.ones(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    return torch.isfinite(matrix).all(1)


@dataclass(frozen=True)
class Updates:
    """A round's client updates as this process holds them.

    Attributes:
        clients: The ids of the members that answered (the whole cohort in a simulation), in
            cohort order.
        out: Their uploads, weights and metrics, in that order.
        states: The new states of the members at positions ``held`` (stacked in that order).
        held: Positions in ``clients`` of the rows of ``states``: all of them in one process; a
            process of a distributed run holds the states of the clients it owns; none when the
            states stay with the clients (Flower).
        finite: ``[C]`` booleans, whether each member's new state is finite.
    """

    clients: np.ndarray
    out: ClientOut
    states: ClientState
    held: np.ndarray
    finite: Tensor

    def kept(self, keep: np.ndarray) -> Updates:
        """The updates of the members where ``keep`` holds, at their positions among them."""
        index = torch.from_numpy(np.flatnonzero(keep))
        out = pytree.tree_map(lambda v: v[index.to(v.device)], self.out)
        held = keep[self.held]
        renumbered = (np.cumsum(keep) - 1)[self.held[held]]
        states = rows(self.states, np.flatnonzero(held))
        return Updates(
            self.clients[keep], out, states, renumbered, self.finite[torch.from_numpy(keep)]
        )


def finite_states(states: ClientState, clients: np.ndarray) -> Tensor:
    """``[C]`` booleans: which of the ``clients``' stacked new states are finite."""
    return finite_rows(states) if states else torch.ones(len(clients), dtype=torch.bool)


def rows(stacked: dict[str, Tensor], positions: np.ndarray) -> dict[str, Tensor]:
    """The rows at ``positions`` of stacked tensors (on their devices)."""
    index = torch.from_numpy(np.asarray(positions, np.int64))
    return {k: v[index.to(v.device)] for k, v in stacked.items()}

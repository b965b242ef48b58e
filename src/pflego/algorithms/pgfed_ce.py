"""PGFed-CE: PGFed with the a_i gradient's model term computed on the server.

Luo, Mendieta, Chen, Wu. "PGFed: Personalize Each Client's Global Objective for Federated
Learning". ICCV 2023; arXiv:2212.01448 (Appendix D).

PGFed (see :mod:`pflego.algorithms.pgfed`), except that the interaction term of Eq. 11,
``g_alpha^(2) = mu g_j^T theta_i``, is evaluated at the global model for the whole round (Eq. 16
with theta_i ~ theta_glob), so the server, which holds every g_j and theta_glob, computes it:
each of the S_i local steps moves a_ij by ``-lambda (g1_j + mu g_j^T theta_glob)``. The client sends
nothing for its a_i steps but their count. Traffic: 2 vectors down (theta_glob, g~_i), 2 up
(theta_i, g_i), the paper's 2x FedAvg; PGFed's third vector (its iterate sum; the paper's
g-bar download) is the one saved.

Symbols to code as in PGFed. With theta_i = theta_glob throughout the round (client step size 0),
PGFed-CE and PGFed give the same A. Deliberate differences: those of PGFed (the exact per-j term
by default, ``alpha_gradient="mean"`` for the paper's average). A newcomer joins as in PGFed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego.algorithms.base import register
from pflego.algorithms.pgfed import PGFed


@register("pgfed-ce")
@dataclass(frozen=True)
class PGFedCE(PGFed):
    # its own study's choice (docs/defaults.md), stable over the leaderboard preset's 100 rounds
    default_client_lr: ClassVar[float] = 0.3

    def iterate_statistic(self, iterates):
        """Nothing: the server evaluates the a_i gradient at theta_glob."""
        return {}

    def iterate_sums(self, server, upload):
        """``S_i theta_glob``: the round's S_i steps, each at the global model."""
        steps = upload["steps"]
        return {
            k: steps.reshape(-1, *[1] * v.dim()) * v.unsqueeze(0)
            for k, v in server["params"].items()
        }

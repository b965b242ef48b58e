"""FedProx: FedAvg with a proximal term toward the global model in every local objective.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. "Federated Optimization in Heterogeneous
Networks". MLSys 2020; arXiv:1812.06127.

Each sampled client approximately minimizes h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2 from
w^t by local steps, so each step descends grad F_k(w) + mu (w - w^t); the server averages the
local models weighted by N_k (server SGD with lr 1 on the pseudo-gradients w^t - w_k). With
mu = 0 it is FedAvg, step for step.

Symbols to code: w -> all of ``body.*`` and ``head.*`` (shared, a C-way head), w^t -> the
downlink, mu -> ``mu``, the local solver's step size -> ``ctx.client_lr``.

Differences: the paper tunes mu per dataset; the default 0.01 is a starting point for tuning
(the PFLEGO reference code's default is 0, which is FedAvg). Every client runs its full local schedule (the paper's variable local
work of stragglers, gamma-inexact solutions, is not simulated). The logged loss is F_k's, without
the proximal term's value (as Ditto's and pFedMe's), so that it compares with FedAvg's.

Unseen clients (``join``): nothing; they predict with the global model (``join_epochs`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, setting
from pflego.types import ClientData, ClientOut, RoundContext


@register("fedprox")
@dataclass(frozen=True)
class FedProx(Algorithm):
    mu: float = setting(0.01, "strength mu of the proximal term", non_negative)

    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train(downlink, data, ctx, anchor=downlink, strength=self.mu)
        return ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss}), state

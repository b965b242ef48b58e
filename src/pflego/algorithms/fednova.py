"""FedNova: normalized averaging, each client's update divided by how much local work it did.

Wang, Liu, Liang, Joshi, Poor. "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization". NeurIPS 2020; arXiv:2007.07481.

Client i starts from x and runs tau_i local steps of its solver; its cumulative change is
``x - y_i = eta G_i a_i``, a combination of its tau_i stochastic gradients with coefficients
a_i. FedNova sends the normalized update ``d_i = (x - y_i) / ||a_i||_1`` and the server steps

    x <- x - tau_eff sum_i p_i d_i,    tau_eff = sum_i p_i ||a_i||_1,    p_i = n_i / sum_S n_j,

so that every client's objective counts by its data share, whatever its tau_i (FedAvg's
``sum p_i (x - y_i)`` counts clients by p_i tau_i). For the solvers of the paper:
plain SGD, a_i = [1, ..., 1] and ||a_i||_1 = tau_i; momentum rho (``buf <- rho buf + g``),
||a_i||_1 = sum_{j=1}^{tau_i} (1 - rho^j) / (1 - rho); a proximal term mu (FedProx's solver),
||a_i||_1 = (1 - (1 - eta mu)^{tau_i}) / (eta mu).

Symbols to code: x -> ``body.*`` and ``head.*`` (shared, one C-way model), tau_i -> the client's
real local steps this round (its schedule's non-padding rows: they differ between clients with
``local_epochs`` and a ``batch_size``), eta -> ``ctx.client_lr``, rho -> the ``momentum`` client
optimizer's momentum, mu -> ``mu`` (default 0), p_i -> N_i over the clients that answered. The
client uploads ``d_i`` and ``||a_i||_1`` (as ``nova.a``); ``aggregate`` returns
``tau_eff sum_i p_i d_i``, the pseudo-gradient the server optimizer descends along (SGD with
``server_lr`` 1, the default, is the paper's step). ``||a_i||_1`` is computed step by step as in
the authors' optimizer (``local_normalizing_vec`` in JYWa/FedNova ``distoptim/FedNova.py``).

Differences: the paper's global momentum (the authors' ``gmf``) is the server optimizer
``momentum`` (``buf <- gmf buf + g``, ``x <- x - server_lr buf``, the same step with server_lr 1).
The authors' code takes tau_eff = sum p_i tau_i when mu > 0 (the paper: sum p_i ||a_i||_1, used
here) and ignores weight decay in a_i (as here). Their proximal term is added after momentum;
here its gradient joins the loss's before momentum, so ``mu > 0`` with the ``momentum`` client
optimizer (whose a_i the paper does not give for that order) is refused. Other client optimizers
(``adam``) have no a_i: they are normalized as SGD, by tau_i. Because the aggregate multiplies
two weighted means (tau_eff and the mean d_i), it is not a weighted sum of the uploads:
differential privacy and secure aggregation refuse FedNova.

Unseen clients (``join``): nothing; FedNova is a global method, every client predicts with x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.errors import ConfigError
from pflego.fields import non_negative, setting
from pflego.optim import Momentum
from pflego.types import ClientData, ClientOut, RoundContext

A = "nova.a"  # ||a_i||_1 in the upload


@register("fednova")
@dataclass(frozen=True)
class FedNova(Algorithm):
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    mu: float = setting(0.0, "strength of FedProx's proximal term (0: none)", non_negative)

    #: tau_eff * sum p_i d_i is a product of two weighted means, not a weighted sum.
    sum_aggregate: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu > 0 and isinstance(self.client_optimizer, Momentum):
            raise ConfigError(
                "fednova with mu > 0 and the momentum client optimizer has no normalizing "
                "vector in the paper; use one or the other"
            )

    def normalizer(self, data: ClientData, lr: float, dtype: torch.dtype) -> torch.Tensor:
        """``||a_i||_1`` of this round's local steps, accumulated step by step (padding steps,
        all-zero rows of the schedule, do nothing)."""
        rho = self.client_optimizer.momentum if isinstance(self.client_optimizer, Momentum) else 0
        shrink = 1.0 - lr * self.mu
        norm = torch.zeros((), dtype=dtype)
        counter = torch.zeros((), dtype=dtype)  # 1 + rho + ... + rho^(j-1) after step j
        for row in data.batch_mask:
            active = row.sum() > 0
            counter = torch.where(active, rho * counter + 1, counter)
            step = norm * shrink + 1 if self.mu > 0 else norm + counter
            norm = torch.where(active, step, norm)
        return norm

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train(downlink, data, ctx, anchor=downlink, strength=self.mu)
        dtype = next(iter(downlink.values())).dtype
        norm = self.normalizer(data, ctx.client_lr, dtype)
        d = tree.scale(tree.sub(downlink, trained), 1.0 / norm.clamp(min=1e-12))
        return ClientOut({**d, A: norm}, data.num_samples, {"loss": mean_loss}), state

    def aggregate(self, out: ClientOut, ctx: RoundContext):
        """``tau_eff * sum_i p_i d_i`` with ``p_i = N_i / sum N`` over the clients that answered."""
        mean = tree.weighted_sum(out.upload, out.weight / out.weight.sum())
        tau_eff = mean.pop(A)
        return tree.scale(mean, tau_eff)

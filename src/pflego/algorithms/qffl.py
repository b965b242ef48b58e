"""q-FFL: q-fair federated learning, trained by q-FedAvg.

Li, Sanjabi, Beirami, Smith. "Fair Resource Allocation in Federated Learning". ICLR 2020;
arXiv:1905.10497.

q-FFL minimizes f_q(w) = sum_k p_k / (q + 1) F_k^{q+1}(w): with q > 0 a client of larger loss F_k
weighs more, so the accuracy spreads less over the clients (q = 0 is FedAvg's objective). Its
solver q-FedAvg (Algorithm 2): each sampled client k evaluates its loss F_k(w^t) at the received
model, runs local steps from w^t to w_k, and with a Lipschitz estimate L sends

    Delta w_k = L (w^t - w_k),    Delta_k = F_k^q(w^t) Delta w_k,
    h_k = q F_k^{q-1}(w^t) ||Delta w_k||^2 + L F_k^q(w^t);

the server steps ``w^{t+1} = w^t - sum_k Delta_k / sum_k h_k``.

Symbols to code: w -> ``body.*`` and ``head.*`` (one C-way model, shared), q -> ``q``, F_k(w^t)
-> the mean cross-entropy of the received model over the client's whole training split, L ->
``1 / ctx.client_lr`` (the authors' code), the local solver -> ``Algorithm.train`` with
``ctx.client_lr``; the upload is Delta_k beside h_k (``qffl.h``) and ``aggregate`` returns
``sum_k p_k Delta_k / sum_k p_k h_k``, the pseudo-gradient the server optimizer descends along
(SGD with ``server_lr`` 1, the default, is the paper's step).

Differences and choices:
- The paper samples client k with probability p_k = N_k / N and sums over the cohort unweighted
  (so do the authors' code, litian96/fair_flearn, and Flower's ``QFedAvg``); pflego samples
  uniformly, so both sums weigh each client by N_k: the expected step is the same, and with
  q = 0 the update is FedAvg's exactly (h_k = L, the step the N_k-weighted mean of w^t - w_k).
- F_k(w^t) is taken before training on the whole training split, plus 1e-10 (the authors' guard
  for F_k^{q-1} at a zero loss); one local step on the full batch makes Delta w_k = grad F_k(w^t),
  which is q-FedSGD (Algorithm 1).
- L = 1 / client_lr whatever the client optimizer (the paper derives it for SGD). The default
  q = 1 is a starting point: the paper tunes q per dataset.
- Because the step is a ratio of two weighted means, the aggregate is not a weighted sum:
  differential privacy and secure aggregation refuse q-FFL.

Unseen clients (``join``): nothing; q-FFL trains one global model, which every client predicts
with (``join_epochs`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, setting
from pflego.loss import Objective
from pflego.types import ClientData, ClientOut, RoundContext

H = "qffl.h"  # h_k in the upload
GUARD = 1e-10  # added to F_k(w^t), as the authors' code does


@register("qffl")
@dataclass(frozen=True)
class QFFL(Algorithm):
    q: float = setting(
        1.0, "fairness q: 0 is FedAvg, a larger q weighs clients of larger loss more", non_negative
    )

    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    #: sum p_k Delta_k / sum p_k h_k is a ratio of two weighted means, not a weighted sum.
    sum_aggregate: ClassVar[bool] = False

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        start_loss = Objective(self.model, data.label_mask)(downlink, data.x, data.y, data.mask)
        f_k = start_loss.detach() + GUARD  # F_k(w^t) on the whole training split
        trained, mean_loss = self.train(downlink, data, ctx)
        lipschitz = 1.0 / ctx.client_lr
        delta_w = tree.scale(tree.sub(downlink, trained), lipschitz)  # L (w^t - w_k)
        power = f_k**self.q
        h = self.q * f_k ** (self.q - 1) * tree.sq_norm(delta_w) + lipschitz * power
        upload = {**tree.scale(delta_w, power), H: h}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), state

    def aggregate(self, out: ClientOut, ctx: RoundContext):
        """``sum_k p_k Delta_k / sum_k p_k h_k`` with ``p_k = N_k / sum N`` over the cohort."""
        mean = tree.weighted_sum(out.upload, out.weight / out.weight.sum())
        h = mean.pop(H)
        return tree.scale(mean, 1.0 / h)

"""FedADMM: a federated primal-dual method (ADMM) that allows partial participation.

Wang, Marella, Anderson. "FedADMM: A Federated Primal-Dual Algorithm Allowing Partial
Participation". IEEE CDC 2022; arXiv:2203.15104.

Every client i keeps a primal model w_i (theta^0 at the start) and a dual variable y_i (zero at
the start). A sampled client minimizes its augmented Lagrangian approximately, by local steps from
the global model theta^t,

    w_i^{t+1} ~ argmin_w  f_i(w) + <y_i^t, w - theta^t> + rho/2 ||w - theta^t||^2,

takes the dual ascent step ``y_i^{t+1} = y_i^t + rho (w_i^{t+1} - theta^t)`` and sends the change
of its augmented model ``Delta_i = (w_i^{t+1} + y_i^{t+1} / rho) - (w_i^t + y_i^t / rho)``; the
server adds the changes to the mean over all m clients, ``theta^{t+1} = theta^t + (eta / m)
sum_{i in S_t} Delta_i``. With eta = 1 theta stays the mean of the m augmented models
w_i + y_i / rho (clients outside S_t keep theirs), the global step of consensus ADMM, whichever
clients take part.

Symbols to code: theta -> ``server["params"]`` (``body.*`` and ``head.*``, one C-way model), w_i
and y_i -> the client state ``primal.*`` and ``dual.*`` (w_i^0 = theta^0 is rebuilt from the
run's seed at the first visit), rho -> ``rho``, the local solver -> ``train_steps`` on an
``Objective`` of the cross-entropy, ``Linear(-y_i)`` (the term ``<y_i, w>``; its constant ``-<y_i, theta^t>`` has no
gradient) and ``Proximal(theta^t, rho)``, with ``ctx.client_lr``; m -> the population
``ctx.num_clients``; eta -> ``ctx.server_lr`` (default 1). The upload is ``-Delta_i`` with weight 1
per client; ``aggregate`` returns ``-(1/m) sum_{S_t} Delta_i``, the pseudo-gradient the server
optimizer descends along (SGD is the paper's step).

Differences and choices:
- FL-bench (KarhouTam/FL-bench, ``fedadmm``) takes the N_i-weighted mean of Delta_i over the
  cohort (with partial participation, steps about m/|S_t| times larger), takes w_i^t as theta^t
  every round (so its Delta_i = 2 (w_i^{t+1} - theta^t)) and switches eta to ``eta_2`` after
  ``target_round`` rounds; here the sum is divided by m, w_i^t is the client's own last primal and
  eta is ``server_lr`` throughout. FL-bench's random number of local epochs per client (its
  default, ``fixed`` 0) is not drawn (``local_epochs`` with a ``batch_size`` already makes the
  local work ragged).
- The default rho = 0.01 is FL-bench's; the paper tunes it. The logged loss is the value the
  local steps descend: the cross-entropy plus rho/2 ||w - theta^t||^2 and <y_i, w> (without the
  constant -<y_i, theta^t>).

Unseen clients (``join``): nothing; FedADMM trains one global model theta, which every client
predicts with (``join_epochs`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import positive, setting
from pflego.local import train_steps
from pflego.loss import CrossEntropy, Linear, Objective, Proximal
from pflego.types import ClientData, ClientOut, RoundContext

PRIMAL, DUAL = "primal.", "dual."  # w_i and y_i in the client state


@register("fedadmm")
@dataclass(frozen=True)
class FedADMM(Algorithm):
    rho: float = setting(0.01, "penalty rho of the augmented Lagrangian", positive)

    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is

    def init_client(self, downlink, generator, ctx):
        """w_i = theta^0, the run's initial model (from its seed), and y_i = 0."""
        first = next(iter(downlink.values()))
        initial = self.init_params(ctx.seed, first.dtype)
        return {
            **tree.add_prefix(PRIMAL, {k: initial[k].to(first.device) for k in downlink}),
            **tree.add_prefix(DUAL, tree.zeros_like(downlink)),
        }

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        theta = downlink
        w, y = tree.strip_prefix(PRIMAL, state), tree.strip_prefix(DUAL, state)

        # f_i(w) + <y_i, w - theta> + rho/2 ||w - theta||^2, from theta
        terms = (CrossEntropy(), Linear(tree.scale(y, -1.0)), Proximal(theta, self.rho))
        loss = Objective(self.model, data.label_mask, terms=terms)
        opt = self.client_optimizer
        new_w, _, mean_loss = train_steps(loss, theta, data, opt, opt.init(theta), ctx.client_lr)
        new_y = tree.axpy(self.rho, tree.sub(new_w, theta), y)

        # -Delta_i = (w_i + y_i / rho) - (w_i^+ + y_i^+ / rho)
        before = tree.axpy(1.0 / self.rho, y, w)
        after = tree.axpy(1.0 / self.rho, new_y, new_w)
        weight = torch.ones_like(data.num_samples)  # every client's change counts once
        new_state = {**tree.add_prefix(PRIMAL, new_w), **tree.add_prefix(DUAL, new_y)}
        return ClientOut(tree.sub(before, after), weight, {"loss": mean_loss}), new_state

    def aggregate(self, out: ClientOut, ctx: RoundContext):
        """``-(1/m) sum_{i in S_t} Delta_i``: the cohort's mean upload times |S_t| / m.

        A weighted sum of the uploads (``out.weight`` the relative weights, uniform as the clients
        send them), so privacy and the server optimizer wrap it like FedAvg's.
        """
        mean = tree.weighted_sum(out.upload, out.weight / out.weight.sum())
        return tree.scale(mean, out.weight.shape[0] / ctx.num_clients)

"""FedDyn: federated learning based on dynamic regularization.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama. "Federated Learning Based on Dynamic
Regularization". ICLR 2021; arXiv:2111.04263.

Client k in the cohort P_t solves (approximately, by local SGD from theta^{t-1})

    theta_k^t = argmin_theta L_k(theta) - <grad L_k(theta_k^{t-1}), theta>
                + alpha/2 ||theta - theta^{t-1}||^2

and updates its gradient state ``grad L_k(theta_k^t) = grad L_k(theta_k^{t-1})
- alpha (theta_k^t - theta^{t-1})`` (zero at the first visit; clients outside P_t keep theirs).
The server keeps h (zero at the start):

    h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - h^t / alpha.

Symbols to code: theta -> ``body.*`` and ``head.*`` (one C-way model, shared), grad
L_k(theta_k^{t-1}) -> the client state ``grad.*``, h -> ``server["h"]``, alpha -> ``alpha``,
m -> ``ctx.num_clients`` (the population I), |P_t| -> the clients that answered (``clients``),
the local solver -> ``Algorithm.train`` with ``ctx.client_lr``. Uploads are
``theta^{t-1} - theta_k^t`` as for every averaging method.

Differences: the mean over P_t is unweighted, as in the paper (and the PGFed authors' code);
the FedDyn authors' code scales alpha per client by its data size (not offered). FedDyn's server
step is its own rule: the server optimizer and ``server_lr`` are not used, so a run that sets
either (other than SGD / 1) is refused, as is ``join_epochs`` (newcomers do not train). The
regularizers' gradients are added to every minibatch's (the logged loss is L_k's, without their
values). Prediction is the global model theta (FedDyn is a global method); a client that never
trained (``join``) does nothing, so it is evaluated exactly as the clients that trained:
fine-tuning would be another method (FedDyn + fine-tuning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import positive, setting
from pflego.types import ClientData, ClientOut, RoundContext

GRAD = "grad."


@register("feddyn")
@dataclass(frozen=True)
class FedDyn(Algorithm):
    alpha: float = setting(0.01, "strength alpha of the dynamic regularizer", positive)

    server_step: ClassVar[str] = "own"  # h and theta^t of the paper's server rule
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is

    def init_server(self, params):
        return {"params": params, "h": tree.zeros_like(params)}

    def init_client(self, downlink, generator, ctx):
        return {GRAD + k: torch.zeros_like(v) for k, v in downlink.items()}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        linear = {k: state[GRAD + k] for k in downlink}

        # the local objective: L_k(p) - <grad L_k, p> + alpha/2 ||p - theta^{t-1}||^2
        trained, mean_loss = self.train(
            downlink, data, ctx, anchor=downlink, strength=self.alpha, linear=linear
        )
        delta = tree.sub(downlink, trained)  # theta^{t-1} - theta_k^t
        new_grad = tree.axpy(self.alpha, delta, linear)
        out = ClientOut(delta, data.num_samples, {"loss": mean_loss})
        return out, {GRAD + k: v for k, v in new_grad.items()}

    def aggregate(self, out: ClientOut, ctx: RoundContext):
        """The unweighted mean of the uploads over the clients that answered."""
        count = out.weight.shape[0]
        return tree.weighted_sum(out.upload, torch.full_like(out.weight, 1.0 / count))

    def server_round(self, server, out, ctx, clients):
        mean_delta = self.aggregate(out, ctx)  # theta^{t-1} - mean_k theta_k^t
        # sum_k (theta_k^t - theta^{t-1}) / m = -(|P_t| / m) * mean_delta
        h = tree.axpy(self.alpha * len(clients) / ctx.num_clients, mean_delta, server["h"])
        params = {k: v - mean_delta[k] - h[k] / self.alpha for k, v in server["params"].items()}
        return {**server, "params": params, "h": h}

    def predict(self, downlink, state, x):
        return self.model.forward(downlink, x)

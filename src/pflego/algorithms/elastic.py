"""Elastic Aggregation: FedAvg whose server step is scaled per parameter by its sensitivity.

Dengsheng Chen, Jie Hu, Vince Junkai Tan, Xiaoming Wei, Enhua Wu. "Elastic Aggregation for
Federated Optimization". CVPR 2023, pp. 12187-12197 (CVF open access; no arXiv version was found).

A parameter's sensitivity is how much the model's output changes when the parameter changes,
measured without labels as the gradient of the output's squared norm (after Memory Aware
Synapses) and kept as a moving average on each client. The server reduces the update of the
parameters the clients find sensitive and boosts the others:

    Omega_i <- mu Omega_i + (1 - mu) |d ||F(x; theta)||^2 / d theta|     (each local minibatch),
    Omega = sum_i p_i Omega_i,    zeta = 1 + tau - Omega / max(Omega),
    theta <- theta - zeta * sum_i p_i (theta - theta_i),

with theta_i client i's model after FedAvg's local steps from theta and p_i = N_i / sum N over
the cohort; zeta lies in [tau, 1 + tau], one factor per parameter entry.

Symbols to code: theta -> ``body.*`` and ``head.*`` (one C-way model, shared), F(x; theta) -> the
model's logits, Omega_i -> the client state ``omega.*`` (zero at the first visit), mu -> ``mu``
(default 0.95), tau -> ``tau`` (default 0.5; the defaults of FL-bench), max(Omega) -> the largest
entry of Omega over the whole model. The upload is FedAvg's pseudo-gradient ``theta - theta_i``
beside Omega_i (``omega.*``), both weighted by N_i; ``aggregate`` returns zeta times the mean
pseudo-gradient, which the server optimizer descends along (SGD with ``server_lr`` 1, the
default, is the paper's step).

Differences and choices:
- Written from the paper's stated measure (the change of the output, without labels, online) in
  Memory Aware Synapses' form; the moving average mu and the defaults follow FL-bench.
- Omega_i is measured at the received model theta, on the minibatches of the round's local
  schedule (the gradient of each minibatch's mean squared output norm, before the local steps),
  and carried across the client's rounds.
- FL-bench (KarhouTam/FL-bench, ``elastic``) measures one sensitivity per parameter tensor: the
  squared norm of the first slice of the supervised loss's gradient, on a 30% sample of the
  client's data it then leaves out of training, and normalizes each tensor's Omega by its
  largest value over the round's clients. Here Omega is per entry, from the output's norm, over
  every training sample, normalized over the whole model.
- zeta depends on the uploads through a maximum, so the aggregate is not a weighted sum:
  differential privacy and secure aggregation refuse Elastic Aggregation.

Unseen clients (``join``): nothing; every client predicts with the global model theta
(``join_epochs`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import grad

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, non_negative, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

OMEGA = "omega."  # Omega_i, in the client state and the upload


@register("elastic")
@dataclass(frozen=True)
class Elastic(Algorithm):
    tau: float = setting(
        0.5, "the boost: updates are scaled by 1 + tau - normalized sensitivity", non_negative
    )
    mu: float = setting(
        0.95, "momentum mu of each client's moving average of sensitivities", between(0, 1, "[)")
    )

    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    sum_aggregate: ClassVar[bool] = False  # zeta divides by the largest aggregated sensitivity

    def init_client(self, downlink, generator, ctx):
        return tree.add_prefix(OMEGA, tree.zeros_like(downlink))

    def output_norm(self, params: Params, x: Tensor, mask: Tensor) -> Tensor:
        """The mean over the batch's real samples of ``||F(x; params)||^2``."""
        squares = (self.model.forward(params, x) ** 2).sum(-1)
        return (squares * mask).sum() / mask.sum().clamp(min=1)

    def sensitivity(self, params: Params, omega: Params, data: ClientData) -> Params:
        """Omega_i after one moving-average step per real minibatch of the local schedule."""
        for idx, bmask in zip(data.batches, data.batch_mask):
            g = grad(self.output_norm)(params, data.x[idx], bmask)
            active = bmask.sum() > 0
            omega = {
                k: torch.where(active, self.mu * v + (1 - self.mu) * g[k].abs(), v)
                for k, v in omega.items()
            }
        return omega

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        omega = self.sensitivity(downlink, tree.strip_prefix(OMEGA, state), data)
        trained, mean_loss = self.train(downlink, data, ctx)
        upload = {**tree.sub(downlink, trained), **tree.add_prefix(OMEGA, omega)}
        out = ClientOut(upload, data.num_samples, {"loss": mean_loss})
        return out, tree.add_prefix(OMEGA, omega)

    def aggregate(self, out: ClientOut, ctx: RoundContext) -> Params:
        """``zeta * sum_i p_i (theta - theta_i)``, ``zeta = 1 + tau - Omega / max(Omega)``."""
        mean = tree.weighted_sum(out.upload, out.weight / out.weight.sum())
        omega = tree.strip_prefix(OMEGA, mean)
        largest = torch.stack([v.max() for v in omega.values() if v.numel()]).max()
        largest = torch.where(largest > 0, largest, torch.ones_like(largest))
        return {k: (1 + self.tau - omega[k] / largest) * mean[k] for k in omega}

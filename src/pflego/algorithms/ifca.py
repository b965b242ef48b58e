"""IFCA: the Iterative Federated Clustering Algorithm.

Ghosh, Chung, Yin, Ramchandran. "An Efficient Framework for Clustered Federated Learning".
NeurIPS 2020; arXiv:2006.04088.

The server keeps k cluster models theta_1..theta_k and sends all of them to the sampled
clients. Client i estimates its cluster identity as the model of lowest loss on its data,

    j_hat = argmin_j F_i(theta_j),

runs local steps from theta_{j_hat} to theta~_i and sends theta~_i with its one-hot identity
s_i (s_{i,j} = 1 for j = j_hat); the server averages each cluster's models over the clients that
chose it (model averaging, Algorithm 1's option II),

    theta_j <- sum_i s_{i,j} N_i theta~_i / sum_i s_{i,j} N_i,

and a cluster no client chose keeps its model.

Symbols to code: theta_1..theta_k -> ``server["params"]``, stacked ``[k, ...]`` (``body.*`` and
``head.*``, C-way models; cluster j initialized like FedAvg's model with the seed + 2j, as
FedEM's components), k -> ``clusters``, F_i -> the mean cross-entropy over the client's whole
training split, the local solver -> ``Algorithm.train`` with ``ctx.client_lr``. The upload is
the pseudo-gradient ``theta_{j_hat} - theta~_i`` in the chosen cluster's slot (zeros elsewhere)
and s_i (``ifca.identity``), weighted by N_i; ``aggregate`` divides each cluster's weighted sum
by its share of the weights, and the server steps by ``server_lr`` times that (1, the default,
is the average).

Differences and choices:
- The paper's average is over the clients of the cluster with equal weights (its clients hold
  equal amounts of data); here each weighs by N_i, so with k = 1 IFCA is FedAvg exactly. The
  gradient-averaging option (I) and the paper's weight sharing between the cluster models (a
  shared body in its CIFAR experiments) are not offered; ties in the loss go to the lower j.
- The server steps by ``server_lr`` only (a server optimizer would also move clusters no client
  chose, so a run that sets one is refused).
- Each client predicts with the cluster model it estimates as of the evaluation: ``adapt`` (and
  ``join``, for a client that never trained) evaluates every cluster model on the client's
  training split and keeps the one of lowest loss, as the next round's identity estimate would;
  the stored state is the identity the client last trained with (``test_acc_before_adapt``;
  cluster 0 before any training). The aggregate is a ratio of weighted sums, not a weighted sum,
  so differential privacy and secure aggregation refuse IFCA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, setting
from pflego.loss import masked_cross_entropy
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, Schedule

IDENTITY = "ifca.identity"  # s_i, one-hot over the clusters, in the upload and the state


@register("ifca")
@dataclass(frozen=True)
class IFCA(Algorithm):
    clusters: int = setting(2, "the number k of cluster models", at_least(1))

    server_step: ClassVar[str] = "sgd"  # server_lr times each cluster's mean update
    join_trains: ClassVar[bool] = False  # a new client picks a cluster model and trains nothing
    sum_aggregate: ClassVar[bool] = False  # each cluster's sum over its own share of the weights

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """k models, each initialized like FedAvg's (cluster j with ``seed + 2j``)."""
        parent = super()  # outside the generator, where a bare super() fails
        return tree.stack(parent.init_params(seed + 2 * j, dtype) for j in range(self.clusters))

    def init_client(self, downlink, generator, ctx):
        return {IDENTITY: next(iter(downlink.values())).new_zeros((self.clusters,))}

    def identity(self, models: Params, data: ClientData) -> Tensor:
        """s_i: one-hot of the cluster model of lowest loss on the client's training split."""
        losses = torch.stack(
            [
                masked_cross_entropy(
                    self.model.forward({k: v[j] for k, v in models.items()}, data.x),
                    data.y,
                    data.mask,
                    data.label_mask,
                )
                for j in range(self.clusters)
            ]
        )
        first = next(iter(models.values()))
        clusters = torch.arange(self.clusters, device=losses.device)
        return (clusters == losses.argmin()).to(first.dtype)  # one-hot, with no host read

    def chosen(self, models: Params, identity: Tensor) -> Params:
        """The cluster model that ``identity`` selects (cluster 0 for an all-zero one)."""
        first = torch.arange(self.clusters, device=identity.device) == 0  # cluster 0, one-hot
        pick = torch.where(identity.sum() > 0, identity, first.to(identity))
        return tree.weighted_sum(models, pick)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        identity = self.identity(downlink, data)
        start = self.chosen(downlink, identity)
        trained, mean_loss = self.train(start, data, ctx)
        delta = tree.sub(start, trained)
        slots = {k: identity.view(-1, *[1] * v.dim()) * v for k, v in delta.items()}
        out = ClientOut({**slots, IDENTITY: identity}, data.num_samples, {"loss": mean_loss})
        return out, {IDENTITY: identity}

    def aggregate(self, out: ClientOut, ctx: RoundContext) -> Params:
        """Each cluster's N_i-weighted mean update over the clients that chose it (zero for a
        cluster nobody chose)."""
        mean = tree.weighted_sum(out.upload, out.weight / out.weight.sum())
        share = mean.pop(IDENTITY)
        share = torch.where(share > 0, share, torch.ones_like(share))
        return {k: v / share.view(-1, *[1] * (v.dim() - 1)) for k, v in mean.items()}

    def adapt(self, downlink, state: ClientState, data: ClientData, ctx: RoundContext):
        """The identity estimate under the current cluster models (what ``predict`` uses)."""
        return {IDENTITY: self.identity(downlink, data)}

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return Schedule(1)  # the identity estimate reads the whole training split

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.chosen(downlink, state[IDENTITY]), x)

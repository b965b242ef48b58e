"""kNN-Per: FedAvg, then each client interpolates the global model with a kNN over its own data.

Marfoq, Neglia, Vidal, Kameni. "Personalized Federated Learning through Local Memorization".
ICML 2022; arXiv:2111.09360. Authors' code: github.com/omarfoq/knn-per (``client.py``'s
``KNNPerClient``, ``datastore.py``, ``eval_knnper.py``; read for this file).

Training is FedAvg's, unchanged (see ``fedavg.py``): one global model h_w = head o phi. At
evaluation client m builds its datastore S_m = {(phi(x_j), y_j)} from its training split and
predicts with

    h_m(x) = lam * p_kNN(y | x; S_m) + (1 - lam) * softmax(h_w(x)),
    p_kNN(y | x) = sum_{j in N_k(x)} 1{y_j = y} exp(-d_j / T) / sum_{j in N_k(x)} exp(-d_j / T),

N_k(x) the k entries of S_m nearest to phi(x), d_j their distances.

Symbols to code: w -> the downlink (``body.*`` and ``head.*``), phi -> ``model.features``, lam ->
``lam``, k -> ``k``, T -> ``temperature``. The datastore is evaluation-time state, built by
``adapt`` from the client's (padded) training split and never stored or sent: ``adapt`` returns
``knn.features`` ``[n, M]`` (phi of every training input), ``knn.labels`` ``[n, C]`` (one-hot)
and ``knn.mask`` ``[n]`` (1 for real samples); the evaluation lays that state beside the
downlink for ``predict`` (``Algorithm.adapt``'s contract: the adapted state is used for that
evaluation only). ``predict`` without those entries (the ``_before_adapt`` view) is the global
model's. ``predict`` returns ``log h_m(x)``, log-probabilities, so that the evaluation's
cross-entropy is that of the interpolated distribution.

The distance, as in the authors' code: d_j is the squared Euclidean distance (faiss'
``IndexFlatL2``) divided by the feature width M, and T their ``kernel_length_scale`` (default 1):
weights ``exp(-||phi(x) - phi(x_j)||^2 / (M T))``. The paper writes a generic distance d.

Defaults: k = 7 (the authors' experiment scripts, ``n_neighbors 7``), T = 1 (the code's default
scale), lam = 0.5. The paper picks lam (and studies k and the datastore's capacity) per client
on validation data over a grid; here lam is one number for every client (tune it with
``--tune``). The datastore holds the whole training split (the code's ``capacity=-1``).

Where the authors' code differs from the paper: its ``--interpolate_logits`` flag has
``default="store_true"`` (a string, so always true), which mixes the kNN probabilities with the
model's *logits*; here, as in the paper, probabilities are mixed.

Padding: a client with fewer than k training samples uses all of them (padded entries weigh 0).
Ties among equally distant neighbours at the k-th place are broken by ``torch.topk``. Training
accuracy evaluates every training sample against a datastore that holds it (distance 0), as
the paper's "train" mode does.

Unseen clients (``join``): the same datastore from their training split; nothing is trained (a
run that sets ``join_epochs`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego.algorithms.base import register
from pflego.algorithms.fedavg import FedAvg
from pflego.fields import Rule, between, positive, setting
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientState, RoundContext

FEATURES = "knn.features"  # phi(x_j) of the datastore, [n, M]
LABELS = "knn.labels"  # one-hot y_j, [n, C]
MASK = "knn.mask"  # 1 for real samples, 0 for padding, [n]


def knn_probabilities(
    queries: Tensor, keys: Tensor, labels: Tensor, mask: Tensor, k: int, temperature: float
) -> Tensor:
    """p_kNN(y | x) of every query ``[m, M]`` from a datastore of ``keys`` ``[n, M]`` with
    one-hot ``labels`` ``[n, C]`` and sample ``mask`` ``[n]``: the k nearest keys by squared
    distance over M, weighted by ``exp(-d / temperature)``. Returns ``[m, C]``."""
    sq = (
        (queries * queries).sum(-1, keepdim=True) + (keys * keys).sum(-1) - 2 * queries @ keys.T
    ).clamp(min=0)
    scores = -sq / (keys.shape[-1] * temperature)
    scores = torch.where(mask > 0, scores, -torch.inf)
    top, index = scores.topk(min(k, keys.shape[0]), dim=-1)
    weights = torch.softmax(top, dim=-1)  # exp(-d_j / T) / sum over the k neighbours
    return (weights.unsqueeze(-1) * labels[index]).sum(-2)


@register("knn-per")
@dataclass(frozen=True)
class KNNPer(FedAvg):
    join_trains: ClassVar[bool] = False  # the datastore is built, nothing is trained

    k: int = setting(
        7,
        "neighbours the kNN part reads",
        Rule(lambda v: type(v) is int and v >= 1, "must be a positive integer", "an integer >= 1"),
    )
    lam: float = setting(
        0.5, "weight of the kNN prediction in the mixture with the global model's", between(0, 1)
    )
    temperature: float = setting(1.0, "the kernel's length scale T", positive)

    def adapt(
        self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext
    ) -> ClientState:
        """The datastore: the global body's features of the training split, one-hot labels."""
        features = self.model.features(downlink, data.x)
        classes = torch.arange(self.model.num_classes, device=data.y.device)
        labels = (data.y.unsqueeze(-1) == classes).to(features.dtype)
        return {**state, FEATURES: features, LABELS: labels, MASK: data.mask}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """log(lam p_kNN + (1 - lam) softmax(h_w(x))), or h_w's logits without a datastore."""
        features = self.model.features(downlink, x)
        logits = head_logits(downlink, features)
        if FEATURES not in state:  # no datastore (the global model, before adapt)
            return logits
        knn = knn_probabilities(
            features, state[FEATURES], state[LABELS], state[MASK], self.k, self.temperature
        )
        return torch.log(self.lam * knn + (1 - self.lam) * torch.softmax(logits, -1))

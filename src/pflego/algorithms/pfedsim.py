"""pFedSim: the similarity of the clients' classifiers decides how their feature extractors mix.

Tan, Zhou, Liu, Zhang, Li, Wang. "pFedSim: Similarity-Aware Model Aggregation Towards
Personalized Federated Learning". arXiv:2305.15706 (2023). The first author maintains FL-bench,
whose ``src/server/pfedsim.py`` is the authors' code; the rule below follows it.

Training has two phases. In the first R_w rounds (warm-up) it is FedAvg on the whole model. At
the end of the warm-up every client's personal model theta_i = (phi_i, h_i) (feature extractor,
classifier) is the global model, and the similarity matrix S is the identity. In every later
round t:

- the server sends a sampled client i the model (phi~_i, h_i) with the personalized feature
  extractor ``phi~_i = sum_j a_ij phi_j`` over every client's latest personal model, with
  ``a_ij = w_ij / sum_k w_ik``, ``w_ij = -log(1 - S_ij)`` for j != i and ``w_ii = -log(1 -
  0.9999)``; clients never sampled with i have S_ij = 0, so w_ij = 0 (a client with no similar
  client yet keeps its own phi_i exactly);
- client i trains the whole model on its data and returns it; the server stores it as theta_i;
- for every pair i, j of the round's cohort, ``S_ij = S_ji = max(0, mean_c cos(h_i[c], h_j[c]))``,
  the mean over classes c of the cosine similarity of the classifiers' weight rows.

Symbols to code: R_w -> ``warmup_rounds``; the global model of the warm-up -> ``server["params"]``
(kept afterwards as a newcomer's model); theta_1..theta_I -> ``server["models"]`` ``[I, ...]``
(``ModelTable``'s, created from the global model at the first personalized round), and each
client's state ``model.*`` with ``trained``; S -> ``server["sim"]`` ``[I, I]``;
phi -> the ``body.*`` entries, h -> ``head.*`` (the classifier's weight ``head.weight`` gives S);
the mixture -> ``tree.mix`` (per-entry weights: a_i on the body, the client's own row on the
head);
the local steps -> the run's schedule, client optimizer and ``ctx.client_lr``.

Deliberate differences and choices:
- The warm-up is a count of rounds, ``warmup_rounds`` (50): FL-bench's default, half of its 100
  rounds, since an algorithm does not see the run's length.
- S_ij is capped at 0.9999, the value the diagonal takes, so that two identical classifiers weigh
  as much as the client's own and never give an infinite -log(0) (FL-bench does not cap it).
- The warm-up average is the N_i-weighted mean of the uploaded models (FL-bench's FedAvg); the
  server optimizer and ``server_lr`` are not used (``server_step = "own"``).
- The personalized model evaluated is the client's theta_i (FL-bench's test, which does not
  re-aggregate), kept in its state as well as on the server; during the warm-up, and for a
  client that has not trained since, it is the model it receives: the global model (a client
  that has not trained after the warm-up has no similar client, so its phi~_i is its own).
- Differential privacy and SecAgg+ are refused (``sum_aggregate = False``): the server keeps
  every client's model.

A client that never trained (``join``) has no similar client yet, so its personalized feature
extractor is its own model's: it trains the model it receives (the last warm-up global model, or
the current one during the warm-up) on its data with the run's schedule, its first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.table import OWN, ModelTable
from pflego.fields import non_negative, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

TRAINED = "trained"  # 1 once the client has trained after the warm-up (or joined)
SELF = 0.9999  # the similarity of a client to itself (the authors' constant)


def classifier_similarity(heads: Tensor) -> Tensor:
    """``[n, n]``: max(0, mean over classes of the cosine of the rows) of stacked ``[n, C, M]``."""
    cosine = torch.cosine_similarity(heads[:, None], heads[None, :], dim=-1)
    return cosine.mean(-1).clamp(0, SELF)


def mixing_weights(sim: Tensor) -> Tensor:
    """``[n, I]`` rows a_i of the similarities ``[n, I]`` with S_ii already set to 0.9999."""
    weights = -torch.log1p(-sim)
    return weights / weights.sum(-1, keepdim=True)


@register("pfedsim")
@dataclass(frozen=True)
class PFedSim(ModelTable):
    warmup_rounds: int = setting(
        50, "the rounds of FedAvg before the similarity-weighted personalization", non_negative
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")

    # --- server: the warm-up's mean, then the table of theta_1..theta_I (``ModelTable``) -------

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """(phi~_i, h_i) for each of ``clients``; a newcomer gets the global model."""
        if clients is None:
            return server["params"]
        models = self.stored(server, ctx)
        if "sim" not in server:
            return {k: v[clients.to(v.device)] for k, v in models.items()}
        idx = clients.to(server["sim"].device)
        sim = server["sim"][idx].clone()
        sim[torch.arange(len(idx)), idx] = SELF
        mix, own = mixing_weights(sim), (idx[:, None] == torch.arange(sim.shape[1])).to(sim)
        return tree.mix(models, {k: mix if k.startswith("body.") else own for k in models})

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """The warm-up's weighted mean; afterwards store the cohort's models and update S."""
        uploads = tree.strip_prefix(OWN, out.upload)
        if ctx.round < self.warmup_rounds:
            mean = tree.weighted_sum(uploads, out.weight / out.weight.sum())
            return {"params": {k: v.to(server["params"][k]) for k, v in mean.items()}}
        heads = uploads["head.weight"]
        fresh = torch.eye(ctx.num_clients, dtype=heads.dtype, device=heads.device)
        sim = server["sim"].clone() if "sim" in server else fresh
        idx = clients.to(sim.device)
        pairs = classifier_similarity(heads.to(sim))
        sim[idx[:, None], idx[None, :]] = pairs
        sim[idx, idx] = 1.0  # the diagonal stays S's identity
        return {**self.store(server, out, ctx, clients), "sim": sim}

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """No personal model yet (``trained`` 0): until it has one the client uses its downlink."""
        first = next(iter(downlink.values()))
        return {**tree.add_prefix(OWN, tree.zeros_like(downlink)), TRAINED: first.new_zeros(())}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The whole model trained from (phi~_i, h_i), uploaded whole and, after the warm-up,
        kept as theta_i."""
        trained, mean_loss = self.train(downlink, data, ctx)
        personal = float(ctx.round >= self.warmup_rounds)
        new_state = {
            **tree.add_prefix(OWN, trained),
            TRAINED: torch.full_like(state[TRAINED], personal),
        }
        out = ClientOut(tree.add_prefix(OWN, trained), data.num_samples, {"loss": mean_loss})
        return out, new_state

    def personal_model(self, downlink: Params, state: ClientState) -> Params:
        """theta_i once the client trained after the warm-up (or joined), else its downlink."""
        return tree.where(state[TRAINED] > 0, tree.strip_prefix(OWN, state), downlink)

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.personal_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer's first round: the model it receives trained on its data."""
        trained, _ = self.train(downlink, data, ctx)
        return {**tree.add_prefix(OWN, trained), TRAINED: torch.ones_like(state[TRAINED])}

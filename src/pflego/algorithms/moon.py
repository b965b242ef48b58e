"""MOON: model-contrastive federated learning.

Li, He, Song. "Model-Contrastive Federated Learning". CVPR 2021; arXiv:2103.16257.

FedAvg whose local loss adds a contrastive term on the representation: for an input x, z is the
representation of the model being trained, z_glob that of the global model w^t (the round's
downlink) and z_prev that of the client's own local model from its previous round,

    l_con = -log [ exp(sim(z, z_glob) / tau)
                   / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) ],

with sim the cosine similarity, and the client minimizes ``l_sup + mu * l_con`` (l_sup the
cross-entropy) by local steps from w^t. The server averages the local models weighted by N_i
(server SGD with lr 1 on ``w^t - w_i``).

Symbols to code: w -> ``body.*`` and ``head.*`` (shared, one C-way model); the representation
R_w(x) -> the body's features ``self.model.features`` (pflego's split models have no projection
head: the paper's representation is the projection head's output, the authors' code's ``pro1``);
z_glob and z_prev are computed without gradient; w_i^{t-1} -> the client state ``prev.body.*``
(its body after its last round) with the flag ``trained``; tau -> ``tau`` (default 0.5), mu ->
``mu`` (default 1, the authors' code's default; the paper reports mu = 5 best on CIFAR-10 and 1 on
CIFAR-100 and Tiny-ImageNet), the local solver -> ``pflego.local.train_steps`` with
``ctx.client_lr``. l_con is averaged over the batch's real samples, like l_sup.

First visit: a client has no previous model; the authors' code then has no negative and the
contrastive loss is 0 (a one-logit cross-entropy), as here (the ``trained`` flag is 0; with
z_prev = z_glob the term would be log 2, whose gradient is 0 as well). The paper's "previous local
model" is the client's model from the last round it took part in (the authors' model pool keeps
the last trained model of each party, of buffer size 1 by default).

Unseen clients (``join``): nothing; MOON is a global method, every client predicts with the global
model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, positive, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

PREV = "prev."  # the client's body after its last round, w_i^{t-1}
TRAINED = "trained"  # 1 once the client has a previous model


@register("moon")
@dataclass(frozen=True)
class Moon(Algorithm):
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    mu: float = setting(1.0, "strength mu of the model-contrastive term", non_negative)
    tau: float = setting(0.5, "temperature tau of the contrastive term", positive)

    def init_client(self, downlink, generator, ctx):
        body = tree.select(downlink, ["body"])
        dtype = next(iter(downlink.values())).dtype if downlink else torch.get_default_dtype()
        return {
            **tree.add_prefix(PREV, tree.zeros_like(body)),
            TRAINED: torch.zeros((), dtype=dtype),
        }

    def contrastive_loss(self, global_params: Params, previous: Params, weight, label_mask):
        """``l_sup + weight * l_con`` on a batch (``weight`` is mu, or 0 at a first visit)."""

        def loss(params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor):
            z = self.model.features(params, x)
            z_glob = self.model.features(global_params, x).detach()
            z_prev = self.model.features({**global_params, **previous}, x).detach()
            positive = F.cosine_similarity(z, z_glob, dim=-1) / self.tau
            negative = F.cosine_similarity(z, z_prev, dim=-1) / self.tau
            l_con = torch.logsumexp(torch.stack([positive, negative], -1), -1) - positive
            l_sup = masked_cross_entropy(head_logits(params, z), y, mask, label_mask)
            return l_sup + weight * (l_con * mask).sum() / mask.sum().clamp(min=1)

        return loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        previous = tree.strip_prefix(PREV, {k: v for k, v in state.items() if k != TRAINED})
        weight = self.mu * state[TRAINED]
        loss = self.contrastive_loss(downlink, previous, weight, data.label_mask)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            loss, downlink, data, opt, opt.init(downlink), ctx.client_lr
        )
        new_state = {
            **tree.add_prefix(PREV, tree.select(trained, ["body"])),
            TRAINED: torch.ones_like(state[TRAINED]),
        }
        out = ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss})
        return out, new_state

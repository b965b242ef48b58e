"""FedFomo: personalized FL by first-order model optimization over other clients' models.

Zhang, Sapra, Fidler, Yeung, Alvarez. "Personalized Federated Learning with First Order Model
Optimization". ICLR 2021; arXiv:2012.08565.

Client i keeps its own model theta_i. In a round it downloads M other clients' latest models
theta_j (j in the set the server picked for it) and weights each by the improvement of its
validation loss per unit of parameter distance,

    w_ij = max(0, (L_i(theta_i^{t-1}) - L_i(theta_j)) / ||theta_j - theta_i^{t-1}||),

normalized to sum to one over the positive ones (all zero when none helps), moves to

    theta_i <- theta_i^{t-1} + sum_j w_ij (theta_j - theta_i^{t-1}),

then trains locally and uploads its new model and the w_ij. The server keeps every client's
latest model and an affinity matrix P (P_ij <- P_ij + w_ij), and picks each client's M models
epsilon-greedily: each pick is a random other client with probability epsilon_t, else the
not-yet-picked client of highest affinity (ties broken at random), with epsilon_t = max(0,
epsilon - t * decay).

Symbols to code: theta_i -> the client state ``model.*``; the downloaded theta_j ->
``peer.*`` (``[M, ...]``); L_i -> the mean cross-entropy on ``data.validation`` (the client's
validation split, ``val_fraction`` of its training data held out; the paper holds out part of the
local training data, its code 20%); M -> ``num_models`` (5, the paper's smaller setting);
epsilon, decay -> ``epsilon`` / ``epsilon_decay`` (0.3 and 0.05 per round, the authors' CIFAR
commands); P -> ``server["affinity"]["P"]``; the server's copies -> ``server["models"]``
(``ModelTable``).

Differences and choices:
- Candidates are all other clients' latest models (a client that has not trained yet holds the
  initial model). The authors' code offers only the models uploaded in the previous round and
  counts the client itself among the M; the PGFed authors' FedFomo (PFLlib) takes the top M of
  P without exploration, with P initialized to the identity.
- P is updated with the normalized non-negative weights; the authors' code adds signed
  weights (normalized by |sum|), so a harmful model also loses affinity.
- The payload also carries ``start.*``, the server's copy of the client's model (the initial
  model until the client first uploads), from which a client without state starts: one model
  more per download than a deployment needs after the first visit.
- Per-client server quantities (every model, P, each client's picks) are allocated at the first
  server round, when the population size I is known; until then every copy is the initial model.
- The exploration stream is a generator kept in the server state (checkpointed with it), seeded
  from the initial model (and so from the run's seed).
- The server stores the uploaded models as they are: a run that sets a server optimizer or
  ``server_lr`` is refused.

A client that never trained (``join``) starts from the average of all clients' latest models
(``params``) and trains it locally on its training data with the run's schedule, which is what
a FedFomo client does in a round where no downloaded model helps it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.table import OWN, ModelTable
from pflego.fields import at_least, between, non_negative, setting
from pflego.local import train_steps
from pflego.loss import Objective
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

PEER = "peer."
START = "start."
WEIGHTS = "fomo.weights"


@register("fedfomo")
@dataclass(frozen=True)
class FedFomo(ModelTable):
    num_models: int = setting(
        5, "how many other clients' models each client downloads (M)", at_least(1)
    )
    epsilon: float = setting(
        0.3, "the probability of downloading a random model instead of a best one", between(0, 1)
    )
    epsilon_decay: float = setting(0.05, "how much epsilon falls per round", non_negative)

    uses_validation: ClassVar[bool] = True

    # --- server side --------------------------------------------------------------------------

    def init_server(self, params):
        generator = torch.Generator().manual_seed(seed_from(params))
        return {"params": params, "rng": {"state": generator.get_state()}}

    def peers(self, num_clients: int) -> int:
        """M, or fewer when the population has fewer other clients."""
        return min(self.num_models, num_clients - 1)

    def downlink(self, server, ctx, clients=None):
        """Per client: its server-side model (``start.*``) and its M picks (``peer.*``).

        A newcomer gets the average of all clients' latest models as ``start.*``.
        """
        if clients is None:
            return {START + k: v for k, v in server["params"].items()}
        m = self.peers(ctx.num_clients)
        if "models" not in server:  # before the first server round every copy is the initial one
            start = {k: v.expand(len(clients), *v.shape) for k, v in server["params"].items()}
            peers = {k: v.expand(len(clients), m, *v.shape) for k, v in server["params"].items()}
        else:
            picks = server["picks"]["ids"][clients.cpu()]
            start = {k: v[clients.to(v.device)] for k, v in server["models"].items()}
            peers = {k: v[picks.to(v.device)] for k, v in server["models"].items()}
        return {START + k: v for k, v in start.items()} | {PEER + k: v for k, v in peers.items()}

    def server_round(self, server, out, ctx, clients):
        num, m = ctx.num_clients, self.peers(ctx.num_clients)
        if "affinity" in server:
            affinity, picks = server["affinity"]["P"].clone(), server["picks"]["ids"]
        else:
            affinity = torch.zeros(num, num, dtype=torch.float64)
            picks = initial_picks(num, m)
        server = self.store(server, out, ctx, clients)
        clients = clients.to(torch.int64).cpu()
        weights = out.upload[WEIGHTS].detach().double().cpu()
        affinity.index_put_((clients[:, None], picks[clients]), weights, accumulate=True)
        generator = torch.Generator()
        generator.set_state(server["rng"]["state"].cpu())
        epsilon = max(0.0, self.epsilon - (ctx.round + 1) * self.epsilon_decay)
        return {
            **server,
            "params": {k: v.mean(0) for k, v in server["models"].items()},
            "affinity": {"P": affinity},
            "picks": {"ids": epsilon_greedy(affinity, m, epsilon, generator)},
            "rng": {"state": generator.get_state()},
        }

    # --- client side --------------------------------------------------------------------------

    def init_client(self, downlink, generator, ctx):
        return {OWN + k[len(START) :]: v for k, v in downlink.items() if k.startswith(START)}

    def weights(self, own: Params, peers: Params, data: ClientData) -> Tensor:
        """w_ij of every downloaded model (``peers``: ``[M, ...]``) on the validation data."""
        val = data.validation

        def loss(params: Params) -> Tensor:
            return self.loss(params, val["x"], val["y"], val["mask"], data.label_mask)

        own_loss = loss(own)
        count = next(iter(peers.values())).shape[0]
        gains = []
        for j in range(count):
            theirs = {k: v[j] for k, v in peers.items()}
            distance = tree.sq_norm(tree.sub(theirs, own)).sqrt()
            gain = (own_loss - loss(theirs)) / torch.where(distance > 0, distance, 1.0)
            gains.append(torch.where(distance > 0, gain, 0.0).clamp(min=0))
        if not gains:
            return own_loss.new_zeros(0)
        gains = torch.stack(gains)
        total = gains.sum()
        return torch.where(total > 0, gains / torch.where(total > 0, total, 1.0), 0.0)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        own = {k[len(OWN) :]: v for k, v in state.items()}
        peers = {k[len(PEER) :]: v for k, v in downlink.items() if k.startswith(PEER)}
        w = self.weights(own, peers, data)
        combined = {k: v + torch.tensordot(w, peers[k] - v, dims=1) for k, v in own.items()}
        trained, mean_loss = self.train(combined, data, ctx)
        upload = {OWN + k: v for k, v in trained.items()} | {WEIGHTS: w}
        out = ClientOut(upload, data.num_samples, {"loss": mean_loss})
        return out, {OWN + k: v for k, v in trained.items()}

    def train(self, params: Params, data: ClientData, ctx: RoundContext) -> tuple[Params, Tensor]:
        """Local training of the whole model on the training split."""
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            Objective(self.model, data.label_mask),
            params,
            data,
            opt,
            opt.init(params),
            ctx.client_lr,
        )
        return trained, mean_loss

    def join(self, downlink, state, data, ctx):
        own = {k[len(OWN) :]: v for k, v in state.items()}
        return {OWN + k: v for k, v in self.train(own, data, ctx)[0].items()}

    def predict(self, downlink, state, x):
        return self.model.forward({k[len(OWN) :]: v for k, v in state.items()}, x)


def seed_from(params: Params) -> int:
    """A 63-bit seed from the parameters' values (the initial model depends on the run's seed)."""
    digest = hashlib.sha256()
    for k in sorted(params):
        digest.update(params[k].detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def initial_picks(num_clients: int, m: int) -> Tensor:
    """``[I, M]`` placeholder picks before the first round: the next M clients (all hold the
    initial model then, so the choice does not matter)."""
    return (torch.arange(num_clients)[:, None] + torch.arange(1, m + 1)[None, :]) % num_clients


def epsilon_greedy(affinity: Tensor, m: int, epsilon: float, generator: torch.Generator) -> Tensor:
    """``[I, M]`` picks per client among the others: random with probability ``epsilon``, else the
    highest remaining affinity (ties at random)."""
    num = affinity.shape[0]
    picks = np.zeros((num, m), dtype=np.int64)
    scores = affinity.double().cpu().numpy()
    for i in range(num):
        tiebreak = torch.rand(num, generator=generator, dtype=torch.float64).numpy()
        order = [j for j in np.lexsort((tiebreak, -scores[i])) if j != i]
        shuffled = [j for j in torch.randperm(num, generator=generator).tolist() if j != i]
        explore = (torch.rand(m, generator=generator, dtype=torch.float64) < epsilon).tolist()
        chosen: list[int] = []
        for wander in explore:
            source = shuffled if wander else order
            chosen.append(next(j for j in source if j not in chosen))
        picks[i] = chosen
    return torch.from_numpy(picks)

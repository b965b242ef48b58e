"""FedAMP: attentive message passing; each client is pulled toward its own "cloud model".

Huang, Chu, Zhou, Wang, Liu, Pei, Zhang. "Personalized Cross-Silo Federated Learning on Non-IID
Data". AAAI 2021; arXiv:2007.03797.

The clients' personalized models W = (w_1, ..., w_I) minimize
``sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2)`` with the attention-inducing function
``A(x) = 1 - exp(-x / sigma)``, by alternating two steps per round k:

- Server (message passing, a gradient step of size alpha_k on the attention term): for every
  client i the personalized cloud model ``u_i = sum_j xi_ij w_j`` with
  ``xi_ij = alpha_k A'(||w_i - w_j||^2) = (alpha_k / sigma) exp(-||w_i - w_j||^2 / sigma)`` for
  j != i and ``xi_ii = 1 - sum_{j != i} xi_ij``.
- Client i (a proximal step): ``w_i = argmin_w F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2``,
  here the run's local steps with the client optimizer, starting from u_i; it uploads w_i.

Symbols to code: w_i -> the client state ``model.*`` and the server's table ``server["models"]``
``[I, ...]`` (``ModelTable``); u_i -> the downlink (``server["cloud"]``, computed after every
server round); xi -> ``server["amp"]["xi"]`` ``[I, I]``; lambda, alpha_k, sigma -> ``lam``,
``alpha``, ``sigma``; the local solver's step size -> ``ctx.client_lr``.

Deliberate differences and choices:
- Defaults ``lam = alpha = sigma = 1``: PFLlib's. The paper's values for its data sets were not
  available offline; the reimplementations in FLGo and Fling use alpha_k = 1e4 (decayed by 0.1
  every 30 rounds), lambda = 1 and sigma = 25 or 100, tuned for large convolutional models, whose
  models are far apart. alpha_k is constant here (the paper's analysis takes a constant step).
  With many close models the xi_ij of the default may sum past 1 (xi_ii < 0, an extrapolation):
  that is the paper's rule, which only guarantees a convex combination for small alpha_k.
- u_i uses every client's latest model on the server (the initial model until it trains), as the
  paper's cross-silo setting with every client in every round; PFLlib uses only the models
  uploaded in the last round, and its client keeps training its own w_i with a regularizer that
  has no gradient (built from ``.data``). Here, as in FLGo, the local solve starts at u_i.
- A client that has not trained yet is evaluated with u_i.

A client that never trained (``join``) receives the average of all clients' latest models as its
cloud model and makes one proximal solve toward it on its training data (the run's schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.table import OWN, ModelTable
from pflego.fields import non_negative, positive, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState


def attention(models: Params, alpha: float, sigma: float) -> Tensor:
    """xi ``[I, I]`` (float64) of the stacked models ``[I, ...]``."""
    flat = torch.cat([v.detach().flatten(1).double() for v in models.values()], 1)
    distances = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    xi = alpha / sigma * torch.exp(-distances / sigma)
    xi.fill_diagonal_(0.0)
    return xi + torch.diag(1 - xi.sum(1))


@register("fedamp")
@dataclass(frozen=True)
class FedAMP(ModelTable):
    lam: float = setting(1.0, "strength lambda of the attention term", non_negative)
    alpha: float = setting(1.0, "step size alpha_k of the server's message passing", positive)
    sigma: float = setting(
        1.0, "scale sigma of the attention function 1 - exp(-x / sigma)", positive
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    default_client_lr: ClassVar[float] = 0.1  # the defaults study's choice (0.3: 18% below)

    # --- server: the table of w_1..w_I (``ModelTable``) and the cloud models ---------------------

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """u_i for each of ``clients``; a newcomer gets the average of the latest models."""
        if clients is None or "cloud" not in server:
            return self.initial(server, clients)
        return {k: v[clients.to(v.device)] for k, v in server["cloud"].items()}

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """Store the cohort's w_i, then pass messages: every u_i from every latest w_j."""
        server = self.store(server, out, ctx, clients)
        models = server["models"]
        xi = attention(models, self.alpha, self.sigma)
        cloud = {k: torch.tensordot(xi.to(v), v, dims=1) for k, v in models.items()}
        mean = {k: v.mean(0) for k, v in models.items()}
        return {**server, "params": mean, "cloud": cloud, "amp": {"xi": xi}}

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """No w_i yet (``trained`` 0): until it trains, the client's model is its u_i."""
        first = next(iter(downlink.values()))
        return {**tree.add_prefix(OWN, tree.zeros_like(downlink)), "trained": first.new_zeros(())}

    def personal_model(self, downlink: Params, state: ClientState) -> Params:
        """w_i once the client has trained, else u_i."""
        return tree.where(state["trained"] > 0, tree.strip_prefix(OWN, state), downlink)

    def solve(self, cloud: Params, data: ClientData, ctx: RoundContext) -> tuple[Params, Tensor]:
        """Local steps on F_i(w) + lambda / (2 alpha) ||w - u_i||^2 from w = u_i."""
        return self.train(cloud, data, ctx, anchor=cloud, strength=self.lam / self.alpha)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        model, mean_loss = self.solve(downlink, data, ctx)
        new_state = {**tree.add_prefix(OWN, model), "trained": torch.ones_like(state["trained"])}
        return ClientOut(tree.add_prefix(OWN, model), data.num_samples, {"loss": mean_loss}), (
            new_state
        )

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.personal_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer's proximal solve toward the average of the latest models."""
        model, _ = self.solve(downlink, data, ctx)
        return {**tree.add_prefix(OWN, model), "trained": torch.ones_like(state["trained"])}

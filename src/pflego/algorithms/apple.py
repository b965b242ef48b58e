"""APPLE: each client learns how much of every client's core model its personalized model takes.

Luo, Wu. "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated Learning".
IJCAI 2022; arXiv:2110.08394. Authors' code: github.com/ljaiverson/pFL-APPLE.

Every client i owns a core model w_i and a directed relationship (DR) vector p_i over all I
clients; its personalized model is the combination of every client's core model,

    w_hat_i = sum_j p_ij w_j.

A sampled client downloads the latest core models of all clients and minimizes, on minibatches,

    F_i(w_hat_i) + lambda(r) mu ||p_i - p_i^(0)||^2

over its own core w_i (gradient p_ii grad F_i(w_hat_i)) and p_i (gradient
``<grad F_i(w_hat_i), w_j> + 2 lambda(r) mu (p_ij - p_ij^(0))``), the others' cores fixed; it
uploads w_i, which the server stores for the others to download. The proximal term pulls p_i
toward its initial value early on (a FedAvg-like start) and fades with the loss scheduler
lambda(r): ``0.001^(r / L)`` (exponential, the authors' default) or ``(cos(pi r / L) + 1) / 2``
(cosine) for rounds r < L, and 0 from round L on.

Symbols to code: w_j -> the downlink ``core.*`` ``[I, ...]`` (the server's ``server["cores"]``);
which of them is the client's own -> the downlink's one-hot ``own`` ``[I]``; p_i -> the state
``p``; p_i^(0) -> 1/I everywhere; the core models' step size -> ``ctx.client_lr``; the DR
vectors' -> ``dr_lr`` (0.001, the authors' ``lr_coef``); mu -> ``mu`` (0.1); L ->
``int(reg_fraction * horizon)`` (0.1 of the authors' 160 rounds); the scheduler -> ``scheduler``.
Both take steps of the run's client optimizer (the authors': SGD with momentum 0.9, restarted
every round, lr 0.01 for the cores).

Deliberate differences and choices:
- p_i^(0), and p_i's start, are uniform (1/I); the authors' code starts both at the clients'
  shares of the training samples N_j / N, which a client cannot know for the others before they
  have trained. The proximal term is ``lambda(r) mu ||p - p^(0)||^2`` without a 1/2, as the
  authors' code writes it.
- The algorithm does not see the run's length: L is ``reg_fraction`` of ``horizon`` rounds (set
  ``horizon`` to the run's ``rounds``).
- Every client's core model starts as the run's initial model (``own_init`` false, the default),
  so until they train the DR gradients toward the other clients are identical; the authors' code
  draws a separate random initialization per client: ``own_init: true``, client j's drawn from
  the run's seed and j. The default keeps the existing results.
- Every client downloads all I core models every round (the authors' default; their option to
  download only M of them, picked by |p_ij|, is not offered). A client that has not trained yet
  has its initial model as its core. Only the sampled clients train (the authors' simulation
  trains every client every round, the cross-silo setting).
- PFLlib's version multiplies the cores' step size by I and replaces the exact DR gradient by a
  mean over parameter tensors of element-wise products; here both are as in the authors' code.

A client that never trained (``join``) has no core model of its own: it learns its DR vector over
the trained clients' cores on its training data with the run's schedule (a DR-only round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, between, non_negative, one_of, setting
from pflego.loss import masked_cross_entropy
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

CORE, OWN = "core.", "own"
INIT_STREAM = 19  # the random stream of the clients' own initial core models (``own_init``)


@register("apple")
@dataclass(frozen=True)
class APPLE(Algorithm):
    server_step: ClassVar[str] = "own"  # the server stores the uploaded core models as they are
    dr_lr: float = setting(
        0.001,
        "step size of the directed-relationship vectors p_i (the authors' lr_coef)",
        non_negative,
    )
    mu: float = setting(
        0.1, "strength of the proximal term that pulls p_i toward its start", non_negative
    )
    scheduler: str = setting(
        "exponential",
        "how the proximal term fades: exponential or cosine",
        one_of("exponential", "cosine", says="must be one of"),
    )
    reg_fraction: float = setting(
        0.1, "the share of horizon over which the proximal term fades (L)", between(0, 1)
    )
    horizon: int = setting(
        160, "the rounds the schedule spans (set it to the run's rounds)", at_least(1)
    )
    own_init: bool = setting(
        False, "start every client's core model from its own random initialization (the authors')"
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False
    # the core models' step size: the least worst-case regret over three federations of
    # benchmarks/defaults_study.py (docs/defaults.md); at 0.05 its 20 rounds barely started
    default_client_lr: ClassVar[float] = 0.3

    def proximal_weight(self, round_: int) -> float:
        """lambda(r) mu: the loss scheduler times mu (0 from round L on)."""
        rounds = int(self.horizon * self.reg_fraction)
        if self.mu == 0 or round_ >= rounds:
            return 0.0
        if self.scheduler == "cosine":
            return (math.cos(math.pi * round_ / rounds) + 1) / 2 * self.mu
        return 0.001 ** (round_ / rounds) * self.mu

    # --- server ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> ServerState:
        """The initial model; every client's core is it until the client trains."""
        return {"params": params}

    def cores(self, server: ServerState, ctx: RoundContext) -> Params:
        """Every client's latest core model, ``[I, ...]``: before the first round the initial
        model, or with ``own_init`` client j's own, drawn from the run's seed and j."""
        if "cores" in server:
            return server["cores"]
        params = server["params"]
        if not self.own_init:
            return {k: v.expand(ctx.num_clients, *v.shape) for k, v in params.items()}
        first = next(iter(params.values()))
        inits = [
            self.init_params(seed_for(ctx.seed, INIT_STREAM, j), first.dtype)
            for j in range(ctx.num_clients)
        ]
        return {k: torch.stack([init[k] for init in inits]).to(v.device) for k, v in params.items()}

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """All core models, and which one is the client's own (none for a newcomer)."""
        cores = tree.add_prefix(CORE, self.cores(server, ctx))
        first = next(iter(cores.values()))
        if clients is None:
            return {**cores, OWN: first.new_zeros(ctx.num_clients)}
        own = torch.nn.functional.one_hot(clients.to(torch.int64), ctx.num_clients)
        stacked = {k: v.expand(len(clients), *v.shape) for k, v in cores.items()}
        return {**stacked, OWN: own.to(first.dtype).to(first.device)}

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """Store the cohort's new core models."""
        cores = {k: v.clone() for k, v in self.cores(server, ctx).items()}
        for k, v in cores.items():
            v[clients.to(v.device)] = out.upload[CORE + k].to(v.dtype)
        return {"params": {k: v.mean(0) for k, v in cores.items()}, "cores": cores}

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """p_i = p_i^(0) = 1/I."""
        return {"p": torch.full_like(downlink[OWN], 1 / ctx.num_clients)}

    @staticmethod
    def combine(cores: Params, p: Tensor) -> Params:
        """sum_j p_j w_j."""
        return {k: torch.tensordot(p, v, dims=1) for k, v in cores.items()}

    def descend(
        self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext
    ) -> tuple[Params, Tensor, Tensor]:
        """The round's steps on (w_i, p_i); returns the new core, p_i and the mean loss."""
        cores, own = tree.strip_prefix(CORE, downlink), downlink[OWN]
        start = self.combine(cores, own)  # the server's copy of w_i (zeros for a newcomer)
        p0 = torch.full_like(state["p"], 1 / ctx.num_clients)
        weight = self.proximal_weight(ctx.round)

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            p = params[".p"]
            mine = p @ own  # p_ii
            personal = {
                k: v + mine * (params[k] - start[k]) for k, v in self.combine(cores, p).items()
            }
            ce = masked_cross_entropy(self.model.forward(personal, x), y, mask, data.label_mask)
            return ce + weight * ((p - p0) ** 2).sum()

        step = grad_and_value(loss)
        opt = self.client_optimizer
        core, p = start, state["p"]
        core_opt, p_opt = opt.init(core), opt.init({".p": p})
        total, count = torch.zeros(()), torch.zeros(())
        for idx, bmask in zip(data.batches, data.batch_mask):
            grads, value = step({**core, ".p": p}, data.x[idx], data.y[idx], bmask)
            active = bmask.sum() > 0
            core, core_opt = opt.masked_update(
                core, {k: grads[k] for k in core}, core_opt, ctx.client_lr, active
            )
            moved, p_opt = opt.masked_update(
                {".p": p}, {".p": grads[".p"]}, p_opt, self.dr_lr, active
            )
            p = moved[".p"]
            total = total + torch.where(active, value.detach(), 0.0)
            count = count + active.to(count.dtype)
        return core, p, total / count.clamp(min=1)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        core, p, mean_loss = self.descend(downlink, state, data, ctx)
        out = ClientOut(tree.add_prefix(CORE, core), data.num_samples, {"loss": mean_loss})
        return out, {**state, "p": p}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The personalized model sum_j p_ij w_j."""
        return self.model.forward(self.combine(tree.strip_prefix(CORE, downlink), state["p"]), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer learns its DR vector over the trained clients' cores (they stay fixed)."""
        return {**state, "p": self.descend(downlink, state, data, ctx)[1]}

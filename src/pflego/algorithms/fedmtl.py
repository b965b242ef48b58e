"""FedMTL: PFLlib's federated multi-task learning, each client's model regularized by the cohort's.

PFLlib's ``FedMTL`` (``servermtl.py``, ``clientmtl.py``), which it attributes to MOCHA: Smith,
Chiang, Sanjabi, Talwalkar. "Federated Multi-Task Learning". NeurIPS 2017; arXiv:1705.10467.
It is not MOCHA's algorithm (pflego's ``mocha``: linear models, dual SDCA steps, a learned task
relationship Omega); it keeps MOCHA's regularizer ``tr(W Omega W^T)``-style coupling of the
clients' whole models with a fixed Omega, and trains them by SGD on the primal.

Every client i keeps its own model w_i (never averaged), all starting from the same initial
model. In round t the server stacks the cohort's r current models as the columns of W; sampled
client i replaces its own column by the model it trains and takes the run's local steps on

    L_i(w) + c (||W||_F^2 + omega^2 ||W 1||^2),   W 1 = w + s_i,  s_i = sum_{j in S, j != i} w_j,

with ``omega = sqrt(Omega_11) = 1 - 1/r`` for PFLlib's ``Omega = (1 1^T - 1 1^T / r)^2``
(element-wise; its ``I`` is a matrix of ones, so every entry of Omega is (1 - 1/r)^2) and
``c = 10^-f``, ``f = floor(log10(d) + 1) + 1`` for d the model's number of parameters. Up to
a constant in w, the penalty is the proximal term ``(rho / 2) ||w - a_i||^2`` with
``rho = 2 c (1 + omega^2)`` and ``a_i = -omega^2 s_i / (1 + omega^2)``, which is how the local
steps take it (``Algorithm.train``'s ``anchor`` and ``strength``: its gradient in closed form).
The client uploads w_i, which the server stores.

Symbols to code: w_i -> the client state ``model.*`` (with ``trained``) and the server's table
``server["models"]`` ``[I, ...]`` (``ModelTable``); s_i -> the downlink's ``others.*``; the
initial model -> ``server["params"]``, sent beside s_i (a client's model until it first trains);
r -> ``ctx.cohort_size``; omega, c, rho, a_i -> computed in ``penalty``.

Deliberate differences and choices:
- d counts the model's parameters (PFLlib flattens the ``state_dict``, which also holds
  batch-norm buffers); the constant part of the penalty (the other models' norms) is left out of
  the logged loss.
- The cohort's columns are the models the server holds for them (the initial model for a client
  that has not trained), as PFLlib's server reads its clients' models.
- The server optimizer and ``server_lr`` are not used (``server_step = "own"``); differential
  privacy and SecAgg+ are refused (``sum_aggregate = False``): the server keeps every model.

Prediction: the client's own w_i (the initial model before it trains). A client that never
trained (``join``) has no cohort: it trains the initial model on its data (the penalty of a
cohort of one, omega = 0, is c ||w||^2), its first round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.table import OWN, ModelTable
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

OTHERS, TRAINED = "others.", "trained"


@register("fedmtl")
@dataclass(frozen=True)
class FedMTL(ModelTable):
    personal: ClassVar[tuple[str, ...]] = ("body", "head")

    # --- server: the table of w_1..w_I (``ModelTable``: the initial model until trained) --------

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The initial model and s_i, the sum of the other cohort members' models; a newcomer
        gets the initial model."""
        if clients is None:
            return self.initial(server)
        cohort = {k: v[clients.to(v.device)] for k, v in self.stored(server, ctx).items()}
        others = {k: v.sum(0, keepdim=True) - v for k, v in cohort.items()}
        return {**self.initial(server, clients), **tree.add_prefix(OTHERS, others)}

    def evaluation_downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The initial model (without s_i, which only training reads)."""
        return self.initial(server, clients)

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """No own model yet (``trained`` 0): until it trains, the initial model stands in."""
        model = self.model_of(downlink)
        first = next(iter(model.values()))
        return {**tree.add_prefix(OWN, tree.zeros_like(model)), TRAINED: first.new_zeros(())}

    def model_of(self, downlink: Params) -> Params:
        return {k: v for k, v in downlink.items() if not k.startswith(OTHERS)}

    def personal_model(self, downlink: Params, state: ClientState) -> Params:
        """w_i once the client has trained, else the initial model."""
        return tree.where(
            state[TRAINED] > 0, tree.strip_prefix(OWN, state), self.model_of(downlink)
        )

    def penalty(self, others: Params, cohort: float) -> tuple[Params, float]:
        """The anchor a_i and strength rho of the cohort's penalty as a proximal term."""
        size = sum(v.numel() for v in others.values())
        c = 10.0 ** -(int(math.log10(size) + 1) + 1)
        omega2 = (1 - 1 / cohort) ** 2
        return tree.scale(others, -omega2 / (1 + omega2)), 2 * c * (1 + omega2)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """Local steps on L_i plus the cohort's penalty from w_i; uploads the new w_i."""
        anchor, strength = self.penalty(tree.strip_prefix(OTHERS, downlink), ctx.cohort_size)
        start = self.personal_model(downlink, state)
        trained, mean_loss = self.train(start, data, ctx, anchor=anchor, strength=strength)
        new_state = {**tree.add_prefix(OWN, trained), TRAINED: torch.ones_like(state[TRAINED])}
        out = ClientOut(tree.add_prefix(OWN, trained), data.num_samples, {"loss": mean_loss})
        return out, new_state

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.personal_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer's first round: the initial model trained with a cohort of one's penalty."""
        model = self.model_of(downlink)
        anchor, strength = self.penalty(tree.zeros_like(model), 1.0)
        trained, _ = self.train(model, data, ctx, anchor=anchor, strength=strength)
        return {**tree.add_prefix(OWN, trained), TRAINED: torch.ones_like(state[TRAINED])}

"""PFL-DA: personalized federated learning via domain adaptation; private feature maps adapt each
client's data to a shared head.

Shi, Al Kontar. "Personalized Federated Learning via Domain Adaptation with an Application to
Distributed 3D Printing". Technometrics, 2023 (doi:10.1080/00401706.2022.2157882); no arXiv
version is known to us. Authors' code: UMDataScienceLab/Personalized_FL_with_DA (the ``PDA``
runs of ``sine_regression/sineregression.py``); peer implementation read: PFLlib
(TsingZ0/PFLlib, ``clientda.py`` / ``serverda.py``).

Client i keeps a private feature map Phi_i (the domain adaptation: it maps the client's inputs to
the domain the shared decoder reads) and a private decoder d_i; the server keeps a global decoder
g. When sampled, client i
(a) trains Phi_i together with its copy g_i of g (from g) on its loss of g_i(Phi_i(x));
(b) starts its decoder at the mix d_i <- beta g + (1 - beta) d_i and trains it on its loss of
    d_i(Phi_i(x)), Phi_i fixed;
and uploads g_i; the server averages the copies (weighted by N_i). The client predicts with
d_i(Phi_i(x)).

Symbols to code: Phi_i -> the state ``body.*``; d_i -> the state ``personal.head.*``; g -> the
shared ``head.*`` (a C-way head, the ``global`` label space, which d_i shares); beta -> ``beta``
(0.9, the authors' code); the losses -> the masked cross-entropy; (a) -> ``train`` on the body and
g_i with the client optimizer and ``ctx.client_lr`` (its steps may run fused); (b) -> ``train_head``
on the trained body's features, the same schedule.

Deliberate differences and choices:
- The authors interleave (a) and (b) step by step on the same batch, with an adaptive number of
  inner epochs and a reset of a client whose loss diverges; pflego runs (a)'s steps, then (b)'s,
  on the run's schedule, without resets. PFLlib trains the personal head first, on the old
  feature map, then (a); it does not mix the decoders (beta = 0 here), and its penalty
  ``lamda * ||g - d_i||`` is computed from detached copies, so it never moves anything (left out).
- The authors average the decoders with equal weights; pflego (as PFLlib) weights them by N_i.
- Every Phi_i starts as the run's initial body w^0 (from its seed; the authors draw one per
  client) and d_i as a head from the client's first-visit generator, so a first-visit state does
  not depend on the downlink.

Unseen clients (``join``): a first visit's (a) and (b) on ``adapt_schedule``'s batches (the run's
local schedule); they predict with d_i(Phi_i(x)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, setting
from pflego.models import init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

PERSONAL = "personal."


@register("pflda")
@dataclass(frozen=True)
class PFLDA(Algorithm):
    beta: float = setting(
        0.9,
        "weight beta of the global decoder in each visit's start of the personal one",
        between(0, 1),
    )

    shared: ClassVar[tuple[str, ...]] = ("head",)
    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    label_space: ClassVar[str] = "global"

    def init_server(self, params: Params) -> ServerState:
        """The global decoder g (the body of w^0 is every client's first feature map)."""
        return super().init_server(tree.select(params, ["head"]))

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """Phi_i = the body of w^0; d_i a head drawn from the client's generator."""
        first = next(iter(downlink.values()))
        body = tree.select(self.init_params(ctx.seed, first.dtype), ["body"])
        head = init_head(
            self.head_width, self.model.feature_dim, generator, self.head_init, first.dtype
        )
        return {
            **tree.to(body, first.device),
            **tree.add_prefix(PERSONAL, tree.to(head, first.device)),
        }

    def visit(self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext):
        """The trained g_i, the new state (Phi_i, d_i) and (a)'s mean loss."""
        adapted, mean_loss = self.train({**tree.select(state, ["body"]), **downlink}, data, ctx)
        body, g = tree.select(adapted, ["body"]), tree.select(adapted, ["head"])
        start = {
            k: self.beta * downlink[k] + (1 - self.beta) * v
            for k, v in tree.strip_prefix(PERSONAL, state).items()
        }
        decoder = self.train_head(body, start, data, ctx)
        return g, {**body, **tree.add_prefix(PERSONAL, decoder)}, mean_loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        g, new_state, mean_loss = self.visit(downlink, state, data, ctx)
        out = ClientOut(tree.sub(downlink, g), data.num_samples, {"loss": mean_loss})
        return out, new_state

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """d_i(Phi_i(x))."""
        body = tree.select(state, ["body"])
        return self.model.forward({**body, **tree.strip_prefix(PERSONAL, state)}, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A first visit's feature-map adaptation and decoder training."""
        return self.visit(downlink, state, data, ctx)[1]

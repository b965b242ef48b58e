"""PeFLL: an embedding network describes each client, a hypernetwork turns that into its model.

Scott, Zakerinia, Lampert. "PeFLL: Personalized Federated Learning by Learning to Learn".
ICLR 2024; arXiv:2306.05515. Authors' code: github.com/pefllauthors/PeFLL (``train.py``,
``models.py``); FL-bench's ``src/{server,client}/pefll.py`` (KarhouTam/FL-bench), both read for
the details below.

Two networks are learned jointly: an embedding network phi_E that maps a client's data S_i to a
descriptor ``v_i = (1/|S_i|) sum_{(x, y) in S_i} phi_E(x, y)``, and a hypernetwork h(.; eta_h)
that maps a descriptor to the client's whole model ``theta_i = h(v_i; eta_h)``; the objective is
``min_{eta_E, eta_h} sum_i L_i(h(phi_E(S_i); eta_h))``. A round (the paper's Algorithm 1):

- client i computes v_i, and receives theta_i = h(v_i; eta_h);
- it takes k local steps from theta_i to theta~_i; ``Delta theta_i = theta_i - theta~_i``;
- the chain rule pulls Delta theta_i back through h and phi_E:
  ``g_h = (d theta_i / d eta_h)^T Delta theta_i``, ``g_v = (d theta_i / d v_i)^T Delta theta_i``,
  ``g_E = (d v_i / d eta_E)^T g_v``;
- the server averages (g_E, g_h) over the cohort and takes one optimizer step on (eta_E, eta_h).

Symbols to code: eta_E -> ``server["params"]["embed.*"]``; eta_h -> ``server["params"]["hyper.*"]``
(pFedHN's hypernetwork, ``models.hypernet.generate``: the same layers and initialization); v_i -> the
client state's ``embedding`` (the descriptor it last used); Delta theta_i -> pulled back on the
client (``torch.func.vjp``) into the upload (g_E, g_h); k and the inner step size -> the run's
local schedule, client optimizer and ``ctx.client_lr``; the server's Adam step size and gradient
clipping -> ``hyper_lr``, ``max_grad_norm``; the descriptor's width -> ``embedding_dim``.

Defaults from the authors' ``train.py``: Adam with lr 2e-4 on both networks (no weight decay:
their ``wd`` goes only to their SGD option), the mean of the cohort's gradients clipped to norm 50
before the step, ``hidden_dim = 100``, ``hidden_layers = 3``, e = ``int(1 + I / 4)``.

Deliberate differences and choices:
- Where the pulled-back gradients are computed. The paper keeps eta_h on the server: v_i goes up,
  theta_i down, Delta theta_i up, g_v down and g_E up (two exchanges a round). Here, as in
  FL-bench, the downlink is both networks and each client computes theta_i and the whole pull-back
  itself, uploading (g_E, g_h): one exchange a round, the same numbers, a downlink about
  ``hidden_dim`` times the model's size. The contract needs no extension for it (docs/design.md).
- The embedding network: the authors' default is a LeNet over the image with the one-hot label as
  extra channels (FL-bench's too; their ``MLPEmbed`` is an option). Here it is an MLP over the
  flattened input concatenated with the one-hot label, ``Linear(d + C, embed_hidden) -> ReLU ->
  Linear(embed_hidden, embed_hidden) -> ReLU -> Linear(embed_hidden, e)``, so that it fits every
  input shape; ``nn.Linear``'s initialization.
- The descriptor is the mean over the client's whole training split, as the paper writes it (the
  authors and FL-bench: over its first minibatch, ``embed_batches = 1``, whose expectation this
  is). It is not rescaled: the authors standardize every descriptor by the mean and standard
  deviation of the coordinates of the first descriptor they compute (constants set by whichever
  client comes first), FL-bench each descriptor by its own, which for the small e of a small
  population (e = 2 for I < 8) leaves the descriptor no freedom (two standardized coordinates are
  always +-1/sqrt(2)) and the embedding network no gradient.
- Clients weigh equally in the mean of the gradients (the authors' plain mean).
- The local steps are the run's (client optimizer, weight decay, ``client_lr``, schedule); the
  authors' inner loop is 50 steps of SGD with momentum 0.9, lr 2e-3, weight decay 5e-5, batch 32,
  with gradients clipped to norm 50.
- The authors evaluate with absent classes masked (``mask_absent``); here the model's logits over
  all C classes are evaluated, as for every other method.

Evaluation (``adapt``) and a client that never trained (``join``, the same): the client computes
its descriptor from its training split with the current eta_E and predicts with h(v; eta_h), no
local steps (the paper's point: a new client gets its model from one forward pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import vjp

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, non_negative, positive, setting
from pflego.models import hypernet
from pflego.optim import Adam
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

EMBED, HYPER = "embed.", "hyper."  # the two networks' entries (HYPER as pFedHN's)
EMBEDDING = "embedding"  # the client's descriptor v_i, [e]


@register("pefll")
@dataclass(frozen=True)
class PeFLL(Algorithm):
    """PeFLL (see the module docstring); options are the two networks and the server's Adam."""

    hyper_lr: float = setting(2e-4, "Adam step size of the embedding and hypernetworks", positive)
    hidden_dim: int = setting(100, "width of the hypernetwork's hidden layers", at_least(1))
    hidden_layers: int = setting(3, "hidden layers of the hypernetwork", non_negative)
    embed_hidden: int = setting(84, "width of the embedding network's hidden layers", at_least(1))
    embedding_dim: int | None = setting(
        None, "width of the client descriptors (unset: 1 + clients / 4)", at_least(1)
    )
    max_grad_norm: float = setting(
        50.0, "the mean gradient is clipped to this norm", positive.noting(" (inf: none)")
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    server_step: ClassVar[str] = "own"  # Adam on both networks, of step size hyper_lr
    join_trains: ClassVar[bool] = False  # a new client's model is one forward pass

    # --- the two networks -----------------------------------------------------------------------

    def embed(self, params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
        """v = the masked mean of phi_E(x, onehot(y)) over the samples, ``[e]``."""
        onehot = (y[:, None] == torch.arange(self.model.num_classes, device=y.device)).to(x)
        h = torch.cat([x.flatten(1), onehot], 1)
        for j in range(3):
            h = h @ params[f"{EMBED}{j}.weight"].T + params[f"{EMBED}{j}.bias"]
            h = torch.relu(h) if j < 2 else h
        return (mask[:, None] * h).sum(0) / mask.sum()

    def generate(self, params: Params, embedding: Tensor) -> Params:
        """theta = h(v; eta_h), pFedHN's hypernetwork."""
        shapes = hypernet.target_shapes(self.model)
        return hypernet.generate(params, HYPER, embedding, shapes, self.hidden_layers)

    def networks(self, server: ServerState, ctx: RoundContext) -> tuple[Params, Params]:
        """(eta_E, eta_h) and the Adam state; created at first use, seeded by the run's seed."""
        if "opt" in server:
            return server["params"], server["opt"]
        first = next(iter(server["params"].values()))
        gen = torch.Generator().manual_seed(seed_for(ctx.seed, 19))
        e = self.embedding_dim or int(1 + ctx.num_clients / 4)
        width = self.embed_hidden
        inputs = math.prod(self.model.input_shape) + self.model.num_classes
        embed = [(f"{EMBED}0", width, inputs), (f"{EMBED}1", width, width), (f"{EMBED}2", e, width)]
        outputs = {k: math.prod(v) for k, v in hypernet.target_shapes(self.model).items()}
        params = hypernet.init_linear(embed, gen, first)  # drawn first, then the hypernetwork's
        params |= hypernet.init_hypernetwork(
            HYPER, e, self.hidden_dim, self.hidden_layers, outputs, gen, first
        )
        return params, Adam().init(params)

    # --- server ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> ServerState:
        """The target network's initial parameters (their dtype; the networks come at first use)."""
        return {"params": params}

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """Both networks, (eta_E, eta_h)."""
        return self.networks(server, ctx)[0]

    def server_update(
        self, server: ServerState, aggregated: Params, ctx: RoundContext
    ) -> ServerState:
        """One Adam step along the cohort's mean gradient, clipped to ``max_grad_norm``."""
        params, opt = self.networks(server, ctx)
        norm = tree.sq_norm(aggregated).sqrt()  # torch.nn.utils.clip_grad_norm_, as the authors
        grads = tree.scale(aggregated, (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        params, opt = Adam().update(params, grads, opt, self.hyper_lr)
        return {"params": params, "opt": opt}

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """A zero descriptor (replaced by the one it computes when it trains or is evaluated)."""
        return {EMBEDDING: torch.zeros_like(downlink[f"{EMBED}2.bias"])}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """v_i, theta_i = h(v_i), k local steps, and Delta theta_i pulled back to (g_E, g_h)."""

        def model(networks: Params) -> tuple[Params, Tensor]:
            embedding = self.embed(networks, data.x, data.y, data.mask)
            return self.generate(networks, embedding), embedding

        theta, pull_back, embedding = vjp(model, downlink, has_aux=True)
        trained, mean_loss = self.train(theta, data, ctx)
        (grads,) = pull_back(tree.sub(theta, trained))
        weight = torch.ones_like(data.num_samples)  # the authors' plain mean over clients
        return ClientOut(grads, weight, {"loss": mean_loss}), {EMBEDDING: embedding}

    def adapt(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """The descriptor of the client's training split under the current eta_E."""
        return {EMBEDDING: self.embed(downlink, data.x, data.y, data.mask)}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The logits of h(v; eta_h) for the client's descriptor v."""
        return self.model.forward(self.generate(downlink, state[EMBEDDING]), x)

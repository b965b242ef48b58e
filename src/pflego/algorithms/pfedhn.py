"""pFedHN: a hypernetwork on the server generates every client's personal model.

Shamsian, Navon, Fetaya, Chechik. "Personalized Federated Learning using Hypernetworks".
ICML 2021; arXiv:2103.04628. Authors' code: github.com/AvivSham/pFedHN
(``experiments/pfedhn/trainer.py`` and ``models.py``, read for the details below).

The server holds a hypernetwork h(.; phi) and one learned embedding v_i per client; client i's
personal model (the target network) is ``theta_i = h(v_i; phi)``, and the objective is
``min_{phi, v_1..v_n} sum_i L_i(h(v_i; phi))``. A round (the paper's Algorithm 1):

- the server sends theta_i = h(v_i; phi) to each sampled client i;
- client i takes K local steps from theta_i to theta~_i and returns
  ``Delta theta_i = theta_i - theta~_i`` (the direction the server descends along);
- the server pulls Delta theta_i back through the hypernetwork by the chain rule,
  ``grad_phi = (d theta_i / d phi)^T Delta theta_i`` and
  ``grad_{v_i} = (d theta_i / d v_i)^T Delta theta_i`` (a vector-Jacobian product,
  ``torch.func.vjp``), and takes one optimizer step on phi and the embeddings.

Symbols to code: phi -> ``server["params"]["hyper.*"]``; v_1..v_I ->
``server["params"]["embeddings"]`` ``[I, e]``; the optimizer's momentum buffers ->
``server["momentum"]``; theta_i -> the per-client downlink (every entry of the run's model, body
and head; all I of them are generated after each round into ``server["models"]``);
Delta theta_i -> the upload; K and the inner step size -> the run's local schedule, client
optimizer and ``ctx.client_lr``; the hypernetwork's step size, momentum, weight decay and
gradient clipping -> ``hyper_lr``, ``hyper_momentum``, ``hyper_weight_decay``,
``max_grad_norm``; e -> ``embedding_dim``.

The hypernetwork, as the authors' ``CNNHyper``: ``Linear(e, hidden_dim)`` followed by
``hidden_layers`` blocks ``ReLU -> Linear(hidden_dim, hidden_dim)``, then one linear head per
target tensor (its output reshaped to the tensor), with PyTorch's default initialization
(U(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights and biases, N(0, 1) embeddings). Defaults from the
authors' code: ``hidden_dim = 100``, ``hidden_layers = 3``, e = ``int(1 + I / 4)`` (with
``embedding_dim`` unset); SGD with momentum 0.9, lr 1e-2 and weight decay 1e-3 on phi and the
embeddings alike (their ``embed_lr`` defaults to the same lr; a separate one is not offered);
the hypernetwork's gradient clipped to norm 50 (``max_grad_norm``; ``inf`` turns it off).

Deliberate differences and choices:
- The paper's Algorithm 1 writes Delta theta_i = theta~_i - theta_i and then subtracts beta times
  its pull-back, which would ascend; the authors' code uses ``theta_i - theta~_i``, as here.
- The authors' code samples one client per step. With a cohort S of r clients, every answering
  client contributes the authors' per-client step: one momentum step along the sum over S of the
  clients' pull-backs, all taken at the round's phi (the authors' r sequential steps, to first
  order in the step size); clients weigh equally, as in the paper's objective. The clipping acts
  on that sum (on one client's pull-back in the authors' code: the same when r = 1). As in the
  authors' code, whose embedding table is one tensor of the momentum optimizer, an embedding
  keeps moving along its momentum (and decays) in rounds where its client is not sampled.
- The local steps are the run's (client optimizer, weight decay, ``client_lr``, schedule). The
  authors' inner loop is 50 steps of SGD with momentum 0.9, lr 5e-3, weight decay 5e-5, batch 64
  and gradients clipped to norm 50; ``default_client_lr`` is the library's 0.3 (the defaults
  study's choice; their 5e-3 under momentum 0.9 is about 0.05 for plain SGD).
- The personalized model evaluated is h(v_i; phi) itself, without local steps (the authors'
  ``evaluate``); a client that has not trained yet is evaluated with its h(v_i; phi) too.
- e depends on the population I, so phi and the embeddings are created at first use (a
  downlink or the first round), seeded by the run's seed; until the first round
  ``server["params"]`` holds the target network's initial parameters, unused. On Flower, clients
  that enter later get new embedding rows (seeded by their position).
- This is pFedHN, the target network generated whole; pFedHN-PC (personal classifier heads kept
  on the clients) is not offered.

A client that never trained (``join``): as in the paper's generalization to novel clients, phi
stays frozen and only a new embedding is learned. A newcomer's downlink is phi itself (about
``hidden_dim`` times the model's size) and the mean of the server's embeddings; ``join`` takes
the run's local steps (client optimizer, ``client_lr``, ``adapt_schedule``) on the client's loss
L(h(v; phi)) with respect to v alone, from that mean (the client state keeps the shift from it),
and the client is evaluated with h(v; phi). How the paper optimizes the new embeddings (through
the server's round, or by direct gradient) is not known here; for one local step the two take
the same direction.
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
from pflego.fields import at_least, between, non_negative, positive, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import hypernet
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

HYPER = "hyper."
EMBEDDINGS = "embeddings"  # the server's table v_1..v_I, [I, e]
START = "embedding"  # a newcomer's starting embedding in its downlink, [e]
SHIFT = "embedding_shift"  # a newcomer's learned v minus that start (its client state)


@register("pfedhn")
@dataclass(frozen=True)
class PFedHN(Algorithm):
    """pFedHN (see the module docstring); options are the hypernetwork and its optimizer."""

    hyper_lr: float = setting(0.01, "step size of the hypernetwork", positive)
    hyper_momentum: float = setting(
        0.9, "momentum of the hypernetwork's optimizer", between(0, 1, "[)")
    )
    hyper_weight_decay: float = setting(
        0.001, "weight decay of the hypernetwork's optimizer", non_negative
    )
    hidden_dim: int = setting(100, "width of the hypernetwork's hidden layers", at_least(1))
    hidden_layers: int = setting(3, "hidden layers of the hypernetwork", non_negative)
    embedding_dim: int | None = setting(
        None, "width of the client embeddings (unset: 1 + clients / 4)", at_least(1)
    )
    max_grad_norm: float = setting(
        50.0, "the hypernetwork's gradient is clipped to this norm", positive.noting(" (inf: none)")
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    per_client_downlink: ClassVar[bool] = True
    sum_aggregate: ClassVar[bool] = False
    server_step: ClassVar[str] = "own"  # momentum SGD on the hypernetwork, its own settings

    # --- the hypernetwork -----------------------------------------------------------------------

    @property
    def target_shapes(self) -> dict[str, tuple[int, ...]]:
        """The target network's entries and their shapes: ``init_params``'s body and C-way head."""
        return hypernet.target_shapes(self.model)

    def embedding_size(self, num_clients: int) -> int:
        """e: ``embedding_dim``, or the authors' ``int(1 + I / 4)``."""
        return self.embedding_dim or int(1 + num_clients / 4)

    def generate(self, hyper: Params, embeddings: Tensor) -> Params:
        """theta = h(v; phi) for embeddings ``[..., e]``: each target entry ``[..., *shape]``."""
        return hypernet.generate(hyper, HYPER, embeddings, self.target_shapes, self.hidden_layers)

    def init_hypernetwork(self, template: Params, ctx: RoundContext) -> Params:
        """phi with ``nn.Linear``'s initialization, seeded by the run's seed; an empty table."""
        first = next(iter(template.values()))
        gen = torch.Generator().manual_seed(seed_for(ctx.seed, 17))
        e = self.embedding_size(ctx.num_clients)
        outputs = {k: math.prod(s) for k, s in self.target_shapes.items()}
        hyper = hypernet.init_hypernetwork(
            HYPER, e, self.hidden_dim, self.hidden_layers, outputs, gen, first
        )
        return {**hyper, EMBEDDINGS: first.new_zeros((0, e))}

    def hypernetwork(self, server: ServerState, ctx: RoundContext) -> tuple[Params, Params]:
        """phi and the embeddings of the whole population, and their momentum buffers.

        Created at the first use; rows of clients the table does not hold yet (all of them at
        first, late joiners on Flower) are N(0, 1), seeded by the run's seed and their position.
        """
        if "momentum" in server:
            params, momentum = server["params"], server["momentum"]
        else:
            params = self.init_hypernetwork(server["params"], ctx)
            momentum = tree.zeros_like(params)
        table = params[EMBEDDINGS]
        held, e = table.shape
        if held < ctx.num_clients:
            gen = torch.Generator().manual_seed(seed_for(ctx.seed, 18, held))
            rows = torch.randn((ctx.num_clients - held, e), generator=gen, dtype=torch.float32)
            rows = rows.to(table)
            params = {**params, EMBEDDINGS: torch.cat([table, rows])}
            buffer = torch.cat([momentum[EMBEDDINGS], torch.zeros_like(rows)])
            momentum = {**momentum, EMBEDDINGS: buffer}
        return params, momentum

    # --- server ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> ServerState:
        """The target network's initial parameters (their shapes; phi is created at first use)."""
        return {"params": params}

    def personal_models(self, server: ServerState, ctx: RoundContext) -> Params:
        """theta_i = h(v_i; phi) of every client, ``[I, ...]``: kept by the last round, else made.

        Always generated for the whole table at once, so that a client's model does not depend on
        which clients are asked with it (a batched product rounds by its batch size).
        """
        if "models" in server:
            models = server["models"]
            if len(next(iter(models.values()))) >= ctx.num_clients:
                return models
        params, _ = self.hypernetwork(server, ctx)
        return self.generate(params, params[EMBEDDINGS])

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """theta_i = h(v_i; phi) for each of ``clients``; a newcomer gets phi and the mean v."""
        if clients is None:
            params, _ = self.hypernetwork(server, ctx)
            hyper = {k: v for k, v in params.items() if k != EMBEDDINGS}
            return {**hyper, START: params[EMBEDDINGS].mean(0)}
        models = self.personal_models(server, ctx)
        return {k: v[clients.to(v.device)] for k, v in models.items()}

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """One momentum-SGD step on phi and the embeddings along the cohort's summed pull-backs."""
        params, momentum = self.hypernetwork(server, ctx)
        table = params[EMBEDDINGS]
        idx = clients.to(device=table.device, dtype=torch.int64)
        hyper = {k: v for k, v in params.items() if k != EMBEDDINGS}
        _, pull_back = vjp(self.generate, hyper, table[idx])
        delta = {k: out.upload[k].to(table) for k in self.target_shapes}
        grad_hyper, grad_rows = pull_back(delta)
        grads = {**grad_hyper, EMBEDDINGS: torch.zeros_like(table).index_add(0, idx, grad_rows)}
        new, buffers = hypernet.momentum_step(  # clip_grad_norm_, as the authors
            params,
            grads,
            momentum,
            self.hyper_lr,
            self.hyper_momentum,
            self.hyper_weight_decay,
            self.max_grad_norm,
        )
        models = self.generate(new, new[EMBEDDINGS])
        return {"params": new, "momentum": buffers, "models": models}

    # --- client ---------------------------------------------------------------------------------

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """Nothing for a client the server knows; a newcomer (its downlink is phi and a starting
        embedding) gets a zero shift of that embedding, which its ``join`` learns."""
        if START not in downlink:
            return {}
        return {SHIFT: torch.zeros_like(downlink[START])}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """K local steps from theta_i; uploads Delta theta_i = theta_i - theta~_i."""
        trained, mean_loss = self.train(downlink, data, ctx)
        out = ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss})
        return out, state

    def personal_model(self, downlink: Params, state: ClientState) -> Params:
        """theta_i as sent, or a newcomer's h(v; phi) from its downlink and learned shift."""
        if START not in downlink:
            return downlink
        return self.generate(downlink, downlink[START] + state[SHIFT])

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.personal_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer learns its embedding v with phi frozen: local steps on L(h(v; phi))."""
        if START not in downlink:
            return state

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            theta = self.generate(downlink, downlink[START] + p[SHIFT])
            return masked_cross_entropy(self.model.forward(theta, x), y, mask, data.label_mask)

        opt = self.client_optimizer
        shift = {SHIFT: state[SHIFT]}
        trained, _, _ = train_steps(loss, shift, data, opt, opt.init(shift), ctx.client_lr)
        return {**state, **trained}

"""FedALA: adaptive local aggregation of the global model into each client's old local model.

Zhang, Hua, Wang, Song, Xue, Ma, Guan. "FedALA: Adaptive Local Aggregation for Personalized
Federated Learning". AAAI 2023; arXiv:2212.01197. Authors' code: github.com/TsingZ0/FedALA
(``system/utils/ALA.py``), the same module in PFLlib.

Client i keeps its local model theta_i and element-wise weights W_i (initialized to ones, one per
entry of the top p layers). When it receives the global model Theta^t it does not overwrite
theta_i^{t-1} but initializes its local model as (Algorithm 1, Eq. 4-6)

    theta_hat_i^t = theta_i^{t-1} + (Theta^t - theta_i^{t-1}) (.) [1^{|lower|}; W_i^p],

i.e. the lower layers are the global model's and each of the top p layers is
theta_i + (Theta - theta_i) (.) W_i. W_i is learned on a random s% of the local data by projected
gradient steps of the local loss,

    W_i <- clip(W_i - eta * grad_{theta_hat} L_i(theta_hat_i) (.) (Theta^t - theta_i^{t-1}), 0, 1)

(the chain rule through theta_hat; one step per minibatch, theta_hat recomputed after each), until
the loss converges at the client's first ALA (the std of the last ``num_pre_loss`` epoch losses,
each the epoch's last minibatch loss, below ``threshold``) and for exactly one epoch at every later
one. The client then trains theta_hat_i^t locally (the run's schedule, client optimizer) into
theta_i^t and uploads it; the server averages the local models weighted by N_i (FedAvg). ALA is
skipped while the client has no local model (the authors' "deactivate ALA at the 1st
communication iteration", when theta_i equals the global model): its local model starts as Theta^t.

Symbols to code: Theta^t -> the downlink ``body.*`` / ``head.*``; theta_i -> the state
``local.*``; W_i -> the state ``weights.*`` (the top ``layers`` layers only); eta -> ``eta``
(1.0); s -> ``rand_percent`` (80); p -> ``layers`` (1: the head; a layer is a module's weight and
bias, counted from the output down, so the authors' ``layer_idx = 2`` parameter tensors is
``layers = 1``); the convergence test -> ``threshold`` (0.1) and ``num_pre_loss`` (10), the
authors' defaults.

Deliberate differences and choices:
- The first ALA's weight learning stops at convergence or after ``max_start_epochs`` (50) epochs;
  the authors' loop has no cap. The epochs of a round are a fixed count: the server tells the
  cohort, by the shape of ``ala.epochs`` in the downlink, to run ``max_start_epochs`` epochs
  when one of its clients has trained exactly once before (its first ALA) and one epoch
  otherwise; epochs after a client's own stopping point are no-ops, so its numbers do not depend
  on the cohort. The server counts each client's visits for this (``server["ala"]["visits"]``),
  which is also why the server step is not the plain one (differential privacy does not wrap it).
- The s% subset is the first floor(s/100 N_i) samples of a freshly shuffled epoch in the run's
  batch size, cut into those batches (the last one smaller), the same batches for every epoch of
  the first ALA; the authors take a contiguous slice at a random offset of the (fixed) sample
  order, FL-bench a shuffled subset as here. With full-batch runs, and clients with no more
  samples than the batch size, the subset is the first s% in the client's stored order (the
  schedule of one full batch is not shuffled), one full batch, the same in every round.
- ALA runs when a client is sampled, before it trains. PFLlib runs it for every client each round
  and evaluates the ALA-initialized models; here the personalized model is theta_i, the trained
  local model (the global model until the client first trains).
- When the top layers are only the head (the default), the body's features are computed once per
  ALA (the lower layers are the global model's and fixed), as in the authors' frozen lower layers,
  and the head's gradient is written out (``head_gradient``); deeper top layers use autograd.

A client that never trained (``join``) has no local model, so ALA does nothing for it: it trains
the global model on its data with the run's schedule, its first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.func import grad_and_value

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, between, non_negative, positive, setting
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, Schedule, ServerState

LOCAL, WEIGHTS, EPOCHS = "local.", "weights.", "ala.epochs"
HEAD = ("head.weight", "head.bias")


def head_gradient(
    head: Params, features: Tensor, y: Tensor, mask: Tensor, label_mask: Tensor
) -> tuple[Params, Tensor]:
    """The gradient of a linear head's masked cross-entropy, in closed form, and the loss.

    ``(softmax - onehot(y)) * mask / sum(mask)`` times the features: what autograd computes for
    ``masked_cross_entropy(head_logits(head, features), y, mask, label_mask)``, without its
    per-step overhead (ALA takes many small steps).
    """
    logits = head_logits(head, features)
    logits = torch.where(label_mask > 0, logits, torch.finfo(logits.dtype).min)
    log_probs = torch.log_softmax(logits, -1)
    classes = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (classes == y[:, None]).to(logits.dtype)
    share = mask / mask.sum().clamp(min=1)
    value = -((log_probs * onehot).sum(-1) * share).sum()
    error = (log_probs.exp() - onehot) * share[:, None]
    return {"head.weight": error.T @ features, "head.bias": error.sum(0)}, value


@register("fedala")
@dataclass(frozen=True)
class FedALA(Algorithm):
    eta: float = setting(1.0, "step size of the element-wise aggregation weights W_i", positive)
    rand_percent: float = setting(
        80.0, "the percentage s of local data the weights are learned on", between(0, 100, "(]")
    )
    layers: int = setting(
        1, "how many top layers are aggregated adaptively (1: the head)", at_least(1)
    )
    threshold: float = setting(
        0.1,
        "the first ALA stops when the std of the last num_pre_loss losses is below it",
        non_negative,
    )
    num_pre_loss: int = setting(10, "how many epoch losses the convergence test reads", at_least(1))
    max_start_epochs: int = setting(
        50, "the most epochs of the first ALA's weight learning", at_least(1)
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    per_client_downlink: ClassVar[bool] = True

    # --- which parameters ALA weighs ------------------------------------------------------------

    def top_names(self, params: Params) -> tuple[str, ...]:
        """The entries of the top ``layers`` layers (a layer: one module's weight and bias)."""
        order = [f"body.{k}" for k, _ in self.model.body.named_parameters()] + list(HEAD)
        groups: list[list[str]] = []
        for name in (k for k in order if k in params):
            module = name.rsplit(".", 1)[0]
            if groups and groups[-1][0].rsplit(".", 1)[0] == module:
                groups[-1].append(name)
            else:
                groups.append([name])
        return tuple(k for group in groups[-self.layers :] for k in group)

    # --- server ---------------------------------------------------------------------------------

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The global model for each of ``clients`` and ``ala.epochs``, whose length is how many
        weight-learning epochs the cohort runs (``max_start_epochs`` if one of them has trained
        exactly once, else 1)."""
        params = server["params"]
        first = next(iter(params.values()))
        if clients is None:
            return {**params, EPOCHS: first.new_zeros(1)}
        epochs = 1
        if "ala" in server:
            visits = server["ala"]["visits"][clients.to(server["ala"]["visits"].device)]
            epochs = self.max_start_epochs if bool((visits == 1).any()) else 1
        stacked = {k: v.expand(len(clients), *v.shape) for k, v in params.items()}
        return {**stacked, EPOCHS: first.new_zeros(len(clients), epochs)}

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """FedAvg of the local models, and one more visit for each client of the cohort."""
        visits = server["ala"]["visits"] if "ala" in server else torch.zeros(ctx.num_clients)
        visits = visits.index_add(0, clients.to(visits.device), torch.ones(len(clients)))
        updated = self.server_update(server, self.aggregate(out, ctx), ctx)
        return {**updated, "ala": {"visits": visits}}

    # --- client ---------------------------------------------------------------------------------

    def model_of(self, downlink: Params) -> Params:
        return {k: v for k, v in downlink.items() if k != EPOCHS}

    def init_client(
        self, downlink: Params, generator: torch.Generator, ctx: RoundContext
    ) -> ClientState:
        """No local model yet (``trained`` 0), W = 1, and the first ALA still to come."""
        model = self.model_of(downlink)
        flag = next(iter(model.values())).new_zeros(())
        weights = {k: torch.ones_like(model[k]) for k in self.top_names(model)}
        return {
            **tree.add_prefix(LOCAL, tree.zeros_like(model)),
            **tree.add_prefix(WEIGHTS, weights),
            "trained": flag,
            "started": flag.clone(),
        }

    def local_model(self, downlink: Params, state: ClientState) -> Params:
        """theta_i once the client has trained, else the global model it receives."""
        model = self.model_of(downlink)
        return tree.where(state["trained"] > 0, tree.strip_prefix(LOCAL, state), model)

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        """``ala``: one shuffled epoch in the run's batch size, whose first s% is the subset."""
        return {"ala": Schedule(run.inner_steps, run.batch_size, 1.0)}

    def subset_mask(self, batch_mask: Tensor, num_samples: Tensor) -> Tensor:
        """The entries of the ``ala`` schedule among the first floor(s/100 N_i) real ones."""
        count = torch.floor(self.rand_percent / 100 * num_samples)
        rank = torch.cumsum(batch_mask.flatten(), 0).reshape(batch_mask.shape) - 1
        return batch_mask * (rank < count).to(batch_mask.dtype)

    def adaptive_local_aggregation(
        self, downlink: Params, state: ClientState, data: ClientData
    ) -> tuple[Params, Params]:
        """theta_hat_i (the local model's initialization) and the learned W_i."""
        global_model = self.model_of(downlink)
        local = self.local_model(downlink, state)
        top = self.top_names(global_model)
        diff = {k: global_model[k] - local[k] for k in top}
        weights = {k: state[WEIGHTS + k] for k in top}
        trained, first_phase = (
            state["trained"] > 0,
            (state["trained"] > 0) & ~(state["started"] > 0),
        )

        idx, bmask = data.schedules["ala"]
        keep = self.subset_mask(bmask, data.num_samples)
        if set(top) == set(HEAD):  # the lower layers are fixed: their features once
            inputs = self.model.features(global_model, data.x).detach()

            def step(w: Params, x: Tensor, y: Tensor, mask: Tensor) -> tuple[Params, Tensor]:
                hat = {k: local[k] + diff[k] * w[k] for k in top}
                grads, value = head_gradient(hat, x, y, mask, data.label_mask)
                return {k: g * diff[k] for k, g in grads.items()}, value

        else:
            inputs = data.x
            lower = {k: v for k, v in global_model.items() if k not in diff}

            def loss(w: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
                hat = {**lower, **{k: local[k] + diff[k] * w[k] for k in top}}
                return masked_cross_entropy(self.model.forward(hat, x), y, mask, data.label_mask)

            step = grad_and_value(loss)
        losses: list[Tensor] = []
        done = torch.zeros((), dtype=torch.bool)
        for epoch in range(downlink[EPOCHS].shape[-1]):
            running = trained & (first_phase & ~done) if epoch else trained
            last = torch.zeros((), dtype=inputs.dtype)
            for s in range(idx.shape[0]):
                active = running & (keep[s].sum() > 0)
                grads, value = step(weights, inputs[idx[s]], data.y[idx[s]], keep[s])
                weights = {
                    k: torch.where(active, (w - self.eta * grads[k]).clamp(0, 1), w)
                    for k, w in weights.items()
                }
                last = torch.where(active, value.detach(), last)
            losses.append(last)
            if len(losses) > self.num_pre_loss:
                spread = torch.stack(losses[-self.num_pre_loss :]).std(correction=0)
                done = done | (spread < self.threshold)
        hat = {**global_model, **{k: local[k] + diff[k] * weights[k] for k in top}}
        return hat, weights

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        start, weights = self.adaptive_local_aggregation(downlink, state, data)
        trained, mean_loss = self.train(start, data, ctx)
        upload = tree.sub(self.model_of(downlink), trained)
        new_state = {
            **tree.add_prefix(LOCAL, trained),
            **tree.add_prefix(WEIGHTS, weights),
            "trained": torch.ones_like(state["trained"]),
            "started": torch.maximum(state["started"], state["trained"]),
        }
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), new_state

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        return self.model.forward(self.local_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """A newcomer's first round: no local model, so no ALA; it trains the global model."""
        trained, _ = self.train(self.model_of(downlink), data, ctx)
        return {
            **state,
            **tree.add_prefix(LOCAL, trained),
            "trained": torch.ones_like(state["trained"]),
        }

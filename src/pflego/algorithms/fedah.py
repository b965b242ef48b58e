"""FedAH: each client's head starts every round as an element-wise aggregate of its own and the
global head.

Zhou, He, Zhai, Gao, Chen, Qin, Zhang, Guo. "FedAH: Aggregated Head for Personalized Federated
Learning". arXiv:2412.01295 (2024). Peer code: FL-bench's ``fedah`` (KarhouTam/FL-bench).

The model is a feature extractor phi and a head h. The server averages both (FedAvg). Client i
keeps its own head h_i and element-wise weights W_i (ones at first). In round t it receives
(phi^t, h^t), takes phi^t as its extractor and initializes its head as the aggregated head

    h_hat_i = h_i + (h^t - h_i) (.) W_i,

with W_i learned on its data by projected gradient steps of the local loss with phi^t fixed,

    W_i <- clip(W_i - eta * grad_{h_hat} L_i(phi^t, h_hat_i) (.) (h^t - h_i), 0, 1)

(one step per minibatch, h_hat recomputed after each, for E_h epochs). It then trains the head
from h_hat_i with the extractor fixed (E_h epochs) and the extractor with the head fixed (the
local epochs), keeps the trained head as h_i and uploads the trained extractor and head.

Symbols to code: phi^t, h^t -> the downlink's ``body.*`` / ``head.*``; h_i -> the state's
``local.head.*``; W_i -> ``weights.head.*``; eta -> ``eta`` (1.0, FL-bench's); E_h -> the named
schedule ``head`` (``head_epochs``, 1, FL-bench's ``plocal_epochs``), used by the weight learning
and the head phase; the extractor phase -> the run's schedule; the local solver -> the run's
client optimizer and ``ctx.client_lr``; the head's gradient -> FedALA's closed form
(:func:`pflego.algorithms.fedala.head_gradient`: the rule is FedALA's, applied to the head).

Deliberate differences and choices:
- A client that has not trained has no head of its own: it uses the global head, and its first
  aggregation is the global head whatever W_i (FL-bench's client starts from the global model).
- The weight learning and the head phase run over the same ``head`` schedule's minibatches
  (FL-bench shuffles the loader anew for each); FL-bench skips minibatches of one sample in
  training, none are skipped here.
- The server averages the uploaded extractors and heads weighted by N_i (FL-bench's FedAvg).

Prediction: the global extractor with the client's own head (the global head before it trains).
Unseen clients (``join``): the global head (its aggregate, having no head of its own) trained on
the frozen global extractor's features (the ``head`` schedule), the head phase of a first round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fedala import head_gradient
from pflego.fields import positive, setting
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, Schedule

LOCAL, WEIGHTS = "local.", "weights."
HEAD = ("head.weight", "head.bias")


@register("fedah")
@dataclass(frozen=True)
class FedAH(Algorithm):
    eta: float = setting(1.0, "step size of the element-wise head weights W_i", positive)
    head_epochs: float = setting(
        1.0, "epochs of the head weights' learning and of the head phase", positive
    )

    personal: ClassVar[tuple[str, ...]] = ("head",)

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        return {"head": run.phase(None, self.head_epochs)}

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.schedules(run)["head"]

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """No head of its own yet (``trained`` 0) and W_i = 1."""
        head = tree.select(downlink, ["head"])
        return {
            **tree.add_prefix(LOCAL, tree.zeros_like(head)),
            **tree.add_prefix(WEIGHTS, {k: torch.ones_like(v) for k, v in head.items()}),
            "trained": head["head.bias"].new_zeros(()),
        }

    def own_head(self, downlink: Params, state: ClientState) -> Params:
        """h_i once the client has trained, else the global head."""
        glob = tree.select(downlink, ["head"])
        return tree.where(state["trained"] > 0, tree.strip_prefix(LOCAL, state), glob)

    def aggregated_head(self, downlink: Params, state: ClientState, data: ClientData):
        """h_hat_i and the learned W_i (projected steps on the ``head`` schedule, phi^t fixed)."""
        local = self.own_head(downlink, state)
        diff = {k: downlink[k] - local[k] for k in HEAD}
        weights = tree.strip_prefix(WEIGHTS, state)
        features = self.model.features(downlink, data.x).detach()
        batches, batch_mask = data.schedules["head"]
        for s in range(batches.shape[0]):
            hat = {k: local[k] + diff[k] * weights[k] for k in HEAD}
            rows = batches[s]
            grads, _ = head_gradient(
                hat, features[rows], data.y[rows], batch_mask[s], data.label_mask
            )
            weights = {
                k: (w - self.eta * grads[k] * diff[k]).clamp(0, 1) for k, w in weights.items()
            }
        return {k: local[k] + diff[k] * weights[k] for k in HEAD}, weights

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        head, weights = self.aggregated_head(downlink, state, data)
        head = self.train_head(downlink, head, data.using("head"), ctx)
        body = tree.select(downlink, ["body"])
        trained, mean_loss = self.train(body, data, ctx, fixed=head)
        upload = tree.sub(downlink, {**trained, **head})
        new_state = {
            **tree.add_prefix(LOCAL, head),
            **tree.add_prefix(WEIGHTS, weights),
            "trained": torch.ones_like(state["trained"]),
        }
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), new_state

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The global extractor with the client's own head (the global head before it trains)."""
        return self.model.forward({**downlink, **self.own_head(downlink, state)}, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """The global head trained on the frozen global extractor's features."""
        head = self.train_head(downlink, tree.select(downlink, ["head"]), data, ctx)
        return {
            **state,
            **tree.add_prefix(LOCAL, head),
            "trained": torch.ones_like(state["trained"]),
        }

"""FedGH: a generalized global header trained by the server on the clients' class prototypes.

Yi, Wang, Liu, Shi, Yu. "FedGH: Heterogeneous Federated Learning with Generalized Global
Header". ACM MM 2023; arXiv:2303.13137.

Every client i keeps its own feature extractor f_i (heterogeneous in the paper) and shares one
header h (the linear head). In round t the server sends h^t; a sampled client i

1. replaces its local header with h^t and trains f_i and the header on its data with
   cross-entropy (the paper's local training, Eq. 3);
2. computes the local prototype of every class j it holds with the trained extractor,
   ``R_i^j = (1/|D_i^j|) sum_{(x, y) in D_i^j} f_i(x)`` (Eq. 4), and uploads the R_i^j.

The server trains the global header on the uploaded (prototype, label) pairs,

    h^{t+1} = h^t - eta_h grad_h (1/P) sum_{i, j} CE(h(R_i^j), j)       (Eq. 5, 6)

over the P pairs of the round's clients, and sends it back; it replaces every local header. A
client predicts with its own extractor and the global header, f_i then h.

Symbols to code: f_i -> the client state (``body.*``); h -> ``server["params"]`` (``head.*``, a
C-way head: the ``global`` label space, so that every client's prototypes index the same
classes); R_i^j -> the upload ``proto.mean`` ``[C, M]`` with ``proto.count`` ``[C]`` (the class
counts; a class with count 0 is no pair); eta_h -> the run's ``server_lr``; the number of server
steps -> ``head_steps`` (each a step of the run's server optimizer, SGD by default as in
PFLlib); the local solver -> the run's client optimizer and ``ctx.client_lr``.

Deliberate differences and choices:
- Homogeneous extractors (the paper's point is heterogeneous ones); every client's extractor
  starts from the same initial f^0, which the server keeps and sends (never stepped), so that a
  first-visit state does not depend on what it receives.
- The server takes ``head_steps`` full-batch steps on the mean cross-entropy over all pairs
  (default 1), its optimizer's state kept across rounds; PFLlib's FedGH takes one epoch of
  shuffled minibatches of the run's batch size with SGD of step ``server_learning_rate``; the
  paper does not fix the batching.
- Prototypes use the trained extractor over the client's whole training split (Eq. 4; PFLlib
  computes them the same way, after training). The upload is not a weighted sum (each pair is a
  sample of its own), so differential privacy and secure aggregation refuse FedGH.

Unseen clients (``join``): f^0 and the global header trained on the local cross-entropy for
``adapt_schedule``'s batches (the run's local schedule), as a new client's first round would;
it then predicts with its extractor and the global header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fedproto import class_sums
from pflego.fields import positive, setting
from pflego.loss import cross_entropies
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

MEAN, COUNT = "proto.mean", "proto.count"  # a client's class prototypes and counts, uploaded


def prototype_upload(features: Tensor, data: ClientData, num_classes: int) -> Params:
    """The class means ``[C, M]`` of ``features`` over the real samples (0 for an absent class)
    and the class counts ``[C]``."""
    sums, counts = class_sums(features, data.y, data.mask, num_classes)
    return {MEAN: sums / torch.where(counts > 0, counts, 1.0)[:, None], COUNT: counts}


def prototype_cross_entropy(head: Params, means: Tensor, counts: Tensor) -> Tensor:
    """Mean cross-entropy of ``head`` over the (prototype, class) pairs of ``means`` ``[S, C, M]``
    whose ``counts`` ``[S, C]`` are positive."""
    num_classes = means.shape[1]
    flat = means.reshape(-1, means.shape[-1])
    labels = torch.arange(num_classes, device=means.device).repeat(means.shape[0])
    pairs = (counts.reshape(-1) > 0).to(means.dtype)
    values = cross_entropies(head_logits(head, flat), labels)
    return (values * pairs).sum() / pairs.sum().clamp(min=1)


@register("fedgh")
@dataclass(frozen=True)
class FedGH(Algorithm):
    head_steps: int = setting(
        1, "full-batch gradient steps of the server's header on the prototypes a round", positive
    )

    shared: ClassVar[tuple[str, ...]] = ("head",)
    personal: ClassVar[tuple[str, ...]] = ("body",)
    label_space: ClassVar[str] = "global"
    sum_aggregate: ClassVar[bool] = False  # every (prototype, class) pair is a sample

    # --- server ---------------------------------------------------------------------------------

    def init_server(self, params: Params) -> ServerState:
        """The header h^0 (stepped, with the server optimizer's state) and the initial extractor
        f^0 (never stepped)."""
        head = tree.select(params, ["head"])
        return {**super().init_server(head), "body": tree.select(params, ["body"])}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """The global header and f^0 (what a first visit starts from)."""
        return {**server["body"], **server["params"]}

    def server_round(self, server: ServerState, out: ClientOut, ctx: RoundContext, clients):
        """``head_steps`` server-optimizer steps of ``server_lr`` on the prototypes'
        cross-entropy (Eq. 5, 6)."""
        means, counts = out.upload[MEAN].detach(), out.upload[COUNT].detach()
        for _ in range(self.head_steps):
            with torch.enable_grad():
                head = {k: v.detach().requires_grad_(True) for k, v in server["params"].items()}
                loss = prototype_cross_entropy(head, means, counts)
                grads = torch.autograd.grad(loss, list(head.values()))
            server = self.server_update(server, dict(zip(head, grads, strict=True)), ctx)
        return server

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """The client's extractor starts as f^0."""
        return {k: v.clone() for k, v in tree.select(downlink, ["body"]).items()}

    def train_local(self, downlink: Params, state: ClientState, data: ClientData, ctx):
        """The client's extractor and the global header trained on the cross-entropy (Eq. 3)."""
        return self.train({**state, **tree.select(downlink, ["head"])}, data, ctx)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train_local(downlink, state, data, ctx)
        body = tree.select(trained, ["body"])
        upload = prototype_upload(self.model.features(body, data.x), data, self.model.num_classes)
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), body

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """f^0 trained with the global header on the local cross-entropy (its header is then
        replaced by the global one, as every round does)."""
        return tree.select(self.train_local(downlink, state, data, ctx)[0], ["body"])

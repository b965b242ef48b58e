"""FD (FedDistill): federated distillation; clients share per-class mean logits, not weights.

Jeong, Oh, Kim, Park, Bennis, Kim. "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data". NeurIPS 2018 Workshop on
Machine Learning on the Phone and other Consumer Devices; arXiv:1811.11479. Implemented as
PFLlib's ``FedDistill`` (TsingZ0/PFLlib, ``clientdistill.py`` / ``serverdistill.py``, after
yuetan031/fedlogit).

Client i keeps its whole model F_i and never sends it. It uploads, per class j it holds, its
local average logit vector F_{i,j} = mean over its samples of class j of F_i(x); the server keeps
the global average logits

    F_bar_j = mean over the clients i holding class j of F_{i,j}

and a sampled client takes its local steps on

    L_i = CE(F_i(x), y) + gamma * (1 / (B C)) sum_s ||F_i(x_s) - F_bar_{y_s}||^2,

PFLlib's ``MSELoss`` over a minibatch of B rows and C logits, a sample whose class has no global
logits yet contributing 0 (still counted in B C). Then it sends its new local average logits.

Symbols to code: F_i -> the client state (``body.*`` and ``head.*``, a C-way head: the ``global``
label space, so that logits of every client index the same classes); F_bar -> ``server["logits"]``
(``mean`` ``[C, C]`` and ``present`` ``[C]``, 1 for a class that has global logits), sent as
``logit.mean`` / ``logit.present``; gamma -> ``lam`` (1 by default); the local
solver -> ``pflego.local.train_steps`` with ``ctx.client_lr``. The upload is FedProto's
(``fedproto.class_upload``): class sums and counts of the logits over N_i, weighted by N_i, so
the server's weighted mean of them is a weighted sum (privacy may wrap it) whose ratio is the
per-class mean; ``logit_weights="clients"`` (default) gives Jeong et al.'s and PFLlib's plain mean of
the holders' class means, ``"samples"`` weights each client by its samples of the class.

Deliberate differences and choices:
- The local average logits are computed after the local steps, with the trained model, over the
  whole training split; PFLlib averages the outputs of every minibatch of every local epoch as
  they are trained, and Jeong et al. accumulate them over the local iterations.
- Classes that no client of the round holds keep their previous global logits (PFLlib keeps only
  the round's classes; the same under full participation).
- Jeong et al. distil toward the global average logits with the client's own contribution
  removed, and add FAug, a server-side conditional GAN that augments the clients' data: both are
  left out, as in PFLlib.
- Homogeneous models; every client starts from the same initial model w^0, which the server keeps
  and sends (as FedProto does), so that a first-visit state does not depend on what it receives.
- ``test_acc`` is the client's own model F_i.

Unseen clients (``join``): the initial model w^0, trained on L_i against the current global
logits on ``adapt_schedule``'s batches (the run's local schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fedproto import aggregate_prototypes, class_upload
from pflego.fields import non_negative, one_of, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

MEAN, PRESENT = "logit.mean", "logit.present"  # the global average logits in the downlink
SUM, COUNT = "logit.sum", "logit.count"  # a client's class sums and counts, over N_i, uploaded
MODEL = ("body", "head")


@register("feddistill")
@dataclass(frozen=True)
class FedDistill(Algorithm):
    lam: float = setting(
        1.0, "strength gamma of the pull of logits toward the global class logits", non_negative
    )
    logit_weights: str = setting(
        "clients",
        "how local class logits are averaged: by clients (the paper) or samples",
        one_of("clients", "samples", says="must be one of"),
    )

    server_step: ClassVar[str] = "own"  # the server averages the logits per class
    shared: ClassVar[tuple[str, ...]] = ()
    personal: ClassVar[tuple[str, ...]] = MODEL
    label_space: ClassVar[str] = "global"

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """w^0: the body and a C-way head, every client's starting model."""
        generator = torch.Generator().manual_seed(seed + 1)
        head = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    def init_server(self, params: Params) -> ServerState:
        """w^0 and no global logits yet (zeros, ``present`` 0)."""
        c = self.model.num_classes
        reference = next(iter(params.values()))
        logits = {"mean": reference.new_zeros((c, c)), "present": reference.new_zeros((c,))}
        return {**super().init_server(params), "logits": logits}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """w^0 (for first visits) and the global average logits."""
        logits = server["logits"]
        return {**server["params"], MEAN: logits["mean"], PRESENT: logits["present"]}

    def server_update(self, server: ServerState, aggregated: Params, ctx: RoundContext):
        """F_bar_j for the classes of the round; w^0 is never stepped."""
        logits = aggregate_prototypes(server["logits"], aggregated, SUM, COUNT)
        return {**server, "logits": logits}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """The client's own model starts as w^0."""
        return {k: v.clone() for k, v in tree.select(downlink, MODEL).items()}

    def objective(self, targets: Tensor, present: Tensor, label_mask: Tensor):
        """``CE + gamma * MSE(F_i(x), F_bar_y)`` on a batch, over the rows whose class has
        global logits (the mean taken over all B C entries, as PFLlib's ``MSELoss``)."""

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            logits = self.model.forward(params, x)
            ce = masked_cross_entropy(logits, y, mask, label_mask)
            gaps = ((logits - targets[y]) ** 2).sum(-1) * present[y] * mask
            count = mask.sum().clamp(min=1) * logits.shape[-1]
            return ce + self.lam * gaps.sum() / count

        return loss

    def train_local(self, downlink: Params, state: ClientState, data: ClientData, ctx):
        loss = self.objective(downlink[MEAN], downlink[PRESENT], data.label_mask)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, state, data, opt, opt.init(state), ctx.client_lr)
        return trained, mean_loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train_local(downlink, state, data, ctx)
        logits = self.model.forward(trained, data.x)
        sums, counts = class_upload(logits, data, self.model.num_classes, self.logit_weights)
        upload = {SUM: sums, COUNT: counts}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), trained

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The client's own model F_i."""
        return self.model.forward(state, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """w^0 trained on L_i against the global average logits."""
        return self.train_local(downlink, state, data, ctx)[0]

"""FedProto: federated prototype learning; clients share per-class mean features, not weights.

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang. "FedProto: Federated Prototype Learning across
Heterogeneous Clients". AAAI 2022; arXiv:2105.00243.

Client i keeps its whole model F_i = g_i o f_i (representation f_i, here the body; decision g_i,
here a C-way head) and never sends it. The server keeps one global prototype per class,

    C_bar^(j) = sum_{i in N_j} |D_{i,j}| C_i^(j) / sum_{i in N_j} |D_{i,j}|        (Eq. 6)

with C_i^(j) = (1/|D_{i,j}|) sum_{(x, y) in D_{i,j}} f_i(x) the local prototype of class j
(Eq. 5) and N_j the clients that hold class j. A sampled client takes its local steps on

    L_i = CE(F_i(x), y) + lambda * R(f_i(x), C_bar^(y))                                 (Eq. 8)

from its own model, then sends its new local prototypes; the server averages them per class.

Symbols to code: F_i -> the client state (``body.*`` and ``head.*``, a C-way head: the
``global`` label space, so that prototypes of every client index the same classes); f_i(x) ->
``self.model.features``; C_bar -> ``server["protos"]["mean"]`` ``[C, M]`` with
``server["protos"]["present"]`` ``[C]`` (1 for a class that has a global prototype), sent in the
downlink as ``proto.mean`` / ``proto.present``; lambda -> ``lam`` (default 1, the authors'
code's ``ld``); R -> the squared distance averaged over the M feature dimensions (the authors'
``nn.MSELoss``), averaged over the batch's real samples (a sample whose class has no global
prototype yet contributes 0, as in the authors' code); the local solver ->
``pflego.local.train_steps`` with ``ctx.client_lr``. The upload is the class sums and counts of
the features of the trained body over the client's whole training split, divided by N_i and
weighted by N_i, so the server's default weighted mean yields ``sum_i S_i / sum_i n_i`` per class
(Eq. 6) and differential privacy can wrap it as a weighted sum. ``proto_weights="clients"`` gives
the authors' code's unweighted mean of the local prototypes over the clients holding the class.

Deliberate differences and choices:
- Homogeneous models (the paper allows heterogeneous ones); every client starts from the same
  initial model w^0, which the server keeps and sends (as ``local`` does) so that a client's
  first-visit state does not depend on what it receives; no server step ever changes it.
- Local prototypes are computed after the local steps with the trained body over the whole
  training split (the paper's Eq. 5); the authors' code collects the features of the last local
  epoch's minibatches as they are trained.
- Classes that no client of the round holds keep their previous global prototype (the authors'
  code keeps only the round's classes; the same under full participation once every class was
  seen).
- Prediction: ``test_acc`` is the client's own model F_i (the authors' code reports it as "w/o
  protos"); the paper's prototype inference, the class of the nearest global prototype
  ``argmin_j ||f_i(x) - C_bar^(j)||``, is the extra prediction ``proto`` (``test_acc_proto``;
  classes without a global prototype are never predicted).

Unseen clients (``join``): the initial model w^0, trained with the same local objective against
the current global prototypes on ``adapt_schedule``'s batches (the run's local schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, one_of, setting
from pflego.local import train_steps
from pflego.loss import Alignment, CrossEntropy, Objective
from pflego.models import SplitModel, init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext, ServerState

MEAN, PRESENT = "proto.mean", "proto.present"  # the global prototypes in the downlink
SUM, COUNT = "proto.sum", "proto.count"  # a client's class sums and counts, over N_i, uploaded
MODEL = ("body", "head")


def one_hot(y: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """``[n, C]`` indicators of the labels (a label outside 0..C-1 gives a zero row)."""
    return (y[..., None] == torch.arange(num_classes, device=y.device)).to(dtype)


def class_sums(
    features: Tensor, y: Tensor, mask: Tensor, num_classes: int
) -> tuple[Tensor, Tensor]:
    """Per-class sums ``[C, M]`` of the real samples' features and their counts ``[C]``."""
    weights = one_hot(y, num_classes, features.dtype) * mask[:, None]
    return weights.T @ features, weights.sum(0)


def nearest_prototype_logits(features: Tensor, means: Tensor, present: Tensor) -> Tensor:
    """Logits ``-||f - C_bar^(j)||^2`` ``[n, C]``; classes without a prototype get the lowest value."""
    distances = ((features[:, None, :] - means[None]) ** 2).sum(-1)
    return torch.where(present > 0, -distances, torch.finfo(distances.dtype).min)


def class_upload(
    values: Tensor, data: ClientData, num_classes: int, weights: str
) -> tuple[Tensor, Tensor]:
    """A client's per-class sums ``[C, M]`` and counts ``[C]`` of ``values`` (one row per
    training sample), divided by N_i: uploaded with weight N_i, their weighted means over the
    cohort give ``sum_i S_i / sum_i n_i`` per class (``weights="samples"``); with ``"clients"``
    each holder's class mean and a count of 1 instead, so the ratio is the plain mean of the
    holders' class means."""
    sums, counts = class_sums(values, data.y, data.mask, num_classes)
    if weights == "clients":
        held = (counts > 0).to(counts.dtype)
        sums, counts = sums / torch.where(counts > 0, counts, 1.0)[:, None], held
    n = data.num_samples.to(values.dtype)
    return sums / n, counts / n


def aggregate_prototypes(
    protos: Params, aggregated: Params, sum_key: str = SUM, count_key: str = COUNT
) -> Params:
    """New global prototypes from the aggregated class sums and counts: classes the round saw
    get ``sum / count``, the others keep their previous prototype."""
    counts = aggregated[count_key]
    seen = counts > 0
    means = aggregated[sum_key] / torch.where(seen, counts, 1.0)[:, None]
    return {
        "mean": torch.where(seen[:, None], means, protos["mean"]),
        "present": torch.where(seen, 1.0, protos["present"]).to(protos["present"].dtype),
    }


def initial_prototypes(model: SplitModel, reference: Tensor) -> Params:
    """No global prototype yet: zeros ``[C, M]`` and ``present`` 0."""
    c, m = model.num_classes, model.feature_dim
    return {"mean": reference.new_zeros((c, m)), "present": reference.new_zeros((c,))}


@register("fedproto")
@dataclass(frozen=True)
class FedProto(Algorithm):
    server_step: ClassVar[str] = "own"  # the server averages the prototypes per class, by counts
    lam: float = setting(
        1.0, "strength lambda of the pull of features toward the global prototypes", non_negative
    )
    proto_weights: str = setting(
        "samples",
        "how local prototypes are averaged: by samples (Eq. 6) or clients (the code)",
        one_of("samples", "clients", says="must be one of"),
    )

    shared: ClassVar[tuple[str, ...]] = ()
    personal: ClassVar[tuple[str, ...]] = MODEL
    label_space: ClassVar[str] = "global"
    predictions: ClassVar[tuple[str, ...]] = ("proto",)

    # --- server ---------------------------------------------------------------------------------

    def init_params(self, seed: int, dtype: torch.dtype = torch.float32) -> Params:
        """w^0: the body and a C-way head, every client's starting model."""
        generator = torch.Generator().manual_seed(seed + 1)
        head = init_head(self.head_width, self.model.feature_dim, generator, self.head_init, dtype)
        return self.model.init_body(seed, dtype) | head

    def init_server(self, params: Params) -> ServerState:
        reference = next(iter(params.values()))
        return {**super().init_server(params), "protos": initial_prototypes(self.model, reference)}

    def downlink(self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None):
        """w^0 (for first visits) and the global prototypes."""
        protos = server["protos"]
        return {**server["params"], MEAN: protos["mean"], PRESENT: protos["present"]}

    def server_update(self, server: ServerState, aggregated: Params, ctx: RoundContext):
        """Only the prototypes change (Eq. 6); w^0 is never stepped."""
        return {**server, "protos": aggregate_prototypes(server["protos"], aggregated)}

    # --- client ---------------------------------------------------------------------------------

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """The client's own model starts as w^0."""
        return {k: v.clone() for k, v in tree.select(downlink, MODEL).items()}

    def local_objective(self, targets: Tensor, present: Tensor, label_mask: Tensor) -> Objective:
        """``CE + lam * R(f(x), C_bar^(y))`` on a batch (Eq. 8), with ``R`` the authors'
        ``MSELoss`` (the squared distance averaged over the M features) and no term for a sample
        whose class has no prototype, declared so that its SGD steps may run fused."""
        weights = present * (self.lam / targets.shape[-1])  # R is a mean over the M features
        terms = (CrossEntropy(), Alignment(targets, weights))
        return Objective(self.model, label_mask, terms=terms)

    def train_local(self, downlink: Params, state: ClientState, data: ClientData, ctx):
        loss = self.local_objective(downlink[MEAN], downlink[PRESENT], data.label_mask)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, state, data, opt, opt.init(state), ctx.client_lr)
        return trained, mean_loss

    def prototype_upload(self, params: Params, data: ClientData) -> Params:
        """The class sums and counts of the trained body's features (Eq. 5), over N_i."""
        z = self.model.features(params, data.x)
        sums, counts = class_upload(z, data, self.model.num_classes, self.proto_weights)
        return {SUM: sums, COUNT: counts}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train_local(downlink, state, data, ctx)
        upload = self.prototype_upload(trained, data)
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), trained

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The client's own model F_i."""
        return self.model.forward(state, x)

    def predict_proto(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The paper's inference: the nearest global prototype to f_i(x)."""
        z = self.model.features(state, x)
        return nearest_prototype_logits(z, downlink[MEAN], downlink[PRESENT])

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """w^0 trained on the local objective against the global prototypes."""
        return self.train_local(downlink, state, data, ctx)[0]

"""FedRoD: a generic head trained with the balanced softmax and a personal head on top of it.

Chen, Chao. "On Bridging Generic and Personalized Federated Learning for Image Classification".
ICLR 2022; arXiv:2107.00778.

The model is a body phi(x; theta), a generic head h_G and a personal head h_P (linear, as in the
PGFed paper's comparison). Per local step on a minibatch, both at the step's starting point:

- theta and h_G descend the balanced softmax loss
  ``-log softmax(h_G(phi) + log n_i)_y`` (n_i,c: client i's training samples of class c; classes the
  client has none of get probability 0), the empirical risk of a class-balanced distribution;
- h_P descends the cross-entropy of ``h_G(phi) + h_P(phi)`` with phi and h_G(phi) held constant.

The server averages theta and h_G (N_i-weighted); h_P never leaves the client. The personalized
prediction is ``h_G(phi) + h_P(phi)``; the generic model's own prediction is reported as
``test_acc_generic``.

Symbols to code: theta -> ``body.*``, h_G -> ``head.*`` (shared, C-way), h_P -> the client state
``phead.*`` (C-way, zero at the first visit), eta -> ``ctx.client_lr``.

Deliberate differences: none from the paper's linear-head variant (the paper also offers a
hypernetwork h_P, not built here). h_P starts at zero, so a client that has not trained yet predicts
with the generic model; the PGFed authors' code starts it as a copy of the initial generic head (a
random offset until the client trains). That code runs the two losses as two optimizer steps on
one batch, at the same point, as here.

A client that never trained trains a new h_P from zero on frozen features phi (the run's
schedule), with the generic logits added, as in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits, init_head
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext


def balanced_softmax_loss(logits: Tensor, y: Tensor, mask: Tensor, class_counts: Tensor) -> Tensor:
    """Cross-entropy of ``logits + log n_c``; classes with ``n_c = 0`` are left out (log 0 = -inf)."""
    present = class_counts > 0
    return masked_cross_entropy(logits + class_counts.clamp(min=1).log(), y, mask, present)


def as_personal(head: Params) -> Params:
    """``head.*`` renamed ``phead.*`` (h_P lives beside the shared h_G)."""
    return {"p" + k: v for k, v in head.items()}


def as_head(phead: Params) -> Params:
    """``phead.*`` renamed ``head.*``, so that :func:`head_logits` reads it."""
    return {k[1:]: v for k, v in phead.items()}


@register("fedrod")
@dataclass(frozen=True)
class FedRoD(Algorithm):
    shared: ClassVar[tuple[str, ...]] = ("body", "head")
    personal: ClassVar[tuple[str, ...]] = ("phead",)
    predictions: ClassVar[tuple[str, ...]] = ("generic",)
    downlink_predictions: ClassVar[tuple[str, ...]] = ("generic",)
    # the least worst-case regret over three federations of benchmarks/defaults_study.py
    # (docs/defaults.md); 0.05 was 7% below the best
    default_client_lr: ClassVar[float] = 0.1

    def init_client(self, downlink, generator, ctx):
        """h_P = 0: until it trains, the client predicts with the generic model."""
        first = next(iter(downlink.values()))
        head = init_head(
            self.model.num_classes, self.model.feature_dim, generator, "zeros", first.dtype
        )
        return as_personal(head)

    def personal_loss(self, phead, features, generic_logits, y, mask, label_mask):
        """Cross-entropy of the generic logits plus h_P's, through h_P only."""
        logits = generic_logits.detach() + head_logits(as_head(phead), features.detach())
        return masked_cross_entropy(logits, y, mask, label_mask)

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        counts = (
            torch.nn.functional.one_hot(data.y, self.model.num_classes) * data.mask[:, None]
        ).sum(0)

        def objective(p, x, y, m):
            features = self.model.features(p, x)
            generic = head_logits(p, features)
            phead = tree.select(p, ["phead"])
            return balanced_softmax_loss(generic, y, m, counts) + self.personal_loss(
                phead, features, generic, y, m, data.label_mask
            )

        params = {**downlink, **state}
        trained, _, loss = train_steps(
            objective,
            params,
            data,
            self.client_optimizer,
            self.client_optimizer.init(params),
            ctx.client_lr,
        )
        upload = tree.sub(downlink, tree.select(trained, self.shared))
        return ClientOut(upload, data.num_samples, {"loss": loss}), tree.select(
            trained, self.personal
        )

    def predict(self, downlink, state, x):
        """Generic plus personal logits."""
        features = self.model.features(downlink, x)
        return head_logits(downlink, features) + head_logits(as_head(state), features)

    def predict_generic(self, downlink, state, x):
        """The generic model alone (body and h_G)."""
        return self.model.forward(downlink, x)

    def join(self, downlink, state, data, ctx):
        """A new h_P trained on frozen features, the generic logits added."""
        features = self.model.features(downlink, data.x).detach()
        loss = lambda h, f, y, m: self.personal_loss(  # noqa: E731
            h, f, head_logits(downlink, f), y, m, data.label_mask
        )
        tuned, _, _ = train_steps(
            loss,
            state,
            data._replace(x=features),
            self.client_optimizer,
            self.client_optimizer.init(state),
            ctx.client_lr,
        )
        return tuned

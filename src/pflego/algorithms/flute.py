"""FLUTE: federated representation learning with heads regularized toward a neural-collapse frame.

Liu, Shen, Yang. "Federated Representation Learning in the Under-Parameterized Regime".
ICML 2024; arXiv:2406.04596. FL-bench's ``src/{server,client}/flute.py`` (KarhouTam/FL-bench),
the implementation of the paper's extension beyond linear representations, read for the
details below.

A shared representation phi (the body) and a personal head W_i per client (C-way, its bias b_i).
Client i's local objective, with u_i in {0, 1}^C the indicator of its classes and
``P = (I_C - 1 1^T / C) / sqrt(C - 1)`` the simplex equiangular tight frame's Gram matrix:

    f_i(W_i, phi) = CE(W_i phi(x) + b_i, y)
                    + lam1 || W_i W_i^T / ||W_i W_i^T||_F - P (.) u_i u_i^T ||_F
                    + lam2 ||W_i||_F^2 + lam3 ||phi(X_B)||_F^2

(``(.)``: the element-wise product; ``phi(X_B)``: the batch's features, so the last term is a sum
over the batch while the cross-entropy is a mean, as in FL-bench). A round:

- client i first trains its head alone on f_i with the body received (``head_steps`` /
  ``head_epochs``; unset, the run's schedule), then head and body together on f_i (the run's
  schedule): FL-bench's ``E - rep_round`` head epochs, then ``rep_round`` joint epochs;
- the server averages the bodies (weights N_i) and moves each answering client's head one step
  of size ``nc_lr`` down the neural-collapse term averaged over the cohort,
  ``W_i <- W_i - nc_lr / r * grad_W || W_i W_i^T / ||W_i W_i^T||_F - P (.) u_i u_i^T ||_F``.

Symbols to code: phi -> ``body.*`` (shared), W_i, b_i -> ``head.weight``, ``head.bias`` (the
client state), u_i -> the classes present in the client's training split, lam1..lam3 ->
``lam1``, ``lam2``, ``lam3``, the server's head step size -> ``nc_lr``; r -> ``ctx.cohort_size``.
Defaults are FL-bench's (``lamda1`` 0.25, ``lamda2`` 0.0025, ``lamda3`` 0.0005, ``nc2_lr`` 0.5).

Deliberate differences and choices:
- The server's head step is taken by each client at the end of its update: the term it descends
  is a sum of one term per client, so each head's step depends only on that head, its class
  indicator and r, and the numbers are those of FL-bench's server step, without the heads and
  class indicators leaving the clients. FL-bench's ``gamma1``, ``gamma2`` are unused there and
  not offered.
- The phases' lengths are set as FedRep's are (a named schedule for the head phase, the run's for
  the joint one) rather than by a count of epochs; each phase starts a fresh optimizer state.
- The head phase computes the body's features once (the same numbers: the body is fixed).
- The paper's data-independent random initialization of the linear representation (its theory)
  is the model's usual initialization here.

A client that never trained (``join``): a new head trained on the frozen body's features with
the head's part of f_i (the head schedule), as FedRep's newcomers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, positive_or_unset, setting
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, Schedule


@register("flute")
@dataclass(frozen=True)
class FLUTE(Algorithm):
    """FLUTE (see the module docstring)."""

    lam1: float = setting(0.25, "weight of the neural-collapse term on the head", non_negative)
    lam2: float = setting(0.0025, "weight of the head's squared norm", non_negative)
    lam3: float = setting(0.0005, "weight of the batch features' squared norm", non_negative)
    nc_lr: float = setting(0.5, "server step size on the heads' neural-collapse term", non_negative)
    head_steps: int | None = setting(
        None, "local steps of the head phase (unset: head_epochs or the run's)", positive_or_unset
    )
    head_epochs: float | None = setting(None, "epochs of the head phase", positive_or_unset)

    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head",)

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        return {"head": run.phase(self.head_steps, self.head_epochs)}

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.schedules(run)["head"]

    # --- the objective --------------------------------------------------------------------------

    def collapse(self, weight: Tensor, classes: Tensor) -> Tensor:
        """|| W W^T / ||W W^T||_F - P (.) u u^T ||_F for the head's W ``[C, M]`` and u ``[C]``."""
        c = weight.shape[0]
        gram = weight @ weight.T
        frame = (torch.eye(c, dtype=weight.dtype, device=weight.device) - 1 / c) / math.sqrt(c - 1)
        return (gram / gram.norm() - frame * classes[:, None] * classes[None, :]).norm()

    @staticmethod
    def classes_of(y: Tensor, mask: Tensor, width: int) -> Tensor:
        """u: 1 for each class with a real sample among ``y``."""
        hits = (y[:, None] == torch.arange(width, device=y.device)) * mask[:, None]
        return hits.amax(0).to(mask.dtype)

    def head_loss(self, head, features, y, mask, label_mask) -> Tensor:
        """CE + lam1 * collapse(W, u) + lam2 ||W||^2 on a batch of features (u from the batch's
        client, carried in ``label_mask``'s place by :meth:`objective_classes`)."""
        weight = head["head.weight"]
        ce = masked_cross_entropy(head_logits(head, features), y, mask)
        return (
            ce + self.lam1 * self.collapse(weight, label_mask) + self.lam2 * weight.square().sum()
        )

    def loss(self, params, x, y, mask, label_mask) -> Tensor:
        """The head's loss plus lam3 times the batch features' squared norm."""
        features = self.model.features(params, x)
        squared = (mask[:, None] * features.square()).sum()
        return self.head_loss(params, features, y, mask, label_mask) + self.lam3 * squared

    # --- a round --------------------------------------------------------------------------------

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """Head steps, joint steps, then the server's neural-collapse step on the head."""
        classes = self.classes_of(data.y, data.mask, self.model.num_classes)
        data = data._replace(label_mask=classes)  # the objective's u_i (every logit is real)
        head = self.train_head(downlink, state, data.using("head"), ctx)
        trained, mean_loss = self.train({**downlink, **head}, data, ctx)
        head = tree.select(trained, self.personal)
        grad = torch.func.grad(self.collapse)(head["head.weight"], classes)
        head = {**head, "head.weight": head["head.weight"] - self.nc_lr / ctx.cohort_size * grad}
        upload = tree.sub(downlink, tree.select(trained, self.shared))
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), head

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> Params:
        """A new head on the frozen body's features, trained on the head's part of f_i."""
        classes = self.classes_of(data.y, data.mask, self.model.num_classes)
        return self.train_head(downlink, state, data._replace(label_mask=classes), ctx)

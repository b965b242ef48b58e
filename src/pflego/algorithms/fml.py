"""FML: Federated Mutual Learning; a private model and a shared meme model teach each other.

Shen, Wang, Kuang, Zhang, Wu, Wu, Yang, Lu. "Federated Mutual Learning". arXiv:2006.16765
(2020). Peer implementation read: PFLlib (TsingZ0/PFLlib, ``clientfml.py`` / ``serverfml.py``).

Client k holds a private (local) model with predictions p_local and receives the meme model
w^t (predictions p_meme). On every local minibatch both models step together, by deep mutual
learning, on

    L_local = alpha L_C(p_local) + (1 - alpha) D_KL(p_meme || p_local),
    L_meme  = beta  L_C(p_meme)  + (1 - beta)  D_KL(p_local || p_meme),

each treating the other's predictions as fixed targets (DML), both gradients taken at the same
point before either model moves. Only the meme model is uploaded; the server averages the memes
(FedAvg, weighted by N_k); the private model never leaves the client and is what it predicts with.

Symbols to code: the meme model -> the shared ``body.*`` / ``head.*`` (a C-way head); the private
model -> the state ``private.*``; alpha, beta -> ``alpha``, ``beta`` (0.5 each by
default); L_C -> the masked cross-entropy; D_KL(p || q) -> :func:`mutual_kl`, per sample
``sum_c p_c (log p_c - log q_c)`` with p fixed, averaged over the batch's real samples; the two
simultaneous steps -> one ``train_steps`` on ``L_local + L_meme`` over both models (the targets
detached, so each model's gradient is its own loss's), with the client optimizer and
``ctx.client_lr``. The meme model's accuracy is logged too, as ``test_acc_meme``.

Deliberate differences from PFLlib: its ``KLDivLoss()`` averages over the samples *and* the C
classes (1/C of the paper's per-sample KL) and, without detaching the other model's output, its
two backward passes give each model the gradient of ``L_local + L_meme``; it clips each model's
gradient norm at 10 and lets the meme model have its own learning-rate decay. pflego follows the
paper's DML: per-sample KL, fixed targets, no clipping, one step size.

The private model starts as the run's initial model w^0 (from its seed, as every PFLlib client's
copy of the model does), so a first-visit state does not depend on the downlink. Unseen clients
(``join``): the first visit's mutual learning, from w^0 and the current meme model on
``adapt_schedule``'s batches (the run's local schedule); they predict with the private model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext

PRIVATE = "private."


def mutual_kl(target: Tensor, student: Tensor, mask: Tensor) -> Tensor:
    """Mean over real rows of ``D_KL(softmax(target) || softmax(student))``, the target fixed."""
    log_p = torch.log_softmax(target.detach(), -1)
    per_sample = (log_p.exp() * (log_p - torch.log_softmax(student, -1))).sum(-1)
    return (per_sample * mask).sum() / mask.sum().clamp(min=1)


@register("fml")
@dataclass(frozen=True)
class FML(Algorithm):
    alpha: float = setting(
        0.5, "weight alpha of the private model's cross-entropy against its KL", between(0, 1)
    )
    beta: float = setting(
        0.5, "weight beta of the meme model's cross-entropy against its KL", between(0, 1)
    )

    predictions: ClassVar[tuple[str, ...]] = ("meme",)
    downlink_predictions: ClassVar[tuple[str, ...]] = ("meme",)

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """The private model starts as w^0, the run's initial model."""
        first = next(iter(downlink.values()))
        initial = self.init_params(ctx.seed, first.dtype)
        return tree.add_prefix(PRIVATE, {k: initial[k].to(first.device) for k in downlink})

    def objective(self, label_mask: Tensor):
        """``L_local + L_meme`` on a batch of the joined models (``private.*`` and the meme)."""

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            local = self.model.forward(tree.strip_prefix(PRIVATE, params), x)
            meme = self.model.forward(params, x)
            l_local = self.alpha * masked_cross_entropy(local, y, mask, label_mask) + (
                1 - self.alpha
            ) * mutual_kl(meme, local, mask)
            l_meme = self.beta * masked_cross_entropy(meme, y, mask, label_mask) + (
                1 - self.beta
            ) * mutual_kl(local, meme, mask)
            return l_local + l_meme

        return loss

    def mutual(self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext):
        """Both models after the local steps of mutual learning, and the mean loss."""
        joined = {**downlink, **state}
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            self.objective(data.label_mask), joined, data, opt, opt.init(joined), ctx.client_lr
        )
        return trained, mean_loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.mutual(downlink, state, data, ctx)
        meme = {k: trained[k] for k in downlink}
        out = ClientOut(tree.sub(downlink, meme), data.num_samples, {"loss": mean_loss})
        return out, {k: trained[k] for k in state}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The private model."""
        return self.model.forward(tree.strip_prefix(PRIVATE, state), x)

    def predict_meme(self, downlink: Params, state: ClientState | None, x: Tensor) -> Tensor:
        """The meme model the server sends."""
        return self.model.forward(downlink, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """The private model after a first visit's mutual learning."""
        trained, _ = self.mutual(downlink, state, data, ctx)
        return {k: trained[k] for k in state}

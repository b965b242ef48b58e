"""FedKD: a private mentor and a shared mentee learn from each other by adaptive distillation.

Wu, Wu, Lyu, Huang, Xie. "Communication-efficient federated learning via knowledge
distillation". Nature Communications 13, 2032 (2022); arXiv:2108.13323. Peer implementation
read: PFLlib (TsingZ0/PFLlib, ``clientkd.py`` / ``serverkd.py``).

Client i keeps a mentor model t (private, never sent) and receives the mentee model s (shared,
aggregated by the server). On every local minibatch, with task losses L^task_t = CE(y_t, y) and
L^task_s = CE(y_s, y), hidden states H_t, H_s (the bodies' features) and a learned projection
W_h of the mentee's hidden states onto the mentor's, both models step together on

    L_t = L^task_t + (KL(y_s, y_t) + MSE(H_t, W_h H_s)) / (L^task_t + L^task_s),
    L_s = L^task_s + (KL(y_t, y_s) + MSE(H_t, W_h H_s)) / (L^task_t + L^task_s),

the paper's adaptive mutual distillation: each distillation loss is divided by
the two task losses, so the models teach each other more when their predictions are right. The
mentee's update is uploaded and averaged (weighted by N_i); the mentor is what the client
predicts with.

Symbols to code: s -> the shared ``body.*`` / ``head.*`` (a C-way head); t -> the state
``mentor.*``; W_h -> the state ``proj.weight`` (``[M, M]``, the mentor's and the mentee's feature
widths, equal here); KL(p, q) -> ``fml.mutual_kl`` (per sample, the teacher's side fixed);
MSE -> the squared gap averaged over the real rows and the M features; the simultaneous steps ->
one ``train_steps`` on ``L_t + L_s`` over mentee, mentor and W_h, with the client optimizer and
``ctx.client_lr``. The mentee's accuracy is logged too, as ``test_acc_mentee``.

Gradients: in L_t the mentee's predictions and W_h H_s are fixed targets, in L_s the mentor's
predictions and H_t (so W_h learns from L_s's hidden loss once); the denominators are adaptive
weights, not differentiated. PFLlib instead backpropagates L_t and L_s through everything, so
every model gets the gradient of L_t + L_s (the denominators' too), uses ``KLDivLoss()``'s mean
over samples and classes (1/C of the per-sample KL), clips gradient norms at 10 and gives the
mentee its own step size (``mentee_learning_rate``); pflego uses one step size.

Compression: with ``energy`` set, every uploaded update matrix (a weight tensor, flattened to
``[rows, rest]``) is replaced by its truncated SVD keeping the fewest singular values whose
energy sum sigma_k^2 exceeds ``energy`` times the total (the paper's rule; vectors are sent whole,
as in the authors' code). Left out: the paper's schedule raising the threshold from T_start to
T_end over the rounds (``energy`` is constant) and the compression
of the server's aggregated update on the downlink; the SVD runs on the reconstructed update (the
numbers the server receives), and the bytes a factorized upload would save are not simulated.
The mentee has the mentor's architecture, as in PFLlib (the paper's mentee is a smaller model).

The mentor starts as the run's initial model w^0 (from its seed) and W_h as PyTorch's default
``Linear`` initialization from the client's first-visit generator, so a first-visit state does
not depend on the downlink. Unseen clients (``join``): a first visit's mutual distillation with
the current mentee on ``adapt_schedule``'s batches (the run's local schedule); they predict with
the mentor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.algorithms.fml import mutual_kl
from pflego.fields import between, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext

MENTOR, PROJ = "mentor.", "proj.weight"


def hidden_gap(mentor: Tensor, projected: Tensor, mask: Tensor) -> Tensor:
    """MSE(H_t, W_h H_s) over the real rows and the features."""
    gaps = ((mentor - projected) ** 2).mean(-1) * mask
    return gaps.sum() / mask.sum().clamp(min=1)


def low_rank(update: Tensor, energy: float) -> Tensor:
    """``update`` (flattened to ``[rows, rest]``) through its truncated SVD: the fewest leading
    singular values whose squares sum to more than ``energy`` of the total."""
    u, sigma, vh = torch.linalg.svd(update.reshape(update.shape[0], -1), full_matrices=False)
    squares = sigma**2
    keep = (squares.cumsum(-1) - squares) <= energy * squares.sum()
    return ((u * (sigma * keep)) @ vh).reshape(update.shape)


@register("fedkd")
@dataclass(frozen=True)
class FedKD(Algorithm):
    energy: float | None = setting(
        None,
        "energy threshold T of the SVD compression of uploads (unset: uncompressed)",
        between(0, 1, "()").noting(" (or unset)"),
    )

    predictions: ClassVar[tuple[str, ...]] = ("mentee",)
    downlink_predictions: ClassVar[tuple[str, ...]] = ("mentee",)

    def init_client(self, downlink: Params, generator: torch.Generator, ctx: RoundContext):
        """The mentor starts as w^0, W_h as ``torch.nn.Linear``'s default initialization."""
        first = next(iter(downlink.values()))
        initial = self.init_params(ctx.seed, first.dtype)
        mentor = {k: initial[k].to(first.device) for k in downlink}
        m = self.model.feature_dim
        bound = 1 / m**0.5
        proj = (torch.rand(m, m, generator=generator, dtype=first.dtype) * 2 - 1) * bound
        return {**tree.add_prefix(MENTOR, mentor), PROJ: proj.to(first.device)}

    def objective(self, label_mask: Tensor):
        """``L_t + L_s`` on a batch of the joined models (mentee, ``mentor.*``, W_h)."""

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            mentor = tree.strip_prefix(MENTOR, params)
            h_t, h_s = self.model.features(mentor, x), self.model.features(params, x)
            y_t, y_s = head_logits(mentor, h_t), head_logits(params, h_s)
            task_t = masked_cross_entropy(y_t, y, mask, label_mask)
            task_s = masked_cross_entropy(y_s, y, mask, label_mask)
            tasks = (task_t + task_s).detach()  # 0 on a padding step, which moves nothing
            weight = torch.where(tasks > 0, 1 / tasks, 0.0)
            projected = h_s @ params[PROJ].T
            l_t = mutual_kl(y_s, y_t, mask) + hidden_gap(h_t, projected.detach(), mask)
            l_s = mutual_kl(y_t, y_s, mask) + hidden_gap(h_t.detach(), projected, mask)
            return task_t + task_s + weight * (l_t + l_s)

        return loss

    def distill(self, downlink: Params, state: ClientState, data: ClientData, ctx: RoundContext):
        """Mentee, mentor and W_h after the local steps, and the mean loss."""
        joined = {**downlink, **state}
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            self.objective(data.label_mask), joined, data, opt, opt.init(joined), ctx.client_lr
        )
        return trained, mean_loss

    def compress(self, update: Params) -> Params:
        """The upload with every matrix through its truncated SVD (``energy`` set)."""
        if self.energy is None:
            return update
        return {k: low_rank(v, self.energy) if v.dim() > 1 else v for k, v in update.items()}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.distill(downlink, state, data, ctx)
        update = self.compress({k: downlink[k] - trained[k] for k in downlink})
        out = ClientOut(update, data.num_samples, {"loss": mean_loss})
        return out, {k: trained[k] for k in state}

    def predict(self, downlink: Params, state: ClientState, x: Tensor) -> Tensor:
        """The mentor."""
        return self.model.forward(tree.strip_prefix(MENTOR, state), x)

    def predict_mentee(self, downlink: Params, state: ClientState | None, x: Tensor) -> Tensor:
        """The mentee the server sends."""
        return self.model.forward(downlink, x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext) -> ClientState:
        """Mentor and W_h after a first visit's mutual distillation."""
        trained, _ = self.distill(downlink, state, data, ctx)
        return {k: trained[k] for k in state}

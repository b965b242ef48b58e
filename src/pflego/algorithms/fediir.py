"""FedIIR: federated learning of implicit invariant relationships.

Guo, Guo, Yang, Fang, Zhou. "Out-of-Distribution Generalization of Federated Learning via Implicit
Invariant Relationships". ICML 2023 (PMLR 202:11905-11933; no arXiv id).

FedAvg whose clients also align the gradient of their loss with respect to the classifier w with
the federation's mean, so that the features Phi admit one classifier that is optimal for every
client's distribution (an invariant relationship learned without sharing data): client e minimizes
on its minibatches

    R_e(Phi, w) + gamma || grad_w R_e(Phi, w) - g_bar ||^2,

with g_bar the mean over clients of grad_w R_e at the global model, which the server keeps as an
exponential moving average, g_bar <- beta g_bar + (1 - beta) mean_e g_e. The models are averaged
weighted by N_e (server SGD with lr 1 on ``w - w_e``).

Symbols to code: Phi -> ``body.*``, w -> ``head.*`` (C-way, shared, weight and bias); R_e -> the
masked cross-entropy; grad_w R_e -> :func:`classifier_gradient`, the closed form of the linear
head's gradient, ``((softmax - onehot) * mask / n)^T [f, 1]`` (differentiable in Phi and w, so
the penalty's gradient flows through it); g_e -> the gradient of R_e over the client's whole
training split at the received model, uploaded as ``grad.head.*``; g_bar -> the server state's
``gbar``, sent as ``gbar.head.*`` (zeros before any gradient); gamma -> ``penalty`` (1e-3),
beta -> ``ema`` (0.95), FL-bench's defaults.

Deliberate differences:
- One exchange per round: a client uploads g_e at the model it received, with its trained model,
  and the server folds the cohort's sample-weighted mean into g_bar after the round, so round t
  aligns with the gradients at the models of rounds before t. The paper's Algorithm 1 and FL-bench
  first ask the round's cohort for its gradients at the current model (a second exchange per
  round) and train with that g_bar.
- g_e is the gradient of the mean loss over the client's training split; FL-bench averages its
  minibatches' gradients (the same up to the last batch's size) and weights clients by their
  number of batches where this weights by N_e.

Unseen clients (``join``): nothing; FedIIR is a global method, every client predicts with the
global model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import between, non_negative, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext

GBAR = "gbar."  # the server's mean classifier gradient g_bar, in the downlink
GRAD = "grad."  # the client's classifier gradient g_e, in the upload


def classifier_gradient(
    params: Params, features: Tensor, y: Tensor, mask: Tensor, label_mask: Tensor
) -> Params:
    """The gradient of the masked mean cross-entropy with respect to the linear head, in closed
    form (differentiable in the features and the head)."""
    logits = head_logits(params, features)
    logits = torch.where(label_mask > 0, logits, torch.finfo(logits.dtype).min)
    onehot = (y.unsqueeze(-1) == torch.arange(logits.shape[-1], device=y.device)).to(logits.dtype)
    residual = (torch.softmax(logits, -1) - onehot) * (mask / mask.sum().clamp(min=1)).unsqueeze(-1)
    return {"head.weight": residual.T @ features, "head.bias": residual.sum(0)}


@register("fediir")
@dataclass(frozen=True)
class FedIIR(Algorithm):
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    penalty: float = setting(
        1e-3, "weight gamma of the classifier-gradient alignment penalty", non_negative
    )
    ema: float = setting(
        0.95, "moving-average factor beta of the server's mean classifier gradient", between(0, 1)
    )

    def init_server(self, params):
        return {
            **super().init_server(params),
            "gbar": tree.zeros_like(tree.select(params, ["head"])),
        }

    def downlink(self, server, ctx, clients=None):
        return {**server["params"], **tree.add_prefix(GBAR, server["gbar"])}

    def evaluation_downlink(self, server, ctx, clients=None):
        return server["params"]

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        gbar = tree.strip_prefix(GBAR, downlink)
        start = {k: v for k, v in downlink.items() if not k.startswith(GBAR)}
        label_mask = data.label_mask

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            features = self.model.features(params, x)
            ce = masked_cross_entropy(head_logits(params, features), y, mask, label_mask)
            g = classifier_gradient(params, features, y, mask, label_mask)
            return ce + self.penalty * tree.sq_norm(tree.sub(g, gbar))

        features = self.model.features(start, data.x)
        own = classifier_gradient(start, features, data.y, data.mask, label_mask)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(loss, start, data, opt, opt.init(start), ctx.client_lr)
        upload = {**tree.sub(start, trained), **tree.add_prefix(GRAD, tree.detach(own))}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), state

    def server_update(self, server, aggregated, ctx):
        step = {k: v for k, v in aggregated.items() if not k.startswith(GRAD)}
        server = super().server_update(server, step, ctx)
        mean = tree.strip_prefix(GRAD, aggregated)
        gbar = {k: self.ema * v + (1 - self.ema) * mean[k] for k, v in server["gbar"].items()}
        return {**server, "gbar": gbar}

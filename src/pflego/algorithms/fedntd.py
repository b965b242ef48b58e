"""FedNTD: FedAvg whose local training distills the global model's not-true logits.

Lee, Jeong, Shin, Yun. "Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning". NeurIPS 2022; arXiv:2106.03097.

Forgetting of the global knowledge in local training sits in the classes a client does not
hold: FedNTD keeps the global model's view of the classes other than each sample's label. With
the local model's logits z, the received global model's z^g and the temperature tau, for a sample
of label y,

    q~_c(z) = exp(z_c / tau) / sum_{c' != y} exp(z_{c'} / tau)    (c != y),
    L = CE(z, y) + beta * tau^2 * KL(q~(z^g) || q~(z)),

averaged over the batch, and the server averages the local models (FedAvg).

Symbols to code: w -> ``body.*`` and ``head.*`` (one C-way model, shared), z^g -> the logits of
the downlink (held fixed), tau -> ``tau``, beta -> ``beta``; the local steps -> ``train_steps``
on the loss of :meth:`FedNTD.objective` from the downlink with ``ctx.client_lr``; the upload is
FedAvg's pseudo-gradient with weight N_i.

Differences and choices: the not-true logits are gathered in class order as the authors'
``refine_as_not_true`` (Lee-Gihun/FedNTD, copied by PFLlib), and the KL divergence is averaged
over the batch's real samples (their ``KLDivLoss(reduction="batchmean")``). The defaults tau = 3,
beta = 1 are those of the authors' ``NTD_Loss``; the paper tunes both per setting. The teacher's
logits are computed on every minibatch (the teacher never changes within a round). The logged
loss includes the distillation term.

Unseen clients (``join``): nothing; FedNTD trains one global model, which every client predicts
with (``join_epochs`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, positive, setting
from pflego.local import LossFn, train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext


def not_true(logits: Tensor, y: Tensor) -> Tensor:
    """``[n, C - 1]``: each row's logits without the one of its label ``y``, in class order."""
    j = torch.arange(logits.shape[-1] - 1, device=logits.device)
    positions = j + (j >= y[:, None]).to(j.dtype)
    return logits.gather(-1, positions)


def not_true_kl(student: Tensor, teacher: Tensor, y: Tensor, tau: float) -> Tensor:
    """``[n]``: KL(q~(teacher) || q~(student)) over the not-true classes at temperature tau."""
    log_s = torch.log_softmax(not_true(student, y) / tau, -1)
    log_t = torch.log_softmax(not_true(teacher, y) / tau, -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


@register("fedntd")
@dataclass(frozen=True)
class FedNTD(Algorithm):
    tau: float = setting(3.0, "temperature tau of the not-true distillation", positive)
    beta: float = setting(1.0, "weight beta of the not-true distillation", non_negative)

    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is

    def objective(self, teacher: Params, label_mask: Tensor) -> LossFn:
        """``CE + beta tau^2 KL`` on a batch, the global model ``teacher`` held fixed."""

        def loss(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            logits = head_logits(params, self.model.features(params, x))
            taught = self.model.forward(teacher, x).detach()
            kl = not_true_kl(logits, taught, y, self.tau)
            distill = (kl * mask).sum() / mask.sum().clamp(min=1)
            ce = masked_cross_entropy(logits, y, mask, label_mask)
            return ce + self.beta * self.tau**2 * distill

        return loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            self.objective(downlink, data.label_mask),
            downlink,
            data,
            opt,
            opt.init(downlink),
            ctx.client_lr,
        )
        return ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss}), state

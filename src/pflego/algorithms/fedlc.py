"""FedLC: federated learning with logits calibrated by each client's label counts.

Zhang, Li, Li, Xu, Wu, Ding, Wu. "Federated Learning with Label Distribution Skew via Logits
Calibration". ICML 2022; arXiv:2209.00189.

FedAvg whose local loss calibrates every logit by a pairwise label margin that grows as the class
gets rarer on the client: with n_{c,y} the number of client c's training samples of class y,

    L_cal(y; f(x)) = -log [ exp(f_y(x) - tau n_{c,y}^{-1/4})
                            / sum_{y'} exp(f_{y'}(x) - tau n_{c,y'}^{-1/4}) ],

i.e. the cross-entropy of the calibrated logits ``f(x) - tau n_c^{-1/4}``. The server averages the
local models weighted by N_i (server SGD with lr 1 on ``w - w_i``). Prediction uses the plain
logits of the global model: the calibration only shapes local training.

Symbols to code: f -> ``self.model.forward`` of ``body.*`` and ``head.*`` (shared, one C-way
head), n_{c,y} -> the label counts of the client's training split (computed from ``data.y`` and
``data.mask`` every round), tau -> ``tau`` (default 1.0, FL-bench's and PFLlib's default; the
paper tunes it), the local solver -> ``pflego.local.train_steps`` with ``ctx.client_lr``.
Each client calibrates with its own label counts, as the paper; PFLlib's ``clientlc.py`` instead
uses the label counts summed over the whole federation, the same for every client.

The denominator: the paper's Eq. writes it over y' != y, a margin loss that is unbounded below;
FL-bench reports that training collapses with it (its ``src/server/fedlc.py`` note, issue #5)
and, like PFLlib, sums over every class, as the text's "calibrates the logits before softmax
cross-entropy" says. That is the default here; ``exclude_target: true`` gives the Eq. as written.
A class the client has none of has n^{-1/4} = inf: its calibrated logit is -inf, so it leaves
the softmax (FL-bench instead floors the count at 1e-8, a finite -100 tau offset; PFLlib's
zero counts give the same -inf as here). With ``exclude_target`` a client that holds one class
has an empty sum for it; its loss is then the numerator's ``-(f_y - tau n_y^{-1/4})`` alone.
The logged training loss is the calibrated one.

Unseen clients (``join``): nothing; FedLC is a global method, every client predicts with the
global model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, setting
from pflego.local import train_steps
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext


@register("fedlc")
@dataclass(frozen=True)
class FedLC(Algorithm):
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is
    tau: float = setting(1.0, "strength tau of the label-distribution calibration", non_negative)
    exclude_target: bool = setting(
        False, "leave the target class out of the calibrated sum (the paper's Eq. as written)"
    )

    def calibrated_loss(self, counts: torch.Tensor, label_mask: torch.Tensor):
        """The masked mean of L_cal over a batch, for a client with label ``counts`` [K]."""
        present = (counts > 0) & (label_mask > 0)
        offset = self.tau * counts.clamp(min=1) ** -0.25
        classes = torch.arange(counts.shape[-1], device=counts.device)

        def loss(params: Params, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor):
            calibrated = self.model.forward(params, x) - offset
            target = calibrated.gather(-1, y.unsqueeze(-1)).squeeze(-1)
            summed = present
            if self.exclude_target:
                summed = summed & (classes != y.unsqueeze(-1))
            lowest = torch.finfo(calibrated.dtype).min
            normalizer = torch.logsumexp(torch.where(summed, calibrated, lowest), -1)
            normalizer = torch.where(summed.any(-1), normalizer, 0.0)  # an empty sum: see above
            per_sample = normalizer - target
            return (per_sample * mask).sum() / mask.sum().clamp(min=1)

        return loss

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        classes = torch.arange(data.label_mask.shape[-1], device=data.y.device)
        onehot = (data.y.unsqueeze(-1) == classes).to(data.mask.dtype)
        counts = (onehot * data.mask.unsqueeze(-1)).sum(0)  # n_{c,y}
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            self.calibrated_loss(counts, data.label_mask),
            downlink,
            data,
            opt,
            opt.init(downlink),
            ctx.client_lr,
        )
        return ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss}), state

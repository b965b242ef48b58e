"""FedAvg: federated averaging of the whole model.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas. "Communication-Efficient Learning of Deep
Networks from Decentralized Data". AISTATS 2017; arXiv:1602.05629.

Each sampled client starts from the global model w, runs local steps on its data and uploads the
pseudo-gradient ``w - w_i``; the server descends along the N_i-weighted mean, so server SGD with
lr 1 (the default) is exactly weighted averaging. One C-way head is shared by all clients.

Symbols to code: w -> all of ``body.*`` and ``head.*`` (shared), eta -> ``ctx.client_lr``.
Local steps are full-batch gradient descent (``batch_size`` unset, as in the PFLEGO paper's
comparison) or minibatch SGD. A new client (``join``) uses the global model as it is (a run that
sets ``join_epochs`` is refused: there is nothing to train).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.local import train_steps
from pflego.loss import Objective
from pflego.types import ClientData, ClientOut, RoundContext


@register("fedavg")
@dataclass(frozen=True)
class FedAvg(Algorithm):
    default_client_lr: ClassVar[float] = 0.3  # eta, tuned in the main experiment
    join_trains: ClassVar[bool] = False  # a new client uses the global model as it is

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, _, mean_loss = train_steps(
            Objective(self.model, data.label_mask, fixed=state),
            downlink,
            data,
            self.client_optimizer,
            self.client_optimizer.init(downlink),
            ctx.client_lr,
        )
        return ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss}), state

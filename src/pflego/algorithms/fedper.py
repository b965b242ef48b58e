"""FedPer: federated learning with personalization layers.

Arivazhagan, Aggarwal, Singh, Choudhary. "Federated Learning with Personalization Layers".
arXiv:1912.00818, 2019.

FedAvg on the body; each client keeps its own head, trained jointly with the body during local
steps and never sent. Symbols to code: base layers -> ``body.*`` (shared, averaged by N_i),
personalization layers -> ``head.*`` (personal, over the client's own K_i classes, as in the
PFLEGO paper's comparison).

A new client (``join``): a new head trained on the frozen features of the learned body
(``adapt_schedule``'s steps, by default the run's local schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.local import train_steps
from pflego.loss import Objective
from pflego.types import ClientData, ClientOut, RoundContext


@register("fedper")
@dataclass(frozen=True)
class FedPer(Algorithm):
    shared: ClassVar[tuple[str, ...]] = ("body",)
    personal: ClassVar[tuple[str, ...]] = ("head",)
    label_space: ClassVar[str] = "local"
    default_client_lr: ClassVar[float] = 0.3  # tuned in the main experiment

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        params = {**downlink, **state}
        trained, _, mean_loss = train_steps(
            Objective(self.model, data.label_mask),
            params,
            data,
            self.client_optimizer,
            self.client_optimizer.init(params),
            ctx.client_lr,
        )
        upload = tree.sub(downlink, tree.select(trained, self.shared))
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), tree.select(
            trained, self.personal
        )

    def join(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.fit_head(downlink, state, data, ctx)

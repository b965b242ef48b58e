"""FedAvg+: FedAvg, then each client fine-tunes a copy of the global model before it predicts.

The "local tuning" baseline of FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal. "Federated
Multi-Task Learning under a Mixture of Distributions". NeurIPS 2021; arXiv:2108.10252), after
Jiang, Konečný, Rush, Kannan, "Improving Federated Learning Personalization via Model Agnostic
Meta Learning" (arXiv:1909.12488).

Training is FedAvg's, unchanged (see ``fedavg.py``). At every evaluation client i copies the
global model w, takes ``finetune_epochs`` epochs (default 1) of local steps on its training data,
w_i = w - eta sum grad f_i, and predicts with w_i; the copy is discarded, never stored nor sent.

Symbols to code: w -> the downlink (``body.*`` and ``head.*``, a C-way head), w_i -> the state
``adapt`` returns (laid over the downlink by ``predict``), eta -> ``ctx.client_lr``.

Unseen clients (``join``): the same fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pflego.algorithms.base import register
from pflego.algorithms.fedavg import FedAvg
from pflego.fields import positive, setting
from pflego.types import ClientData, RoundContext, Schedule


@register("fedavg+")
@dataclass(frozen=True)
class FedAvgPlus(FedAvg):
    join_trains: ClassVar[bool] = True  # a new client fine-tunes, as at every evaluation

    finetune_epochs: float = setting(
        1.0, "epochs each client fine-tunes the global model before evaluation", positive
    )

    def adapt(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.train(downlink, data, ctx)[0]

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return run.phase(epochs=self.finetune_epochs)

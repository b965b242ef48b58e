"""Ditto: a global model trained as in FedAvg and a personal model kept near it.

Li, Hu, Beirami, Smith. "Ditto: Fair and Robust Federated Learning Through Personalization".
ICML 2021; arXiv:2012.04221.

Each sampled client k receives w^t and, independently of each other,
- trains a copy of the global model on F_k as in FedAvg and uploads it (w^t - w_k);
- updates its personal model v_k for s steps on h_k(v; w^t) = F_k(v) + lambda/2 ||v - w^t||^2,
  that is v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)), toward the round-start global
  model w^t (not the copy it just trained).
The server averages the global copies (weighted by N_k); predictions use v_k.

Symbols to code: w -> all of ``body.*`` and ``head.*`` (shared, a C-way head), v_k -> the
client state (a whole model), lambda -> ``lam``, eta -> ``ctx.client_lr``, s -> the named
schedule ``personal`` (``personal_steps`` / ``personal_epochs``; unset, the run's own schedule).

Differences: v_k starts from the global model of the round the client first trains in (the paper
initializes every v_k at w^0); until then the client predicts with the current global model.
The state holds v_k and a flag ``fresh`` (1 until the first visit), so the first-visit state
does not depend on when it is created and every backend and Flower node agree. The paper tunes lambda
per dataset, and the default 0.1 is a starting point for tuning. The global copy and v_k use the
same step size (the PFLEGO reference code allows a separate one for the global copy).

Unseen clients (``join``): the personal solve, s steps on h_k from v = w.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import non_negative, positive_or_unset, setting
from pflego.types import ClientData, ClientOut, RoundContext, Schedule


@register("ditto")
@dataclass(frozen=True)
class Ditto(Algorithm):
    lam: float = setting(
        0.1, "strength lambda of the pull of the personal model toward the global one", non_negative
    )
    personal_steps: int | None = setting(
        None, "local steps of the personal model (unset: the run's schedule)", positive_or_unset
    )
    personal_epochs: float | None = setting(
        None, "local epochs of the personal model (unset: the run's schedule)", positive_or_unset
    )

    personal: ClassVar[tuple[str, ...]] = ("body", "head")
    # eta of both the global and the personal steps: the least worst-case regret over three
    # federations of benchmarks/defaults_study.py (docs/defaults.md); 0.05 was 15% below the best
    default_client_lr: ClassVar[float] = 0.3

    def init_client(self, downlink, generator, ctx: RoundContext):
        dtype = next(iter(downlink.values())).dtype
        return {"fresh": torch.ones((), dtype=dtype), **tree.zeros_like(downlink)}

    def personal_model(self, downlink, state):
        """v_k: the stored personal model, or the global model before the client first trains."""
        stored = {k: v for k, v in state.items() if k != "fresh"}
        return tree.where(state["fresh"] > 0, downlink, stored)

    def schedules(self, run: Schedule) -> dict[str, Schedule]:
        return {"personal": run.phase(self.personal_steps, self.personal_epochs)}

    def personalize(self, downlink, state, data: ClientData, ctx: RoundContext):
        """The new state: v_k after its steps on F_k(v) + lambda/2 ||v - w^t||^2 (``data``'s
        schedule)."""
        start = self.personal_model(downlink, state)
        v, _ = self.train(start, data, ctx, anchor=downlink, strength=self.lam)
        return {"fresh": torch.zeros_like(state["fresh"]), **v}

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        trained, mean_loss = self.train(downlink, data, ctx)
        personal = self.personalize(downlink, state, data.using("personal"), ctx)
        return ClientOut(
            tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss}
        ), personal

    def predict(self, downlink, state, x):
        return self.model.forward(self.personal_model(downlink, state), x)

    def join(self, downlink, state, data: ClientData, ctx: RoundContext):
        return self.personalize(downlink, state, data, ctx)

    def adapt_schedule(self, run: Schedule) -> Schedule:
        return self.schedules(run)["personal"]

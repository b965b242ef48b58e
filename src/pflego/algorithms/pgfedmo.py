"""PGFedMo: PGFed whose clients keep a momentum of their auxiliary gradient.

Luo, Mendieta, Chen, Wu. "PGFed: Personalize Each Client's Global Objective for Federated
Learning". ICCV 2023; arXiv:2212.01448 (Section 4.4, Eq. 15).

PGFed (see :mod:`pflego.algorithms.pgfed`), except that client i descends a momentum of the
auxiliary gradients it has downloaded, so the risks of clients outside S_{t-1} are not forgotten:
``g~_i <- (1 - beta) g~_i(downloaded) + beta g~_i(previous)`` (Algorithm 1, ClientUpdate line 6).
The first auxiliary gradient a client receives is taken as it is (there is no previous one), as the
authors' code does.

Symbols to code: beta -> ``beta``, g~_i(previous) -> the client state ``aux.*``; ``aux_seen`` is 1
once the client has received a real auxiliary gradient (the first round's is empty), which the
downlink signals with ``aux_valid``.

Deliberate difference: the authors' code never applies the momentum (their script runs
``-algo PGFed -bt 0.5`` and the server reads beta only for ``PGFedMo``); here it is applied.
With ``beta = 0`` PGFedMo is PGFed. A newcomer joins as in PGFed (fine-tuning the global model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pflego import tree
from pflego.algorithms.base import register
from pflego.algorithms.pgfed import MODEL, PGFed
from pflego.fields import between, setting


@register("pgfedmo")
@dataclass(frozen=True)
class PGFedMo(PGFed):
    beta: float = setting(
        0.5, "momentum beta of the auxiliary gradients (0: PGFed)", between(0, 1, "[)")
    )

    def downlink(self, server, ctx, clients=None):
        """PGFed's payload, plus whether its auxiliary gradient is real (S_{t-1} not empty)."""
        payload = super().downlink(server, ctx, clients)
        valid = server["pgfed"]["offsets"].new_tensor(float(len(server["pgfed"]["ids"]) > 0))
        return {**payload, "aux_valid": valid if clients is None else valid.expand(len(clients))}

    def init_client(self, downlink, generator, ctx):
        """PGFed's theta_i, and no auxiliary gradient yet."""
        aux = tree.zeros_like(tree.select(downlink, MODEL))
        first = next(iter(aux.values()))
        return {
            **super().init_client(downlink, generator, ctx),
            **tree.add_prefix("aux.", aux),
            "aux_seen": first.new_zeros(()),
        }

    def auxiliary_gradient(self, downlink, state):
        """Eq. 15 once the client has a previous auxiliary gradient, the download before that."""
        new, old = tree.strip_prefix("aux.", downlink), tree.strip_prefix("aux.", state)
        seen = state["aux_seen"] > 0
        mixed = {
            k: torch.where(seen, (1 - self.beta) * v + self.beta * old[k], v)
            for k, v in new.items()
        }
        remembered = {
            **tree.add_prefix("aux.", mixed),
            "aux_seen": torch.maximum(state["aux_seen"], downlink["aux_valid"]),
        }
        return mixed, {**state, **remembered}

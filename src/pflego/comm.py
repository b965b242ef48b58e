"""Communication per round: the bytes a sampled client receives and sends, measured on the payloads.

Nothing is modelled: the downlink a client gets (its own payload for algorithms with per-client
downlinks) and the upload its ``client_update`` returns are built as in a real round, and their
tensors are counted (elements x bytes per element, in the run's dtype). The upload counts the
aggregation weight; logged metrics are not part of the protocol and are left out. Payload shapes
do not depend on which client is asked, so one client of the cohort is measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from pflego import tree
from pflego.sim import Simulation


@dataclass(frozen=True)
class Traffic:
    """Bytes one sampled client receives (``down``) and sends (``up``) in a round."""

    down: int
    up: int


def payload_bytes(payload: Mapping[str, Tensor]) -> int:
    """Bytes of the tensors of a payload (a view counts as the elements it shows)."""
    return sum(v.numel() * v.element_size() for v in payload.values())


def round_traffic(sim: Simulation, t: int | None = None) -> Traffic:
    """What the first sampled client of round ``t`` (default: the next round) receives and sends.

    The simulation is left as it was: the round is not committed and no state is stored.
    """
    t = sim.next_round if t is None else t
    ctx, cohort = sim.context(t), sim.cohort(t)[:1]
    if len(cohort) == 0:  # Bernoulli sampling drew nobody: any client's payloads have the sizes
        cohort = np.zeros(1, dtype=np.int64)
    client = int(cohort[0])
    downlink = sim.one_downlink(sim.downlink(ctx, cohort), client, 0)
    if sim.store.initialized[client]:
        state = sim.store.get(client)
    else:
        state = sim.init_state(client, downlink, ctx)
    state = tree.to(state, sim.device)
    data = sim.round_inputs(t, cohort).client(0)
    out, _ = sim.algorithm.client_update(downlink, state, data, ctx)
    return Traffic(payload_bytes(downlink), payload_bytes({**out.upload, "weight": out.weight}))

"""Backends run the cohort's client updates; the loop backend is the reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pflego import tree
from pflego.algorithms import Algorithm
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, ClientState, RoundContext


def loop_backend(
    algorithm: Algorithm,
    downlink: Params,
    states: Sequence[ClientState],
    datas: Sequence[ClientData],
    ctx: RoundContext,
) -> tuple[ClientOut, list[ClientState]]:
    """Run ``client_update`` one client at a time; outputs are stacked on a leading cohort axis."""
    outs, new_states = [], []
    for state, data in zip(states, datas):
        out, new_state = algorithm.client_update(downlink, state, data, ctx)
        outs.append(out)
        new_states.append(new_state)
    return stack_outs(outs), new_states


def stack_outs(outs: Sequence[ClientOut]) -> ClientOut:
    """Stack per-client outputs into one ``ClientOut`` with a leading cohort axis."""
    return ClientOut(
        upload=tree.stack(o.upload for o in outs),
        weight=torch.stack([o.weight for o in outs]),
        metrics=tree.stack(o.metrics for o in outs),
    )


BACKENDS = {"loop": loop_backend}

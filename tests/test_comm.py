"""Bytes per round, measured on the real payloads: FedAvg against the PGFed family."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_experiment

from pflego.comm import Traffic, payload_bytes, round_traffic
from pflego.sim import Simulation

SCALAR = 8  # one float64


def relative(traffic: Traffic, other: Traffic) -> float:
    """``traffic`` (down + up) as a multiple of ``other``'s."""
    return (traffic.down + traffic.up) / (other.down + other.up)


def traffic(name: str, rounds: int = 1) -> tuple[Traffic, int]:
    sim = Simulation(tiny_experiment(algorithm=name), None)
    for t in range(rounds):
        sim.run_round(t)
    store = {k: v.clone() for k, v in sim.store.tensors.items()}
    measured = round_traffic(sim)
    assert all(torch.equal(store[k], v) for k, v in sim.store.tensors.items())  # nothing stored
    return measured, payload_bytes(sim.server["params"])


def test_fedavg_sends_the_model_each_way():
    measured, model = traffic("fedavg")
    assert measured == Traffic(down=model, up=model + SCALAR)  # the upload carries N_i


@pytest.mark.parametrize("rounds", [0, 2])
def test_pgfed_costs_two_and_a_half_fedavg_and_pgfed_ce_two(rounds):
    fedavg, model = traffic("fedavg", rounds)
    pgfed, _ = traffic("pgfed", rounds)
    ce, _ = traffic("pgfed-ce", rounds)
    mo, _ = traffic("pgfedmo", rounds)
    # Down: theta_glob and g~_i. Up: theta_i, g_i, the iterate sum (not for CE); g1_i, S_i, N_i.
    assert pgfed == Traffic(down=2 * model, up=3 * model + 3 * SCALAR)
    assert ce == Traffic(down=2 * model, up=2 * model + 3 * SCALAR)
    assert mo == Traffic(down=2 * model + SCALAR, up=pgfed.up)  # + whether g~_i is real
    assert relative(pgfed, fedavg) == pytest.approx(2.5, abs=0.01)
    assert relative(ce, fedavg) == pytest.approx(2.0, abs=0.01)

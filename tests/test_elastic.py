"""Elastic Aggregation against a hand-written float64 reference on ragged clients.

The reference uses only torch autograd on the MLP written out by hand (``test_classic``'s
``logits`` / ``ce`` / ``gradient`` / ``descend``) and plain loops: each sampled client's moving
average of |d mean ||F(x)||^2 / d theta| over its real minibatches at the received model (carried
across its rounds), FedAvg's local steps, and the server step
``theta - (1 + tau - Omega / max Omega) * sum p_i (theta - theta_i)``. Half of the clients take
part in each round, with different numbers of local steps.
"""

from __future__ import annotations

import pytest
import torch
from test_classic import (
    EPOCHS,
    assert_close,
    ce,
    descend,
    gradient,
    logits,
    round_inputs,
    steps_of,
)
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

TAU, MU = 0.3, 0.6


def output_norm(p, x, y):
    return (logits(p, x) ** 2).sum(-1).mean()


def test_elastic_rounds_equal_the_papers_sensitivity_scaled_averaging():
    options = {"tau": TAU, "mu": MU}
    sim = Simulation(ragged_experiment("elastic", options=options, **EPOCHS), None)
    theta = {k: v.clone() for k, v in sim.server["params"].items()}
    omegas: dict[int, dict] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, theta)
        sizes, deltas, sensitivities = [], [], []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in omegas
            omega = omegas.get(i, {k: torch.zeros_like(v) for k, v in theta.items()})
            for x, y in steps_of(data):
                g = gradient(output_norm, theta, x, y)
                omega = {k: MU * v + (1 - MU) * g[k].abs() for k, v in omega.items()}
            omegas[i] = omega
            trained = descend(theta, ce, steps_of(data))
            sizes.append(float(len(data.y)))
            deltas.append({k: theta[k] - trained[k] for k in theta})
            sensitivities.append(omega)
        p = [n / sum(sizes) for n in sizes]
        agg = {k: sum(pi * o[k] for pi, o in zip(p, sensitivities, strict=True)) for k in theta}
        largest = max(float(v.max()) for v in agg.values())
        zeta = {k: 1 + TAU - v / largest for k, v in agg.items()}
        step = {k: sum(pi * d[k] for pi, d in zip(p, deltas, strict=True)) for k in theta}
        theta = {k: v - zeta[k] * step[k] for k, v in theta.items()}
        sim.run_round(t)
        assert_close(sim.server["params"], theta)
        for i in cohort:
            state = sim.store.get(i)
            assert_close({k[6:]: v for k, v in state.items()}, omegas[i])
    assert revisits > 0
    assert (
        min(float(z.min()) for z in zeta.values()) < 1 < max(float(z.max()) for z in zeta.values())
    )

    # every client predicts with the global model; join changes nothing
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = clients[0].x
    newcomer = sim.init_state(sim.exp.data.num_clients, downlink, ctx)
    for state in (sim.store.get(cohort[0]), newcomer):
        joined = sim.algorithm.join(downlink, state, clients[0], ctx)
        assert joined is state
        torch.testing.assert_close(
            sim.algorithm.predict(downlink, joined, x), logits(theta, x), rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("options", [{"tau": -0.1}, {"mu": 1.0}])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("elastic", options=options)

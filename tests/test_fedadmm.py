"""FedADMM against a hand-written float64 reference on ragged clients.

The reference uses only torch autograd on the MLP written out by hand (``test_classic``'s
``logits`` / ``ce`` / ``descend``), plain loops and the paper's Algorithm 1: each sampled client's
local steps on its augmented Lagrangian from theta^t, its dual ascent step, the change of its
augmented model w_i + y_i / rho (w_i = theta^0, y_i = 0 before its first round), and the server's
step of eta / m times their sum. Half of the clients take part in each round, so some clients
return with the primal and dual of an earlier round while others arrive for the first time.
"""

from __future__ import annotations

import pytest
import torch
from test_classic import EPOCHS, assert_close, ce, descend, logits, round_inputs, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

RHO = 0.5
ETA = 0.8  # the server's step size


def lagrangian(theta: dict, y: dict, rho: float):
    """f_i(w) + <y_i, w - theta> + rho/2 ||w - theta||^2."""

    def loss(p, x, labels):
        linear = sum((y[k] * (p[k] - theta[k])).sum() for k in p)
        penalty = sum(((p[k] - theta[k]) ** 2).sum() for k in p)
        return ce(p, x, labels) + linear + rho / 2 * penalty

    return loss


@pytest.mark.parametrize("settings", [EPOCHS, {"inner_steps": 2}], ids=["minibatch", "full"])
def test_fedadmm_rounds_equal_the_papers_primal_dual_updates(settings):
    sim = Simulation(
        ragged_experiment("fedadmm", server_lr=ETA, options={"rho": RHO}, **settings), None
    )
    theta = {k: v.clone() for k, v in sim.server["params"].items()}
    theta0, m = dict(theta), sim.exp.data.num_clients
    primal: dict[int, dict] = {}
    dual: dict[int, dict] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, theta)
        changes = []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in primal
            w = primal.get(i, theta0)  # w_i^0 = theta^0
            y = dual.get(i, {k: torch.zeros_like(v) for k, v in theta.items()})
            new_w = descend(theta, lagrangian(theta, y, RHO), steps_of(data))
            new_y = {k: y[k] + RHO * (new_w[k] - theta[k]) for k in theta}
            changes.append({k: new_w[k] + new_y[k] / RHO - (w[k] + y[k] / RHO) for k in theta})
            primal[i], dual[i] = new_w, new_y
        theta = {k: v + ETA / m * sum(d[k] for d in changes) for k, v in theta.items()}
        sim.run_round(t)
        assert_close(sim.server["params"], theta)
        for i in cohort:
            state = sim.store.get(i)
            assert_close({k[7:]: v for k, v in state.items() if k.startswith("primal.")}, primal[i])
            assert_close({k[5:]: v for k, v in state.items() if k.startswith("dual.")}, dual[i])
    assert revisits > 0  # clients came back with the primal and dual of an earlier round

    # every client predicts with the global model theta; join changes nothing
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


def test_a_first_visit_holds_the_initial_model_and_a_zero_dual_whatever_the_round():
    sim = Simulation(ragged_experiment("fedadmm"), None)
    theta0 = {k: v.clone() for k, v in sim.server["params"].items()}
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    state = sim.init_state(sim.exp.data.num_clients, downlink, ctx)
    assert_close({k[7:]: v for k, v in state.items() if k.startswith("primal.")}, theta0)
    assert all(float(v.abs().max()) == 0.0 for k, v in state.items() if k.startswith("dual."))


def test_bad_rho_is_a_one_line_error():
    with pytest.raises(ConfigError, match="rho=0"):
        ragged_experiment("fedadmm", options={"rho": 0.0})

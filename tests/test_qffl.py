"""q-FFL (q-FedAvg) against a hand-written float64 reference on ragged clients.

The reference uses only torch autograd on the MLP written out by hand (``test_classic``'s
``logits`` / ``ce`` / ``descend``), plain loops and the paper's formulas (Algorithm 2 with
L = 1/eta): each sampled client's loss at the received model, its local steps, Delta_k and h_k,
and the server step ``w - sum p_k Delta_k / sum p_k h_k``. The clients differ in size, label set
and number of local steps, and half of them take part in each round.
"""

from __future__ import annotations

import pytest
import torch
from test_classic import EPOCHS, LR, assert_close, ce, descend, logits, round_inputs, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation


def qffl_reference_step(w: dict, clients, q: float) -> dict:
    """One round of q-FedAvg from the global model ``w`` over the cohort's ``clients``."""
    deltas, hs, sizes = [], [], []
    for data in clients:
        f = float(ce(w, data.x, data.y)) + 1e-10  # F_k(w^t) on the whole training split
        w_k = descend(w, ce, steps_of(data))
        dw = {k: (w[k] - w_k[k]) / LR for k in w}  # L (w^t - w_k), L = 1 / eta
        deltas.append({k: f**q * v for k, v in dw.items()})
        norm = sum(float((v**2).sum()) for v in dw.values())
        hs.append(q * f ** (q - 1) * norm + f**q / LR)
        sizes.append(float(len(data.y)))
    numerator = {k: sum(n * d[k] for n, d in zip(sizes, deltas, strict=True)) for k in w}
    denominator = sum(n * h for n, h in zip(sizes, hs, strict=True))
    return {k: v - numerator[k] / denominator for k, v in w.items()}


@pytest.mark.parametrize("q", [0.5, 2.0])
def test_qffl_rounds_equal_q_fedavg(q):
    sim = Simulation(ragged_experiment("qffl", options={"q": q}, **EPOCHS), None)
    w = {k: v.clone() for k, v in sim.server["params"].items()}
    seen, steps = set(), set()
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w)
        seen |= set(cohort)
        steps |= {len(steps_of(d)) for d in clients}
        w = qffl_reference_step(w, clients, q)
        sim.run_round(t)
        assert_close(sim.server["params"], w)
    assert len(seen) > len(cohort) and len(steps) > 1  # partial participation, ragged work

    # every client, trained or not, predicts with the global model; join changes nothing
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = clients[0].x
    for i in (cohort[0], sim.exp.data.num_clients - 1):
        state = sim.store.get(i) if i in seen else sim.init_state(i, downlink, ctx)
        joined = sim.algorithm.join(downlink, state, clients[0], ctx)
        assert joined == state == {}
        torch.testing.assert_close(
            sim.algorithm.predict(downlink, joined, x), logits(w, x), rtol=1e-10, atol=1e-12
        )


def test_qffl_with_q_zero_is_fedavg():
    sims = {
        name: Simulation(ragged_experiment(name, **EPOCHS, **extra), None)
        for name, extra in (("fedavg", {}), ("qffl", {"options": {"q": 0.0}}))
    }
    for t in range(3):
        for sim in sims.values():
            sim.run_round(t)
    assert_close(sims["qffl"].server["params"], sims["fedavg"].server["params"])


def test_bad_q_is_a_one_line_error():
    with pytest.raises(ConfigError, match="q=-1"):
        ragged_experiment("qffl", options={"q": -1.0})

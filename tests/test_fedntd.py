"""FedNTD against a hand-written float64 reference on ragged clients.

The reference uses only torch autograd on the MLP written out by hand (``test_classic``'s
``logits`` / ``descend``) and the paper's loss written sample by sample: for each sample the
softmax at temperature tau over the classes other than its label, of the local and of the
received global model, their KL divergence, and CE + beta tau^2 times its batch mean; the server
averages the local models by N_i. Half of the clients take part in each round.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_classic import EPOCHS, assert_close, descend, logits, round_inputs, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

C = 4  # classes of the ragged dataset
TAU, BETA = 2.0, 0.7


def ntd_loss(teacher: dict, tau: float, beta: float):
    def loss(p, x, y):
        z, z_g = logits(p, x), logits(teacher, x).detach()
        kls = []
        for s, label in enumerate(y.tolist()):
            others = [c for c in range(C) if c != label]
            q = torch.exp(z[s, others] / tau) / torch.exp(z[s, others] / tau).sum()
            q_g = torch.exp(z_g[s, others] / tau) / torch.exp(z_g[s, others] / tau).sum()
            kls.append((q_g * (q_g.log() - q.log())).sum())
        return F.cross_entropy(z, y) + beta * tau**2 * sum(kls) / len(kls)

    return loss


def test_fedntd_rounds_equal_the_papers_local_loss_and_averaging():
    options = {"tau": TAU, "beta": BETA}
    sim = Simulation(ragged_experiment("fedntd", options=options, **EPOCHS), None)
    w = {k: v.clone() for k, v in sim.server["params"].items()}
    seen = set()
    for t in range(3):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w)
        seen |= set(cohort)
        trained = [descend(w, ntd_loss(w, TAU, BETA), steps_of(d)) for d in clients]
        sizes = [float(len(d.y)) for d in clients]
        w = {k: sum(n * m[k] for n, m in zip(sizes, trained, strict=True)) / sum(sizes) for k in w}
        sim.run_round(t)
        assert_close(sim.server["params"], w)
    assert len(seen) > len(cohort)  # partial participation

    # every client predicts with the global model; join changes nothing
    ctx = sim.context(3)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = clients[0].x
    newcomer = sim.init_state(sim.exp.data.num_clients, downlink, ctx)
    joined = sim.algorithm.join(downlink, newcomer, clients[0], ctx)
    assert joined == newcomer == {}
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, joined, x), logits(w, x), rtol=1e-10, atol=1e-12
    )


def test_fedntd_with_beta_zero_is_fedavg():
    sims = {
        name: Simulation(ragged_experiment(name, **EPOCHS, **extra), None)
        for name, extra in (("fedavg", {}), ("fedntd", {"options": {"beta": 0.0}}))
    }
    for t in range(2):
        for sim in sims.values():
            sim.run_round(t)
    assert_close(sims["fedntd"].server["params"], sims["fedavg"].server["params"])


@pytest.mark.parametrize("options", [{"tau": 0.0}, {"beta": -1.0}])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("fedntd", options=options)

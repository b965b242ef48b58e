"""IFCA against a hand-written float64 reference on ragged clients.

The reference uses only torch autograd on the MLP written out by hand (``test_classic``'s
``logits`` / ``ce`` / ``descend``) and plain loops over Algorithm 1 (model averaging): each
sampled client's losses under the k cluster models on its training split, its local steps from
the model of lowest loss, and each cluster's N_i-weighted average over the clients that chose it
(a cluster nobody chose keeps its model). Half of the clients take part in each round.
"""

from __future__ import annotations

import pytest
import torch
from test_classic import EPOCHS, assert_close, ce, descend, logits, round_inputs, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

K = 3


def best_cluster(models: list[dict], data) -> int:
    losses = [float(ce(m, data.x, data.y)) for m in models]
    return losses.index(min(losses))


def test_ifca_rounds_equal_the_papers_clustered_model_averaging():
    sim = Simulation(ragged_experiment("ifca", options={"clusters": K}, **EPOCHS), None)
    stacked = sim.server["params"]
    models = [{k: v[j].clone() for k, v in stacked.items()} for j in range(K)]
    assert not torch.equal(models[0]["head.weight"], models[1]["head.weight"])
    identity: dict[int, int] = {}
    shared, idle = False, False
    for t in range(4):
        cohort, _, clients = round_inputs(sim, t)
        chosen = {}
        for i, data in zip(cohort, clients, strict=True):
            j = best_cluster(models, data)
            trained = descend(models[j], ce, steps_of(data))
            chosen.setdefault(j, []).append((float(len(data.y)), trained))
            identity[i] = j
        shared |= len(chosen) > 1
        idle |= len(chosen) < K
        for j, members in chosen.items():
            total = sum(n for n, _ in members)
            models[j] = {k: sum(n * m[k] for n, m in members) / total for k in models[j]}
        sim.run_round(t)
        assert_close(
            {k: v for k, v in sim.server["params"].items()},
            {k: torch.stack([m[k] for m in models]) for k in models[0]},
        )
        for i in cohort:
            expected = torch.zeros(K, dtype=torch.float64)
            expected[identity[i]] = 1
            assert torch.equal(sim.store.get(i)["ifca.identity"], expected)
    assert shared and idle  # clients split between clusters, and some cluster sat a round out

    # prediction: the stored identity before adapt; adapt and join re-estimate it on the
    # training split under the current models
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    algorithm, exact = sim.algorithm, {"rtol": 1e-10, "atol": 1e-12}
    for i, data in zip(cohort, clients, strict=True):
        state = sim.store.get(i)
        torch.testing.assert_close(
            algorithm.predict(downlink, state, data.x), logits(models[identity[i]], data.x), **exact
        )
        adapted = algorithm.adapt(downlink, state, data, ctx)
        best = models[best_cluster(models, data)]
        torch.testing.assert_close(
            algorithm.predict(downlink, adapted, data.x), logits(best, data.x), **exact
        )
    newcomer = sim.init_state(sim.exp.data.num_clients, downlink, ctx)
    data = next(d for d in clients if best_cluster(models, d) != 0)
    torch.testing.assert_close(
        algorithm.predict(downlink, newcomer, data.x), logits(models[0], data.x), **exact
    )
    joined = algorithm.join(downlink, newcomer, data, ctx)
    torch.testing.assert_close(
        algorithm.predict(downlink, joined, data.x),
        logits(models[best_cluster(models, data)], data.x),
        **exact,
    )


def test_ifca_with_one_cluster_is_fedavg():
    sims = {
        name: Simulation(ragged_experiment(name, **EPOCHS, **extra), None)
        for name, extra in (("fedavg", {}), ("ifca", {"options": {"clusters": 1}}))
    }
    for t in range(3):
        for sim in sims.values():
            sim.run_round(t)
    one = {k: v[0] for k, v in sims["ifca"].server["params"].items()}
    assert_close(one, sims["fedavg"].server["params"])


def test_bad_cluster_count_is_a_one_line_error():
    with pytest.raises(ConfigError, match="clusters=0"):
        ragged_experiment("ifca", options={"clusters": 0})

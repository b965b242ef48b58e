"""D-FedEM and its graphs: mixing matrices, consensus, and FedEM as the complete-graph case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, tiny_experiment

from pflego import graphs
from pflego.config import load_config
from pflego.data import ArrayDataset, register
from pflego.errors import ConfigError
from pflego.sim import Simulation, build_experiment


def slem(weights: np.ndarray) -> float:
    """Second largest eigenvalue modulus of a symmetric stochastic matrix (0 for one client)."""
    eig = torch.linalg.eigvalsh(torch.from_numpy(np.asarray(weights, dtype=np.float64))).numpy()
    return float(max(abs(eig[0]), abs(eig[-2]))) if len(eig) > 1 else 0.0


@register("tiny-equal", "mlp", False, "six natural clients of 40 samples each (tests only)")
def load_tiny_equal(root: Path, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(240, 1, 4, 4)).astype(np.float32)
    y = (x.reshape(240, -1)[:, :4].argmax(1)).astype(np.int64)
    return ArrayDataset("tiny-equal", x, y, None, None, 4, groups_train=np.repeat(np.arange(6), 40))


@pytest.mark.parametrize("graph", graphs.GRAPHS)
@pytest.mark.parametrize("mixing", graphs.MIXINGS)
def test_mixing_matrices_are_symmetric_doubly_stochastic_and_local(graph, mixing):
    members = (0, 2, 3, 5, 6, 7, 9, 11)  # a cohort: only links among its members are used
    w = graphs.mixing_matrix(graph, mixing, 12, 0.5, (1,), members)
    adj = graphs.adjacency(graph, 12, 0.5, np.random.default_rng([1]))[np.ix_(members, members)]
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    np.testing.assert_allclose(w.sum(0), 1, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)
    assert w.min() >= -1e-12
    off_graph = ~adj & ~np.eye(len(members), dtype=bool)
    assert np.all(w[off_graph] == 0)


def test_fast_mixing_is_at_least_as_fast_as_metropolis_hastings():
    for graph in ("erdos-renyi", "ring"):
        adj = graphs.adjacency(graph, 16, 0.3, np.random.default_rng(0))
        fast = slem(graphs.fastest_mixing(adj))
        assert fast <= slem(graphs.metropolis_hastings(adj)) + 1e-12
    adj = graphs.adjacency("erdos-renyi", 16, 0.3, np.random.default_rng(0))
    assert slem(graphs.fastest_mixing(adj)) < 0.9 * slem(graphs.metropolis_hastings(adj))


@pytest.mark.parametrize("mixing", graphs.MIXINGS)
def test_consensus_distance_shrinks_on_a_connected_graph(mixing):
    sim = Simulation(
        tiny_experiment(
            algorithm="d-fedem", participation=1.0, options={"graph": "ring", "mixing": mixing}
        ),
        None,
    )
    algorithm, ctx = sim.algorithm, sim.context(0)
    clients = torch.arange(6)
    gen = torch.Generator().manual_seed(0)
    states = {
        k: torch.randn(6, *v.shape, generator=gen, dtype=v.dtype)
        for k, v in sim.server["params"].items()
    }
    rate = slem(algorithm.mixing_weights(ctx, clients).numpy())
    assert rate < 1  # a ring is connected
    distance = graphs.consensus_distance(states)
    for _ in range(5):
        _, states = algorithm.mix(sim.server, states, ctx, clients)
        new = graphs.consensus_distance(states)
        assert new <= rate**2 * distance * (1 + 1e-9)
        distance = new
    record = sim.evaluate(0)
    assert record["consensus_distance"] < 1e-25  # every client starts from the same components


def test_complete_graph_with_uniform_weights_is_fedem_with_full_participation():
    settings = {**TINY, "dataset": "tiny-equal", "partition": "natural", "participation": 1.0}
    fedem = Simulation(build_experiment(load_config({**settings, "algorithm": "fedem"})), None)
    options = {"graph": "complete", "mixing": "metropolis"}
    dfedem = Simulation(
        build_experiment(load_config({**settings, "algorithm": "d-fedem", "options": options})),
        None,
    )
    assert len(set(fedem.exp.data.train_sizes.tolist())) == 1
    for t in range(3):
        fedem.run_round(t)
        dfedem.run_round(t)
    states = dfedem.store.tensors
    for k, v in fedem.server["params"].items():
        for i in range(6):  # every client holds FedEM's server components
            torch.testing.assert_close(states[k][i], v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        states["mixture.weights"], fedem.store.tensors["mixture.weights"], rtol=1e-10, atol=1e-12
    )
    a, b = fedem.evaluate(3), dfedem.evaluate(3)
    assert a["test_acc"] == pytest.approx(b["test_acc"])
    assert b["consensus_distance"] < 1e-20


def test_new_clients_join_from_the_networks_average_components():
    sim = Simulation(tiny_experiment(algorithm="d-fedem", unseen_fraction=0.34), None)
    sim.run_round(0)
    record = sim.evaluate(1)
    assert 0 <= record["unseen_test_acc"] <= 1
    cohort = sim.cohort(0)
    for k, v in sim.server["params"].items():
        torch.testing.assert_close(v, sim.store.tensors[k][cohort].mean(0))


def test_join_against_a_written_out_e_step_on_the_networks_components():
    """A new client keeps the network's average components and runs join_em_steps = 2 E-steps
    from uniform weights on its real samples (float64 reference with the MLP written out; the
    unseen clients differ in size, so one of them carries padding that must not count)."""
    from test_baselines import logits
    from test_fedem import reference_join

    sim = Simulation(
        tiny_experiment(algorithm="d-fedem", unseen_fraction=0.34, options={"join_em_steps": 2}),
        None,
    )
    sim.run_round(0)
    ctx = sim.context(1)
    payload = sim.algorithm.downlink(sim.server, ctx)
    unseen = sim.exp.unseen
    assert len(set(unseen.train_sizes.tolist())) == unseen.num_clients == 2
    inputs = sim.personalization(1, unseen=True).inputs(np.arange(2))
    for c in range(2):
        one = torch.utils._pytree.tree_map(lambda t, c=c: t[c], inputs)
        state = sim.init_state(sim.exp.data.num_clients + c, payload, ctx)
        joined = sim.algorithm.join(payload, state, one, ctx)
        components = sim.server["params"]  # the average of the active clients' components
        for k, v in components.items():
            assert torch.equal(joined[k], v)
        real = one.mask > 0
        assert int(real.sum()) == int(unseen.train_sizes[c])
        x, y = one.x[real], one.y[real]
        stacked = torch.stack(
            [logits({k: v[m] for k, v in components.items()}, x) for m in range(3)]
        )
        torch.testing.assert_close(
            joined["mixture.weights"], reference_join(stacked, y, 2), rtol=1e-10, atol=1e-12
        )


def test_flower_refuses_decentralized_algorithms():
    pytest.importorskip("flwr")
    from pflego.flower.unsupported import refuse_unsupported

    with pytest.raises(ConfigError, match="peer to peer"):
        refuse_unsupported(tiny_experiment(algorithm="d-fedem").config)
    refuse_unsupported(tiny_experiment(algorithm="fedem").config)

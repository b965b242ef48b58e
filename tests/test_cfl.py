"""Clustered FL: the bipartition, splitting two opposite tasks apart and never an IID
population, the cluster-wise averaging, and a newcomer picking its cluster."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego.algorithms.cfl import bipartition
from pflego.data import ArrayDataset
from pflego.data.federated import from_parts
from pflego.sim import Simulation
from pflego.types import ClientOut

CLIENTS, SAMPLES = 8, 150


def test_bipartition_separates_two_blocks():
    sim = np.full((6, 6), -0.8)
    for block in ([0, 2, 5], [1, 3, 4]):
        sim[np.ix_(block, block)] = 0.9
    for linkage in ("complete", "single"):
        moved = bipartition(sim, linkage)
        assert moved.tolist() == [False, True, False, True, True, False]  # member 0 stays


@pytest.mark.parametrize("seed", range(20))
def test_single_linkage_minimizes_the_largest_cross_similarity(seed):
    """The paper's argmin over bipartitions of the largest cross-cluster similarity, by brute force."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 8))
    vectors = rng.normal(size=(n, 3))
    sim = vectors @ vectors.T / np.outer(*[np.linalg.norm(vectors, axis=1)] * 2)
    best = min(
        sim[np.ix_(part, np.setdiff1d(np.arange(n), part))].max()
        for size in range(1, n)
        for part in map(list, itertools.combinations(range(n), size))
    )
    moved = bipartition(sim, "single")
    assert 0 < moved.sum() < n
    assert sim[np.ix_(moved, ~moved)].max() == pytest.approx(best)


def population(opposite: bool, seed: int = 0):
    """Eight clients with 150 samples each of the tiny task (class = argmax of the first four
    inputs, 10% label noise); with ``opposite``, clients 4..7 have every label shifted by two."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(CLIENTS * 2 * SAMPLES, 1, 4, 4)).astype(np.float32)
    y = x.reshape(len(x), -1)[:, :4].argmax(1)
    owner = np.repeat(np.arange(CLIENTS), 2 * SAMPLES)
    if opposite:
        y = np.where(owner >= CLIENTS // 2, (y + 2) % 4, y)
    y = np.where(rng.random(len(y)) < 0.1, rng.integers(0, 4, len(y)), y)
    raw = ArrayDataset("opposite" if opposite else "iid", x, y.astype(np.int64), None, None, 4)
    starts = np.arange(CLIENTS) * 2 * SAMPLES
    train = [np.arange(s, s + SAMPLES) for s in starts]
    test = [np.arange(s + SAMPLES, s + 2 * SAMPLES) for s in starts]
    return from_parts(raw, train, test)


def clustered_run(opposite: bool, rounds: int) -> Simulation:
    """CFL at the paper's eps_1 = 0.4, eps_2 = 1.6, every client every round (as the paper)."""
    exp = tiny_experiment(
        algorithm="cfl",
        model="linear",
        clients=CLIENTS,
        participation=1.0,
        inner_steps=20,
        client_lr=0.5,
    )
    exp.data = population(opposite)
    sim = Simulation(exp, None)
    for t in range(rounds):
        sim.run_round(t)
    return sim


def test_two_opposite_tasks_split_into_their_two_clusters_and_a_newcomer_finds_its_own():
    sim = clustered_run(opposite=True, rounds=8)
    membership = sim.server["membership"]["cluster"].tolist()
    assert membership == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sim.server["params"]["head.weight"].shape[0] == 2
    assert sim.evaluate(8)["test_acc"] > 0.7  # one global model would serve neither task
    ctx = sim.context(8)
    payload = sim.algorithm.downlink(sim.server, ctx)
    for client, cluster in ((1, 0), (6, 1)):  # the training data of a client of either task
        data = sim.round_inputs(8, np.array([client])).client(0)
        chosen = sim.algorithm.join(payload, {}, data, ctx)
        for k, v in sim.server["params"].items():
            assert torch.equal(chosen["model." + k], v[cluster])


def test_an_iid_population_never_splits():
    sim = clustered_run(opposite=False, rounds=12)
    assert sim.server["membership"]["cluster"].tolist() == [0] * CLIENTS
    assert sim.server["params"]["head.weight"].shape[0] == 1


def test_each_cluster_averages_only_its_members_updates():
    sim = Simulation(tiny_experiment(algorithm="cfl", model="linear"), None)
    algorithm, ctx = sim.algorithm, sim.context(0)
    base = {k: v[0] for k, v in sim.server["params"].items()}
    server = {
        "params": {k: torch.stack([v, v + 1.0]) for k, v in base.items()},
        "membership": {"cluster": torch.tensor([0, 1, 1, 0, 0, 1])},
    }
    down = algorithm.downlink(server, ctx, torch.tensor([2, 3]))
    assert torch.equal(down["head.bias"][0], base["head.bias"] + 1.0)
    assert torch.equal(down["head.bias"][1], base["head.bias"])
    cohort = torch.tensor([1, 2, 3])  # clusters 1, 1, 0
    uploads = {
        k: torch.stack([torch.full_like(v, c) for c in (0.1, 0.4, 0.2)]) for k, v in base.items()
    }
    out = ClientOut(uploads, torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64), {})
    new = algorithm.server_round(server, out, ctx, cohort)
    for k, v in base.items():
        torch.testing.assert_close(new["params"][k][0], v - 0.2)
        torch.testing.assert_close(new["params"][k][1], v + 1.0 - (0.1 * 1 + 0.4 * 3) / 4)
    assert new["membership"]["cluster"].tolist() == [0, 1, 1, 0, 0, 1]


def test_a_split_moves_the_smaller_part_and_absent_members_stay():
    sim = Simulation(tiny_experiment(algorithm="cfl", model="linear"), None)
    algorithm, ctx = sim.algorithm, sim.context(0)
    server = algorithm.init_server({k: v[0] for k, v in sim.server["params"].items()})
    base = server["params"]
    direction = {k: torch.ones_like(v[0]) for k, v in base.items()}
    # Clients 0, 1, 2 pull one way, 4 the other: the mean is small, each update large.
    signs = torch.tensor([1.0, 1.0, 1.0, -3.0], dtype=torch.float64)
    uploads = {k: signs.reshape(-1, *[1] * v.dim()) * v for k, v in direction.items()}
    out = ClientOut(uploads, torch.ones(4, dtype=torch.float64), {})
    new = algorithm.server_round(server, out, ctx, torch.tensor([0, 1, 2, 4]))
    assert new["membership"]["cluster"].tolist() == [0, 0, 0, 0, 1, 0]  # 3 and 5 did not answer
    for k, v in base.items():
        torch.testing.assert_close(new["params"][k][0], v[0] - direction[k])
        torch.testing.assert_close(new["params"][k][1], v[0] + 3 * direction[k])


@pytest.mark.parametrize("largest_update, splits", [("norm", True), ("coordinate", False)])
def test_the_split_test_takes_the_largest_norm_or_as_fedem_code_the_largest_coordinate(
    largest_update, splits
):
    """Updates of norm 0.5 * sqrt(68) > eps_2 = 1.6 whose coordinates are all below 1.6."""
    exp = tiny_experiment(
        algorithm="cfl", model="linear", options={"largest_update": largest_update}
    )
    sim = Simulation(exp, None)
    algorithm, ctx = sim.algorithm, sim.context(0)
    server = algorithm.init_server({k: v[0] for k, v in sim.server["params"].items()})
    signs = torch.tensor([0.5, 0.5, 0.5, -1.5], dtype=torch.float64)
    uploads = {
        k: signs.reshape(-1, *[1] * (v.dim() - 1)) * torch.ones_like(v[0])
        for k, v in server["params"].items()
    }
    out = ClientOut(uploads, torch.ones(4, dtype=torch.float64), {})
    new = algorithm.server_round(server, out, ctx, torch.tensor([0, 1, 2, 3]))
    assert (new["membership"]["cluster"].tolist()[:4] == [0, 0, 0, 1]) == splits
    assert new["params"]["head.weight"].shape[0] == (2 if splits else 1)


def planar_updates(server, vectors: list[tuple[float, float]]) -> dict:
    """Uploads whose only non-zero entries are head.bias[0:2] = each 2-d vector."""
    uploads = {k: torch.zeros(len(vectors), *v.shape[1:], dtype=v.dtype) for k, v in server.items()}
    uploads["head.bias"][:, :2] = torch.tensor(vectors, dtype=uploads["head.bias"].dtype)
    return uploads


def test_the_split_is_the_complete_linkage_bipartition_not_the_single_linkage_one():
    """Six directions at 0, 24, 55, 90, 122 and 175 degrees (times 2): complete linkage splits
    {0, 24, 55} from {90, 122, 175}; single linkage would chain the first five and split off the
    last one alone. The gaps differ (24, 31, 35, 32, 53 degrees) so that no merge is decided by a
    tie that rounding could break either way (equal gaps split differently on another machine)."""
    exp = tiny_experiment(algorithm="cfl", model="linear", options={"eps1": 5.0, "eps2": 1.0})
    sim = Simulation(exp, None)
    algorithm, ctx = sim.algorithm, sim.context(0)
    server = algorithm.init_server({k: v[0] for k, v in sim.server["params"].items()})
    angles = np.radians([0, 24, 55, 90, 122, 175])
    vectors = [(2 * np.cos(a), 2 * np.sin(a)) for a in angles]
    out = ClientOut(
        planar_updates(server["params"], vectors), torch.ones(6, dtype=torch.float64), {}
    )
    new = algorithm.server_round(server, out, ctx, torch.arange(6))
    assert new["membership"]["cluster"].tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("seed", range(10))
def test_complete_linkage_bipartition_matches_scipy(seed):
    """bipartition's default against scipy's complete-linkage clustering of the distances
    1 - similarity, cut at two clusters (random vectors: no ties)."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    vectors = rng.normal(size=(n, 4))
    sim = vectors @ vectors.T / np.outer(*[np.linalg.norm(vectors, axis=1)] * 2)
    labels = fcluster(linkage(squareform(1 - sim, checks=False), "complete"), 2, "maxclust")
    expected = {frozenset(np.flatnonzero(labels == c).tolist()) for c in (1, 2)}
    moved = bipartition(sim)
    assert {
        frozenset(np.flatnonzero(moved).tolist()),
        frozenset(np.flatnonzero(~moved).tolist()),
    } == expected


def test_the_split_test_weights_the_mean_update_by_the_clients_sizes():
    """Updates 3e (N = 1) and -e (N = 3): the N-weighted mean is 0 < eps_1 and the largest norm
    3 > eps_2, so the cluster splits; the unweighted mean (norm 1 > eps_1 = 0.4) would not."""
    sim = Simulation(tiny_experiment(algorithm="cfl", model="linear"), None)
    algorithm, ctx = sim.algorithm, sim.context(0)
    server = algorithm.init_server({k: v[0] for k, v in sim.server["params"].items()})
    uploads = planar_updates(server["params"], [(3.0, 0.0), (-1.0, 0.0)])
    out = ClientOut(uploads, torch.tensor([1.0, 3.0], dtype=torch.float64), {})
    new = algorithm.server_round(server, out, ctx, torch.tensor([2, 4]))
    assert new["membership"]["cluster"].tolist() == [0, 0, 0, 0, 1, 0]
    for k, v in server["params"].items():  # each part takes its own update
        torch.testing.assert_close(new["params"][k][0], v[0] - uploads[k][0])
        torch.testing.assert_close(new["params"][k][1], v[0] - uploads[k][1])

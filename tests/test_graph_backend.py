"""The ``graph`` backend: vmap over static shapes, CUDA graphs on a GPU, no host synchronization."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_fast_sim import SIZES, assert_trees_close, ragged_experiment

from pflego.algorithms import ALGORITHMS
from pflego.algorithms.fedavg import FedAvg
from pflego.sim import Simulation, metrics
from pflego.sim.backends import VmapBackend, make_backend, resolve_backend
from pflego.sim.backends_auto import candidates
from pflego.sim.backends_graph import (
    ROUND_READ,
    GraphExecutor,
    HostSyncError,
    bucket,
    no_host_sync,
    static_inputs,
)

#: The registered methods the executor runs as plain vmap, and why (docs/gpu.md lists them).
FALLS_BACK = dict.fromkeys(["apple", "fedap", "fedfed", "fedgen", "pfedsim"], ROUND_READ)
#: Five of the six ragged clients a round (padded to 6), minibatches of 4 over one and a half
#: epochs: 1 to 6 steps a client (padded to a static count), 3 to 14 samples (padded to 16 or 12).
RAGGED = {"participation": 0.84, "batch_size": 4, "local_epochs": 1.5}
#: Options that keep a method's two rounds short (FedALA's first weight learning: 50 epochs).
SHORT = {"fedala": {"max_start_epochs": 2}}


def recorded(sim: Simulation) -> list:
    """The outputs of ``sim``'s backend, round by round, as its rounds call it."""
    log, backend = [], sim.backend

    def run(*args):
        out = backend(*args)
        log.append(out)
        return out

    sim.backend = run
    return log


def two_rounds(name: str, backend: str, **settings) -> tuple[Simulation, list]:
    options = {"options": SHORT[name]} if name in SHORT else {}
    sim = Simulation(ragged_experiment(name, backend=backend, **settings, **options), None)
    executor = sim.backend
    log = recorded(sim)
    for t in range(2):
        sim.run_round(t)
    sim.executor = executor
    return sim, log


def assert_same_rounds(a: tuple[Simulation, list], b: tuple[Simulation, list]) -> None:
    for (out_a, st_a), (out_b, st_b) in zip(a[1], b[1], strict=True):
        assert_trees_close(out_a.upload, out_b.upload)
        assert_trees_close(out_a.metrics, out_b.metrics)
        torch.testing.assert_close(out_a.weight, out_b.weight, atol=1e-12, rtol=0)
        assert_trees_close(st_a, st_b)
    assert_trees_close(a[0].server["params"], b[0].server["params"])


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - set(FALLS_BACK)))
def test_graph_equals_loop(name: str) -> None:
    """Every method the executor supports gives the loop's numbers over padded static shapes,
    and its update passed the no-host-synchronization check a capture runs under."""
    graph = two_rounds(name, "graph", **RAGGED)
    assert graph[0].backend_name == "graph" and isinstance(graph[0].executor, VmapBackend)
    executor = graph[0].executor.graphs
    assert executor.fallbacks == {} and executor.checked == {name}
    graph[0].backend = graph[0].executor
    assert "graph_fallbacks" not in graph[0].profile_summary()
    assert {len(clients) for clients in map(graph[0].cohort, range(2))} == {5}  # 6 with padding
    assert_same_rounds(two_rounds(name, "loop", **RAGGED), graph)


@pytest.mark.parametrize("name", ["fedavg", "pflego", "pgfed", "perfedavg"])
def test_graph_equals_loop_full_batch(name: str) -> None:
    """A full batch stays one (its width padded with the samples): the loop's numbers."""
    settings = {"participation": 0.84, "inner_steps": 3}
    graph = two_rounds(name, "graph", **settings)
    assert graph[0].executor.graphs.checked == {name}
    assert_same_rounds(two_rounds(name, "loop", **settings), graph)


@pytest.mark.parametrize("name", sorted(FALLS_BACK))
def test_methods_the_executor_cannot_capture_run_as_vmap(name: str) -> None:
    graph = two_rounds(name, "graph", **RAGGED)
    assert graph[0].executor.graphs.fallbacks == {name: FALLS_BACK[name]}
    graph[0].backend = graph[0].executor  # as the run holds it (the test's recorder aside)
    assert graph[0].profile_summary()["graph_fallbacks"] == {name: FALLS_BACK[name]}
    assert_same_rounds(two_rounds(name, "loop", **RAGGED), graph)


def test_bucket_sizes_are_few() -> None:
    assert [bucket(n) for n in range(10)] == [0, 1, 2, 3, 4, 6, 6, 8, 8, 12]
    assert [bucket(n) for n in (13, 16, 17, 25, 900, 1000)] == [16, 16, 24, 32, 1024, 1024]
    assert len({bucket(n) for n in range(1, 1001)}) == 20


def test_static_inputs_pad_clients_samples_and_steps() -> None:
    sim = Simulation(ragged_experiment("fedavg", **RAGGED), None)
    ctx, cohort = sim.context(0), sim.cohort(0)
    downlink = sim.downlink(ctx, cohort)
    data = sim.round_inputs(0, cohort).data
    states = {"w": torch.arange(5.0)}
    dl, st, padded = static_inputs(downlink, states, data, per_client=False)
    steps = bucket(data.batches.shape[1])
    assert dl is downlink and st["w"].tolist() == [0, 1, 2, 3, 4, 0]
    assert padded.x.shape[:2] == (6, bucket(data.x.shape[1]))
    assert padded.batches.shape == padded.batch_mask.shape == (6, steps, 4)
    assert padded.batch_mask[5].sum() == 0  # the padding client trains nothing
    extra = steps - data.batches.shape[1]
    assert padded.batch_mask[:5, :extra].sum() == 0  # padding steps come first
    assert torch.equal(padded.batch_mask[:5, extra:], data.batch_mask)
    assert torch.equal(padded.x[:5, : data.x.shape[1]], data.x)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: bool(t.sum() > 0),
        lambda t: float(t.sum()),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: np.asarray(t),
        lambda t: t.cpu(),
        lambda t: torch.tensor([1.0, 2.0]),
        lambda t: torch.as_tensor(np.ones(2)),
    ],
)
def test_no_host_sync_refuses_every_read_of_a_tensor_on_the_host(read) -> None:
    t = torch.ones(3)
    read(t)  # fine outside
    with pytest.raises(HostSyncError), no_host_sync():
        read(t)
    read(t)  # and fine again after


@dataclass(frozen=True)
class BranchesOnTheDownlink(FedAvg):
    """FedAvg that reads a shared value on the host inside its update (a Python branch)."""

    def client_update(self, downlink, state, data, ctx):
        first = next(iter(downlink.values()))
        if first.abs().sum() > 0:  # host synchronization: bool(tensor)
            return super().client_update(downlink, state, data, ctx)
        return super().client_update(downlink, state, data, ctx)


def test_an_update_that_waits_for_the_host_falls_back_to_vmap() -> None:
    sim = Simulation(ragged_experiment("fedavg", **RAGGED), None)
    algorithm = BranchesOnTheDownlink(model=sim.algorithm.model)
    ctx, cohort = sim.context(0), sim.cohort(0)
    downlink = sim.downlink(ctx, cohort)
    states = sim.states(cohort, downlink, ctx)
    inputs = sim.round_inputs(0, cohort)
    backend = make_backend("graph", algorithm)
    out, new_states = backend(algorithm, downlink, states, inputs, ctx)
    (reason,) = backend.graphs.fallbacks.values()
    assert reason.startswith("host synchronization: aten::_local_scalar_dense")
    expected = VmapBackend()(algorithm, downlink, states, inputs, ctx)
    assert_trees_close(out.upload, expected[0].upload)
    assert_trees_close(new_states, expected[1])


def test_auto_chooses_graph_on_cuda_and_keeps_its_cpu_choice() -> None:
    algorithm = ragged_experiment("fedavg").algorithm
    assert resolve_backend("auto", "cuda", lambda: True) == "graph"
    assert resolve_backend("auto", "cpu", lambda: True) == "fused"
    assert resolve_backend("auto", "cpu", lambda: False) == "vmap"
    assert candidates(algorithm, torch.device("cuda")) == ["graph", "vmap", "loop"]
    assert candidates(algorithm, torch.device("cpu")) == ["fused", "vmap"]
    backend = make_backend("graph", algorithm)
    assert isinstance(backend.graphs, GraphExecutor)
    assert make_backend("graph", algorithm).graphs is not backend.graphs  # one a run


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
@pytest.mark.parametrize("name", ["fedavg", "pflego", "pgfed", "ditto", "fedem"])
def test_replayed_cuda_graph_equals_eager_vmap(name: str) -> None:
    """On a GPU, each round's update is a replayed CUDA graph with vmap's numbers."""
    graph = two_rounds(name, "graph", device="cuda", **RAGGED)
    executor = graph[0].executor.graphs
    assert executor.fallbacks == {} and executor.graphs
    assert all(key[1][0][2].type == "cuda" for key in executor.graphs)
    vmap = two_rounds(name, "vmap", device="cuda", **RAGGED)
    assert_same_rounds(vmap, graph)


@CUDA
def test_a_cuda_graph_is_captured_once_per_shape_and_replayed() -> None:
    sim = Simulation(ragged_experiment("fedavg", backend="graph", device="cuda"), None)
    executor = sim.backend.graphs
    captured = []
    for t in range(6):
        sim.run_round(t)
        captured.append(len(executor.graphs))
    assert executor.fallbacks == {}
    assert captured == [1, 2, 2, 2, 2, 2]  # two shapes (sizes 3..14 padded), replayed after


def test_evaluation_reads_its_columns_back_in_one_transfer(monkeypatch) -> None:
    """Every chunk, split and view stays on the device until one copy to the host at the end."""
    sim = Simulation(ragged_experiment("fedper"), None)
    ctx = sim.context(0)
    ids = np.arange(len(SIZES))
    downlink = sim.downlink(ctx, ids, True)
    states = sim.states(ids, downlink, ctx)
    copies, cpu = [], torch.Tensor.cpu

    def counted(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        copies.append(tensor.shape)
        return cpu(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    columns = metrics.evaluate_clients(
        sim.algorithm, lambda ids: downlink, states, sim.pools, chunk_size=2
    )
    monkeypatch.undo()
    assert len(copies) == 1 and len(columns) == 2 * len(sim.pools)
    whole = metrics.evaluate_clients(sim.algorithm, lambda ids: downlink, states, sim.pools)
    assert whole.keys() == columns.keys()
    for name, column in columns.items():  # three chunks or one: the same columns
        np.testing.assert_allclose(column, whole[name], rtol=1e-12, equal_nan=True)

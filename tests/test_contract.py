"""The contract every registered algorithm keeps (parametrized over the registry)."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego.algorithms import ALGORITHMS
from pflego.sim import Simulation
from pflego.sim.clients import client_data, client_schedules
from pflego.types import Schedule

NAMES = sorted(ALGORITHMS)


def first_client_inputs(sim: Simulation):
    ctx = sim.context(0)
    i = int(sim.cohort(0)[0])
    down = sim.one_downlink(sim.downlink(ctx, np.array([i])), i, position=0)
    n = int(sim.exp.data.train_sizes[i])
    run = Schedule(3)
    batches, named = client_schedules(
        n, run, sim.algorithm.schedules(run), lambda stream: np.random.default_rng(stream)
    )
    space, validation = sim.algorithm.label_space, sim.algorithm.uses_validation
    data = client_data(sim.exp.data, i, space, batches, torch.float64, named, validation)
    return down, sim.init_state(i, down, ctx), data, ctx


@pytest.mark.parametrize("name", NAMES)
def test_client_update_does_not_mutate_its_inputs(name):
    sim = Simulation(tiny_experiment(algorithm=name), None)
    down, state, data, ctx = first_client_inputs(sim)
    copies = copy.deepcopy((down, state, data))
    sim.algorithm.client_update(down, state, data, ctx)
    for before, after in zip(copies, (down, state, data), strict=True):
        for a, b in zip(
            torch.utils._pytree.tree_leaves(before),
            torch.utils._pytree.tree_leaves(after),
            strict=True,
        ):
            assert torch.equal(a, b)


def trained(name: str, rounds: int = 2, **settings) -> Simulation:
    sim = Simulation(tiny_experiment(algorithm=name, **settings), None)
    for t in range(rounds):
        sim.run_round(t)
    return sim


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in tensors.values()])


@pytest.mark.parametrize("name", NAMES)
def test_runs_are_deterministic_under_a_seed(name):
    sims = [trained(name) for _ in range(2)]
    for k, v in sims[0].server["params"].items():
        assert torch.equal(v, sims[1].server["params"][k])
    assert sims[0].store.tensors.keys() == sims[1].store.tensors.keys()
    for k, v in sims[0].store.tensors.items():
        assert torch.equal(v, sims[1].store.tensors[k])

    # ... and the runs did something that the seed decides: training moved the model (the shared
    # parameters, or the clients' states for methods that share nothing), and another seed
    # (another initialization and cohort) gives other numbers.
    def everything(sim: Simulation) -> torch.Tensor:
        everyone = np.arange(sim.exp.data.num_clients)  # unvisited clients: first-visit states
        sim.initialize(everyone, sim.downlink(sim.context(2), everyone), sim.context(2))
        return flat({**sim.server["params"], **sim.store.tensors})

    assert not torch.equal(everything(sims[0]), everything(trained(name, rounds=0)))
    assert not torch.equal(everything(sims[0]), everything(trained(name, seed=1)))


@pytest.mark.parametrize("name", NAMES)
def test_clients_outside_the_cohort_keep_their_state(name):
    sim = Simulation(tiny_experiment(algorithm=name, participation=1 / 3), None)
    sim.run_round(0)
    everyone = np.arange(sim.exp.data.num_clients)
    sim.initialize(everyone, sim.downlink(sim.context(1), everyone), sim.context(1))
    before = {k: v.clone() for k, v in sim.store.tensors.items()}
    sim.run_round(1)
    cohort = sim.cohort(1).tolist()
    untouched = sorted(set(everyone.tolist()) - set(cohort))
    for k, v in before.items():
        assert torch.equal(sim.store.tensors[k][untouched], v[untouched])
    for c in cohort if before else []:  # ... while every state in the cohort changed
        assert not torch.equal(flat({k: v[c] for k, v in before.items()}), flat(sim.store.get(c)))


@pytest.mark.parametrize("name", NAMES)
def test_state_survives_serialization(name):
    sim = Simulation(tiny_experiment(algorithm=name), None)
    sim.run_round(0)
    buffer = io.BytesIO()
    torch.save(sim.state_dict(), buffer)
    buffer.seek(0)
    restored = Simulation(tiny_experiment(algorithm=name), None)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    for sim_ in (sim, restored):
        sim_.run_round(1)
    for k, v in sim.server["params"].items():
        assert torch.equal(v, restored.server["params"][k])
    assert restored.store.tensors.keys() == sim.store.tensors.keys()
    for k, v in sim.store.tensors.items():  # every client's private state, not only the cohort's
        assert torch.equal(v, restored.store.tensors[k])
    assert torch.equal(restored.store.visited, sim.store.visited)
    assert torch.equal(restored.store.initialized, sim.store.initialized)
    assert restored.next_round == sim.next_round and restored.records == sim.records


@pytest.mark.parametrize("name", NAMES)
def test_training_loss_goes_down_on_a_toy_problem(name):
    # Ten local steps: with evaluation-time personalization (FedRecon's reconstruction, FedBABU's
    # fine-tuning) the round-0 loss is already that of a locally trained head.
    sim = Simulation(tiny_experiment(algorithm=name, participation=1.0, inner_steps=10), None)
    first = sim.evaluate(0)["train_loss"]
    for t in range(5):
        sim.run_round(t)
    assert sim.evaluate(5)["train_loss"] < 0.9 * first


def reference_test_accuracy(sim: Simulation, completed: int) -> float:
    """Mean over clients of each one's test accuracy, with the stored states, by hand."""
    data, algorithm = sim.exp.data, sim.algorithm
    ctx, everyone = sim.context(completed), np.arange(data.num_clients)
    with sim.calibrated(completed):  # the server state evaluation predicts with (CCVR's)
        downlink = sim.downlink(ctx, everyone)
    local = algorithm.label_space == "local"
    accuracies = []
    for i in everyone:
        te = data.test_slice(i)
        x = data.inputs(data.x_test[te]).to(sim.exp.dtype)
        y = (data.y_test_local if local else data.y_test)[te]
        logits = algorithm.predict(sim.one_downlink(downlink, i, i), sim.store.get(i), x)
        has = (data.client_classes[i] >= 0) if local else torch.ones(logits.shape[-1], dtype=bool)
        logits = logits.masked_fill(~has, -torch.inf)
        accuracies.append(float((logits.argmax(-1) == y).double().mean()))
    return float(np.mean(accuracies))


@pytest.mark.parametrize("name", NAMES)
def test_a_model_with_an_empty_body_still_runs(name):
    sim = Simulation(tiny_experiment(algorithm=name, model="linear", dtype="float32"), None)
    sim.run_round(0)
    record = sim.evaluate(1)
    key = "test_acc_before_adapt" if sim.algorithm.adapts else "test_acc"
    assert record[key] == pytest.approx(reference_test_accuracy(sim, 1), abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_states_are_in_the_runs_dtype_with_an_empty_body(name):
    """A model without body parameters (``linear``, the synthetic datasets' default) leaves the
    downlink of a method with a personal head empty: its clients' states still come in the run's
    dtype (float64 here), and a round and an evaluation run."""
    sim = Simulation(tiny_experiment(algorithm=name, model="linear"), None)
    sim.run_round(0)
    assert np.isfinite(sim.evaluate(1)["test_loss"])
    for k, v in sim.store.tensors.items():
        assert v.dtype == torch.float64 or not v.is_floating_point(), k

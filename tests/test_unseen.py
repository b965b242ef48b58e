"""Clients that never train, for every registered algorithm: they join at evaluation with
``Algorithm.join`` and are reported as ``unseen_*``; joining changes nothing that trained."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego.algorithms import ALGORITHMS
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.sim import Simulation

NAMES = sorted(ALGORITHMS)


def unseen_simulation(name: str, **settings) -> Simulation:
    return Simulation(tiny_experiment(algorithm=name, unseen_fraction=0.34, **settings), None)


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_reports_its_unseen_clients(name):
    sim = unseen_simulation(name)
    sim.run_round(0)
    record = sim.evaluate(1)
    assert 0 <= record["unseen_test_acc"] <= 1
    assert np.isfinite(record["unseen_train_loss"])
    assert {"unseen_test_acc_weighted", "unseen_test_acc_p10", "test_acc"} <= record.keys()
    assert record["participation_gap"] == record["unseen_test_acc"] - record["test_acc"]


@pytest.mark.parametrize("name", NAMES)
def test_join_never_touches_the_server_or_the_trained_clients(name):
    sim = unseen_simulation(name)
    sim.run_round(0)
    sim.evaluate(1)  # the trained clients' first-visit states now exist too
    clone = lambda d: {k: v.clone() for k, v in d.items()}  # noqa: E731
    server = {k: clone(v) for k, v in sim.server.items()}
    states = clone(sim.store.tensors)
    visited = sim.store.visited.clone()
    sim.evaluate_unseen(1)
    assert sim.server.keys() == server.keys()
    for part, leaves in server.items():
        assert sim.server[part].keys() == leaves.keys()
        for k, v in leaves.items():
            assert torch.equal(sim.server[part][k], v)
    assert sim.store.tensors.keys() == states.keys()
    for k, v in states.items():
        assert torch.equal(sim.store.tensors[k], v)
    assert torch.equal(sim.store.visited, visited)


@pytest.mark.parametrize("name", ["pflego", "fedper"])
def test_a_new_client_trains_a_new_head_on_frozen_features(name):
    sim = unseen_simulation(name)
    sim.run_round(0)
    ctx = sim.context(1)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    personalization = sim.personalization(1, unseen=True)
    data = personalization.inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    first_visit = sim.init_state(sim.exp.data.num_clients, downlink, ctx)
    joined = sim.algorithm.join(downlink, first_visit, one, ctx)
    features = sim.algorithm.model.features(downlink, one.x)  # the body is never trained here
    head = {k: v.clone().requires_grad_() for k, v in first_visit.items()}
    for idx, mask in zip(one.batches, one.batch_mask):
        loss = masked_cross_entropy(
            head_logits(head, features[idx]), one.y[idx], mask, one.label_mask
        )
        grads = torch.autograd.grad(loss, list(head.values()))
        head = {k: v - ctx.client_lr * g for (k, v), g in zip(head.items(), grads)}
    for k, v in head.items():
        torch.testing.assert_close(joined[k], v.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.equal(joined["head.weight"], first_visit["head.weight"])


def test_join_epochs_sets_how_long_new_clients_personalize():
    """PGFed's new-client setting: the clients that never trained fine-tune for E epochs."""
    sim = unseen_simulation("fedper", batch_size=4, join_epochs=3)
    ids = np.arange(sim.exp.unseen.num_clients)
    batches = sim.personalization(1, unseen=True).inputs(ids).batches
    largest = int(sim.exp.unseen.train_sizes.max())
    assert batches.shape[1] == math.ceil(3 * largest / 4)
    trained = sim.personalization(1, unseen=False)
    assert trained is None  # the clients that trained are not affected (fedper has no adapt)


#: The methods whose ``join`` trains (FedBN's trains the normalization layers, which the tiny MLP
#: lacks).
JOIN_TRAINS = [name for name in NAMES if ALGORITHMS[name].join_trains and name != "fedbn"]


@pytest.mark.parametrize("name", JOIN_TRAINS)
def test_join_trains_the_new_clients(name, monkeypatch):
    """A method that declares ``join_trains`` personalizes a newcomer: its unseen clients' train
    loss is lower than with a ``join`` that returns the first-visit state unchanged (a small step
    size: GPFL's head on the valve's features diverges at 0.05)."""
    sim = unseen_simulation(name, client_lr=0.01)
    sim.run_round(0)
    joined = sim.evaluate_unseen(1)[0]["unseen_train_loss"]
    monkeypatch.setattr(type(sim.algorithm), "join", lambda self, downlink, state, data, ctx: state)
    untrained = sim.evaluate_unseen(1)[0]["unseen_train_loss"]
    assert joined < untrained - 1e-6

"""FLUTE against a hand-written float64 reference on ragged clients: the head phase and the joint
phase on the regularized objective (neural-collapse term, head norm, feature norm), the server's
neural-collapse step on each answering head, the N_i-weighted body average, what a client
predicts with, and a newcomer's head trained on the frozen body."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import (
    BODY,
    HEAD,
    assert_close,
    averaged,
    descend,
    logits,
    round_inputs,
    steps_of,
)
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

C = 4
LAM1, LAM2, LAM3, NC_LR = 0.6, 0.05, 0.01, 0.8
OPTIONS = {"lam1": LAM1, "lam2": LAM2, "lam3": LAM3, "nc_lr": NC_LR, "head_steps": 2}


def features(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.flatten(1) @ p["body.1.weight"].T + p["body.1.bias"])


def collapse(w: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """|| W W^T / ||W W^T||_F - (I - 11^T / C) / sqrt(C - 1) (.) u u^T ||_F, written out."""
    u = torch.zeros(C, dtype=torch.float64)
    u[classes] = 1
    frame = (torch.eye(C, dtype=torch.float64) - torch.ones(C, C) / C) / math.sqrt(C - 1)
    gram = w @ w.T
    return torch.linalg.matrix_norm(
        gram / torch.linalg.matrix_norm(gram) - frame * torch.outer(u, u)
    )


def objective(classes: list[int], with_features: bool):
    def loss(p, x, y):
        out = F.cross_entropy(logits(p, x), y)
        out = (
            out + LAM1 * collapse(p["head.weight"], classes) + LAM2 * (p["head.weight"] ** 2).sum()
        )
        return out + (LAM3 * (features(p, x) ** 2).sum() if with_features else 0)

    return loss


def nc_step(head: dict, classes: list[int], r: float) -> dict:
    w = head["head.weight"].clone().requires_grad_()
    (g,) = torch.autograd.grad(collapse(w, classes), [w])
    return {**head, "head.weight": head["head.weight"] - NC_LR / r * g}


@pytest.mark.parametrize(
    "setting", [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.5}], ids=["full", "mini"]
)
def test_flute_rounds_equal_the_papers_updates(setting):
    sim = Simulation(ragged_experiment("flute", options=OPTIONS, **setting), None)
    heads: dict[int, dict] = {}
    for t in range(3):
        ctx = sim.context(t)
        cohort, body, states, clients = round_inputs(sim, t)
        trained = []
        for c, (i, data) in enumerate(zip(cohort, clients, strict=True)):
            i = int(i)
            start = heads.get(i, {k: states[k][c] for k in HEAD})
            classes = sorted(set(data.y[data.mask > 0].tolist()))
            head_steps = steps_of(data, "head")
            assert len(head_steps) == 2
            p = descend({**body, **start}, HEAD, objective(classes, False), head_steps)
            p = descend(p, BODY + HEAD, objective(classes, True), steps_of(data))
            heads[i] = nc_step({k: p[k] for k in HEAD}, classes, ctx.cohort_size)
            trained.append(p)
        expected = averaged(body, trained, clients)
        sim.run_round(t)
        assert_close(sim.server["params"], expected)
        for i, head in heads.items():
            assert_close(sim.store.get(i), head)
    # a client predicts with the received body and its own head
    downlink = sim.algorithm.downlink(sim.server, sim.context(3))
    x = torch.randn(5, 1, 3, 3, dtype=torch.float64)
    for i, head in heads.items():
        got = sim.algorithm.predict(downlink, sim.store.get(i), x)
        torch.testing.assert_close(got, logits({**downlink, **head}, x), rtol=1e-9, atol=1e-11)


def test_a_newcomer_trains_a_regularized_head_on_the_frozen_body():
    sim = Simulation(ragged_experiment("flute", unseen_fraction=0.34, options=OPTIONS), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.downlink(sim.server, ctx)
    data = sim.personalization(2, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    first = sim.init_state(4, payload, ctx)
    joined = sim.algorithm.join(payload, first, one, ctx)
    classes = sorted(set(one.y[one.mask > 0].tolist()))
    steps = steps_of(one)  # the adapt schedule, the head phase
    assert len(steps) == 2
    expected = descend({**payload, **first}, HEAD, objective(classes, False), steps)
    assert_close(joined, {k: expected[k] for k in HEAD})
    assert not torch.equal(joined["head.weight"], first["head.weight"])


@pytest.mark.parametrize("options", [{"lam1": -1.0}, {"nc_lr": -0.1}, {"head_steps": 0}])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError, match="flute"):
        ragged_experiment("flute", options=options)

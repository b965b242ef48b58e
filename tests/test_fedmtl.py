"""FedMTL (PFLlib's) against a hand-written float64 reference on ragged clients: each sampled
client trains its own model on its loss plus c (||W||_F^2 + omega^2 ||W 1||^2) over the cohort's
models, its own column the model it trains, and keeps it; the server stores the models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_baselines import assert_close, descend, logits, steps_of
from test_fast_sim import ragged_experiment
from test_pfedsim import assert_backends_agree, assert_evaluation, assert_predictions

from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")


def objective(others: list[dict], omega: float, c: float):
    """CE + c (sum_j ||w_j||^2 + omega^2 ||sum_j w_j||^2), the trained model one column of W."""

    def loss(p, x, y):
        columns = [p, *others]
        frobenius = sum((m[k] ** 2).sum() for m in columns for k in MODEL)
        total = sum(sum(m[k] for m in columns).pow(2).sum() for k in MODEL)
        ce = torch.nn.functional.cross_entropy(logits(p, x), y)
        return ce + c * (frobenius + omega**2 * total)

    return loss


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.0}],
    ids=["full-batch", "minibatch"],
)
def test_fedmtl_rounds_equal_pfllibs_updates(setting):
    sim = Simulation(ragged_experiment("fedmtl", client_lr=2.0, **setting), None)
    count = sim.exp.data.num_clients
    initial = {k: v.clone() for k, v in sim.server["params"].items()}
    models = [dict(initial) for _ in range(count)]
    size = sum(v.numel() for v in initial.values())
    c = 10.0 ** -(math.floor(math.log10(size) + 1) + 1)
    for t in range(4):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        omega = 1 - 1 / len(cohort)
        inputs = sim.round_inputs(t, cohort)
        trained = {}
        for c_pos, i in enumerate(cohort):
            others = [models[j] for j in cohort if j != i]
            loss = objective(others, omega, c)
            data = inputs.client(c_pos)
            trained[i] = descend(models[i], MODEL, loss, steps_of(data), lr=ctx.client_lr)
        sim.run_round(t)
        for i, m in trained.items():
            models[i] = m
        for i in range(count):
            assert_close({k: v[i] for k, v in sim.server["models"].items()}, models[i])
    for i in range(count):  # every client trained
        assert float((models[i]["head.bias"] - initial["head.bias"]).abs().max()) > 0
    assert_evaluation(sim, 4, models)
    assert_predictions(sim, 4, models)


def test_the_penalty_acts():
    """Without the cohort's penalty the first round's models differ (c is small, the step large)."""
    sim = Simulation(ragged_experiment("fedmtl", client_lr=2.0), None)
    ctx, cohort = sim.context(0), sim.cohort(0)
    data = sim.round_inputs(0, cohort).client(0)
    sim.run_round(0)
    initial = {k: v.clone() for k, v in sim.server["params"].items()}
    ce = lambda p, x, y: torch.nn.functional.cross_entropy(logits(p, x), y)  # noqa: E731
    plain = descend(initial, MODEL, ce, steps_of(data), lr=ctx.client_lr)
    stored = {k: v[int(cohort[0])] for k, v in sim.server["models"].items()}
    assert max(float((stored[k] - plain[k]).abs().max()) for k in MODEL) > 1e-9


def test_a_newcomer_trains_the_initial_model_and_predicts_with_it():
    sim = Simulation(ragged_experiment("fedmtl", unseen_fraction=0.34), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.evaluation_downlink(sim.server, ctx)
    data = sim.personalization(2, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    state = sim.init_state(6, payload, ctx)
    exact = dict(rtol=1e-10, atol=1e-12)
    predict = sim.algorithm.predict
    torch.testing.assert_close(predict(payload, state, one.x), logits(payload, one.x), **exact)
    joined = sim.algorithm.join(payload, state, one, ctx)
    size = sum(v.numel() for v in payload.values())
    c = 10.0 ** -(math.floor(math.log10(size) + 1) + 1)
    expected = descend(payload, MODEL, objective([], 0.0, c), steps_of(one), lr=ctx.client_lr)
    assert_close({k[len("model.") :]: v for k, v in joined.items() if k != "trained"}, expected)
    torch.testing.assert_close(predict(payload, joined, one.x), logits(expected, one.x), **exact)


def test_the_backends_agree():
    assert_backends_agree("fedmtl", {}, batch_size=4, local_epochs=1.0)

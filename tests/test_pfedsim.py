"""pFedSim against a hand-written float64 reference on ragged clients: FedAvg during the warm-up,
then each sampled client's feature extractor mixed over every client's stored model with weights
-log(1 - S_ij) from the cosine similarity of the classifiers, and the stored models evaluated."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, descend, logits, split, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
BODY = MODEL[:2]


def loss(p, x, y):
    return F.cross_entropy(logits(p, x), y)


def similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """max(0, mean over classes c of cos(a[c], b[c])), written out."""
    cosines = [float(a[c] @ b[c] / (a[c].norm() * b[c].norm())) for c in range(len(a))]
    return max(0.0, sum(cosines) / len(cosines))


def personalized(models: list[dict], sim: list[list[float]], i: int) -> dict:
    """(sum_j a_ij phi_j, h_i) with a_ij proportional to -log(1 - S_ij), S_ii = 0.9999."""
    raw = [-math.log(1 - (0.9999 if j == i else min(s, 0.9999))) for j, s in enumerate(sim[i])]
    a = [w / sum(raw) for w in raw]
    body = {k: sum(a[j] * m[k] for j, m in enumerate(models)) for k in BODY}
    return {**body, "head.weight": models[i]["head.weight"], "head.bias": models[i]["head.bias"]}


def assert_evaluation(sim: Simulation, completed: int, personal: list[dict]) -> None:
    """The record's test accuracy is the mean over clients of each personal model's."""
    accuracies = []
    for i, params in enumerate(personal):
        x, y = split(sim, i, "test")
        accuracies.append(float((logits(params, x).argmax(1) == y).double().mean()))
    assert sim.evaluate(completed)["test_acc"] == pytest.approx(np.mean(accuracies), abs=1e-12)


def assert_predictions(sim: Simulation, completed: int, personal: list[dict]) -> None:
    """Each client's ``predict`` on the round's training downlink and its stored state gives
    its personal model's logits (what the registry's evaluation tests compare to)."""
    ctx, everyone = sim.context(completed), torch.arange(sim.exp.data.num_clients)
    downlink = sim.downlink(ctx, everyone)
    x = sim.round_inputs(completed, everyone[:1]).client(0).x
    for i, params in enumerate(personal):
        own = {k: v[i] for k, v in downlink.items()}
        predicted = sim.algorithm.predict(own, sim.store.get(i), x)
        torch.testing.assert_close(predicted, logits(params, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.0}],
    ids=["full-batch", "minibatch"],
)
def test_pfedsim_rounds_equal_the_papers_updates(setting):
    warmup = 2
    sim = Simulation(
        ragged_experiment("pfedsim", options={"warmup_rounds": warmup}, **setting), None
    )
    count = sim.exp.data.num_clients
    glob = {k: v.clone() for k, v in sim.server["params"].items()}
    models: list[dict] = []
    matrix = [[float(i == j) for j in range(count)] for i in range(count)]
    mixed = 0.0
    for t in range(5):
        ctx, cohort = sim.context(t), sim.cohort(t)
        cohort = [int(i) for i in cohort]
        inputs = sim.round_inputs(t, cohort)
        sent = sim.downlink(ctx, torch.as_tensor(cohort))
        if t == warmup:  # every personal model starts as the warm-up's global model
            models = [dict(glob) for _ in range(count)]
        trained, sizes = {}, []
        for c, i in enumerate(cohort):
            start = glob if t < warmup else personalized(models, matrix, i)
            assert_close({k: v[c] for k, v in sent.items()}, start)
            data = inputs.client(c)
            trained[i] = descend(start, MODEL, loss, steps_of(data), lr=ctx.client_lr)
            sizes.append(data.num_samples)
        sim.run_round(t)
        if t < warmup:
            total = sum(sizes)
            glob = {k: sum(n / total * trained[i][k] for n, i in zip(sizes, cohort)) for k in MODEL}
            assert_close(sim.server["params"], glob)
            continue
        for i in cohort:
            models[i] = trained[i]
        for i in cohort:
            for j in cohort:
                if i != j:
                    h = "head.weight"
                    matrix[i][j] = similarity(models[i][h], models[j][h])
        off = [matrix[i][j] for i in range(count) for j in range(count) if i != j]
        mixed = max(mixed, max(off))
        for i in range(count):
            assert_close({k: v[i] for k, v in sim.server["models"].items()}, models[i])
            assert float(sim.server["sim"][i, i]) == 1.0
            for j in range(count):
                if i != j:
                    assert float(sim.server["sim"][i, j]) == pytest.approx(matrix[i][j], abs=1e-12)
        if t == 3:  # each client is evaluated with its stored model (the global one if untrained)
            assert_evaluation(sim, 4, models)
            assert_predictions(sim, 4, models)
    assert 1e-3 < mixed < 0.9999  # the similarities weigh other clients, without the cap


def test_during_the_warm_up_every_client_predicts_with_the_global_model():
    sim = Simulation(ragged_experiment("pfedsim", options={"warmup_rounds": 3}), None)
    sim.run_round(0)
    glob = {k: v.clone() for k, v in sim.server["params"].items()}
    assert_evaluation(sim, 1, [glob] * sim.exp.data.num_clients)


def test_a_newcomer_trains_the_model_it_receives_and_predicts_with_it():
    sim = Simulation(
        ragged_experiment("pfedsim", unseen_fraction=0.34, options={"warmup_rounds": 1}), None
    )
    for t in range(3):
        sim.run_round(t)
    ctx = sim.context(3)
    payload = sim.algorithm.evaluation_downlink(sim.server, ctx)
    assert_close(payload, sim.server["params"])  # the warm-up's last global model
    data = sim.personalization(3, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    state = sim.init_state(6, payload, ctx)
    exact = dict(rtol=1e-10, atol=1e-12)
    predict = sim.algorithm.predict
    torch.testing.assert_close(predict(payload, state, one.x), logits(payload, one.x), **exact)
    joined = sim.algorithm.join(payload, state, one, ctx)
    expected = descend(payload, MODEL, loss, steps_of(one), lr=ctx.client_lr)
    assert_close({k[len("model.") :]: v for k, v in joined.items() if k != "trained"}, expected)
    torch.testing.assert_close(predict(payload, joined, one.x), logits(expected, one.x), **exact)


def test_bad_options_are_one_line_errors():
    with pytest.raises(ConfigError):
        ragged_experiment("pfedsim", options={"warmup_rounds": -1})


def assert_backends_agree(name: str, options: dict, rounds: int = 4, **settings) -> None:
    """loop, vmap and fused give the same server state and evaluation over ``rounds`` rounds
    with ``options`` (the registry suites run the defaults for two or three rounds only)."""
    sims = {
        b: Simulation(ragged_experiment(name, backend=b, options=options, **settings), None)
        for b in ("loop", "vmap", "fused")
    }
    for t in range(rounds):
        for sim in sims.values():
            sim.run_round(t)
    records = {b: sim.evaluate(rounds) for b, sim in sims.items()}
    for other in ("vmap", "fused"):
        torch.testing.assert_close(sims["loop"].server, sims[other].server, rtol=1e-9, atol=1e-10)
        assert records["loop"]["test_acc"] == pytest.approx(records[other]["test_acc"], abs=1e-10)


def test_the_backends_agree_after_the_warm_up():
    assert_backends_agree("pfedsim", {"warmup_rounds": 1}, batch_size=4, local_epochs=1.0)

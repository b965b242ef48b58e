"""FedCross against a hand-written float64 reference on ragged clients: K middleware models, the
cohort's k-th client training v_k, the global model their weighted mean, and each v_k crossed with
its least similar (most similar, in-order) collaborator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, descend, logits, steps_of
from test_fast_sim import ragged_experiment
from test_pfedsim import assert_backends_agree, assert_evaluation, loss

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
ALPHA = 0.8


def similarity(a: dict, b: dict) -> float:
    """Sum over the two layers of the cosine of their flattened weight and bias."""
    total = 0.0
    for layer in ("body.1", "head"):
        fa = torch.cat([a[f"{layer}.weight"].flatten(), a[f"{layer}.bias"]])
        fb = torch.cat([b[f"{layer}.weight"].flatten(), b[f"{layer}.bias"]])
        total += float(F.cosine_similarity(fa, fb, dim=0))
    return total


def partner(models: list[dict], k: int, select: str, t: int) -> int:
    count = len(models)
    if select == "in-order":
        return (k + t % (count - 1) + 1) % count
    scores = {j: similarity(models[k], models[j]) for j in range(count) if j != k}
    pick = min if select == "lowest" else max
    return pick(scores, key=scores.get)


@pytest.mark.parametrize(
    ("select", "setting"),
    [
        ("lowest", {"inner_steps": 3}),
        ("highest", {"batch_size": 4, "local_epochs": 1.0}),
        ("in-order", {"inner_steps": 2}),
    ],
)
def test_fedcross_rounds_equal_the_papers_updates(select, setting):
    options = {"alpha": ALPHA, "select": select, "first_stage_bound": 1}
    sim = Simulation(ragged_experiment("fedcross", options=options, **setting), None)
    glob = {k: v.clone() for k, v in sim.server["params"].items()}
    middleware = [dict(glob) for _ in range(3)]  # K = the cohort size, 3 of 6
    chosen = set()
    for t in range(4):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        sent = sim.downlink(ctx, torch.as_tensor(cohort))
        trained, sizes = [], []
        for c in range(len(cohort)):
            assert_close({k: sent["middleware." + k][c] for k in MODEL}, middleware[c])
            assert_close({k: sent[k][c] for k in MODEL}, glob)  # what the client predicts with
            assert float(sent["slot"][c]) == c
            data = inputs.client(c)
            trained.append(descend(middleware[c], MODEL, loss, steps_of(data), lr=ctx.client_lr))
            sizes.append(data.num_samples)
        sim.run_round(t)
        total = sum(sizes)
        glob = {k: sum(n / total * m[k] for n, m in zip(sizes, trained)) for k in MODEL}
        if t < 1:
            middleware = [dict(glob) for _ in range(3)]
        else:
            pairs = [partner(trained, k, select, t) for k in range(3)]
            chosen.update(pairs)
            middleware = [
                {k: ALPHA * trained[j][k] + (1 - ALPHA) * trained[pairs[j]][k] for k in MODEL}
                for j in range(3)
            ]
        assert_close(sim.server["params"], glob)
        for j in range(3):
            assert_close({k: v[j] for k, v in sim.server["middleware"].items()}, middleware[j])
    assert len(chosen) > 1  # the collaborators differ
    assert_evaluation(sim, 4, [glob] * sim.exp.data.num_clients)  # the global model predicts


def test_a_newcomer_is_evaluated_with_the_global_model():
    sim = Simulation(ragged_experiment("fedcross", unseen_fraction=0.34), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.evaluation_downlink(sim.server, ctx)
    assert_close(payload, sim.server["params"])
    state = sim.init_state(6, payload, ctx)
    x = sim.round_inputs(2, sim.cohort(2)).client(0).x
    torch.testing.assert_close(sim.algorithm.predict(payload, state, x), logits(payload, x))
    assert not sim.algorithm.adapts


def test_the_backends_agree():
    assert_backends_agree("fedcross", {}, batch_size=4, local_epochs=1.0)


@pytest.mark.parametrize(
    "options", [{"alpha": 1.5}, {"first_stage_bound": -1}, {"select": "random"}]
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("fedcross", options=options)

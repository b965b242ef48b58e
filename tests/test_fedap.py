"""FedAP against a hand-written float64 reference on ragged clients: FedBN pre-training, then each
sampled client's model aggregated over every client's stored model with weights lambda (its own)
and (1 - lambda) times the normalized inverse Wasserstein distances of the clients' feature (or
batch-norm input) statistics, and the stored models evaluated."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_baselines import assert_close, descend, logits, steps_of
from test_fast_sim import ragged_experiment
from test_pfedsim import assert_backends_agree, assert_evaluation, assert_predictions, loss

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
LAMBDA = 0.3


def features(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.flatten(1) @ p["body.1.weight"].T + p["body.1.bias"])


def moments(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and biased variance over the rows."""
    mean = h.mean(0)
    return mean, ((h - mean) ** 2).mean(0)


def weights_of(stats: dict[int, tuple], count: int, lam: float) -> list[list[float]]:
    """w_ii = lam, w_ij = (1 - lam) (1/d_ij) / sum_k (1/d_ik) over the measured clients, with
    d_ij = sqrt(||mu_i - mu_j||^2 + ||sigma_i - sigma_j||^2); identity rows otherwise."""
    w = [[float(i == j) for j in range(count)] for i in range(count)]
    for i in stats:
        inverse = {}
        for j in stats:
            if j != i:
                (mi, vi), (mj, vj) = stats[i], stats[j]
                d = math.sqrt(float(((mi - mj) ** 2).sum() + ((vi.sqrt() - vj.sqrt()) ** 2).sum()))
                inverse[j] = 1 / d
        if inverse:
            w[i][i] = lam
            for j, v in inverse.items():
                w[i][j] = (1 - lam) * v / sum(inverse.values())
    return w


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.0}],
    ids=["full-batch", "minibatch"],
)
def test_fedap_rounds_equal_the_papers_updates(setting):
    warmup = 2
    options = {"warmup_rounds": warmup, "model_momentum": LAMBDA}
    sim = Simulation(ragged_experiment("fedap", options=options, **setting), None)
    count = sim.exp.data.num_clients
    glob = {k: v.clone() for k, v in sim.server["params"].items()}
    models: list[dict] = []
    stats: dict[int, tuple] = {}
    w = weights_of(stats, count, LAMBDA)
    for t in range(5):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        sent = sim.downlink(ctx, torch.as_tensor(cohort))
        if t == warmup:
            models = [dict(glob) for _ in range(count)]
        trained, sizes = {}, []
        for c, i in enumerate(cohort):
            if t < warmup:
                start = glob
            else:
                start = {k: sum(w[i][j] * m[k] for j, m in enumerate(models)) for k in MODEL}
            assert_close({k: v[c] for k, v in sent.items()}, start)
            data = inputs.client(c)
            if t >= warmup and i not in stats:  # measured on the pre-trained model
                assert_close(start, glob)
                stats[i] = moments(features(start, data.x[data.mask > 0]))
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
        w = weights_of(stats, count, LAMBDA)
        torch.testing.assert_close(sim.server["weights"], torch.tensor(w, dtype=torch.float64))
        for i in range(count):
            assert_close({k: v[i] for k, v in sim.server["models"].items()}, models[i])
        if t == 3:
            assert_evaluation(sim, 4, models)
            assert_predictions(sim, 4, models)
    off = [w[i][j] for i in range(count) for j in range(count) if i != j]
    assert len(stats) >= 3 and max(off) > 1e-3  # the weights mix several measured clients


def test_with_batch_norm_the_statistics_are_the_inputs_of_the_norm_and_the_norm_stays_local():
    sim = Simulation(
        ragged_experiment("fedap", model="mlp-bn", options={"warmup_rounds": 1}, inner_steps=2),
        None,
    )
    assert "body.2.weight" not in sim.server["params"]  # the norm's gamma, beta stay local
    for t in range(3):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        sent = sim.downlink(ctx, torch.as_tensor(cohort))
        measured = sim.server["measured"].clone() if "measured" in sim.server else torch.zeros(6)
        sim.run_round(t)
        for c, i in enumerate(cohort):
            if t < 1 or measured[i] > 0:
                continue
            data = inputs.client(c)
            x = data.x[data.mask > 0].flatten(1)
            mean, var = moments(x @ sent["body.1.weight"][c].T + sent["body.1.bias"][c])
            torch.testing.assert_close(sim.server["stats"]["body.2.mean"][i], mean)
            torch.testing.assert_close(sim.server["stats"]["body.2.var"][i], var)
    # A client predicts with its stored model and its own norm in evaluation mode.
    i = int(torch.nonzero(sim.server["measured"])[0])
    state = sim.store.get(i)
    model = {k: v[i] for k, v in sim.server["models"].items()}
    x = inputs.client(0).x
    h = x.flatten(1) @ model["body.1.weight"].T + model["body.1.bias"]
    h = (h - state["body.2.running_mean"]) / torch.sqrt(state["body.2.running_var"] + 1e-5)
    h = torch.relu(h * state["body.2.weight"] + state["body.2.bias"])
    expected = h @ model["head.weight"].T + model["head.bias"]
    downlink = sim.algorithm.evaluation_downlink(sim.server, sim.context(3), torch.tensor([i]))
    one = {k: v[0] for k, v in downlink.items()}
    torch.testing.assert_close(sim.algorithm.predict(one, state, x), expected)


def test_a_newcomer_trains_the_model_it_receives_and_predicts_with_it():
    sim = Simulation(
        ragged_experiment("fedap", unseen_fraction=0.34, options={"warmup_rounds": 1}), None
    )
    for t in range(3):
        sim.run_round(t)
    ctx = sim.context(3)
    payload = sim.algorithm.evaluation_downlink(sim.server, ctx)
    assert_close(payload, sim.server["params"])  # the pre-trained model
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


@pytest.mark.parametrize("model", ["mlp", "mlp-bn"])
def test_the_backends_agree_after_the_pre_training(model):
    assert_backends_agree("fedap", {"warmup_rounds": 1}, model=model, batch_size=4)


@pytest.mark.parametrize("options", [{"warmup_rounds": -1}, {"model_momentum": 1.5}])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("fedap", options=options)

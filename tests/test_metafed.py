"""MetaFed against a hand-written float64 reference on ragged clients: each client's warm-up
alone and its flag from its validation accuracy, then distillation of its own model toward its
predecessor's features (flag set) or training from the predecessor's model (flag unset)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, descend, logits, steps_of
from test_fast_sim import ragged_experiment
from test_pfedsim import assert_backends_agree, assert_evaluation, assert_predictions, loss

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
LAM = 2.0


def features(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.flatten(1) @ p["body.1.weight"].T + p["body.1.bias"])


def distillation(teacher: dict):
    """CE + lambda * mean over the batch and features of (phi(x) - phi_teacher(x))^2."""
    return lambda p, x, y: loss(p, x, y) + LAM * F.mse_loss(features(p, x), features(teacher, x))


def accuracy(p: dict, data) -> float:
    val = data.validation
    real = val["mask"] > 0
    x, y = val["x"][real], val["y"][real]
    masked = logits(p, x).masked_fill(data.label_mask == 0, -torch.inf)
    return float((masked.argmax(1) == y).double().mean())


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.0}],
    ids=["full-batch", "minibatch"],
)
def test_metafed_rounds_equal_the_papers_updates(setting):
    options = {"lam": LAM, "threshold": 0.55}
    sim = Simulation(ragged_experiment("metafed", options=options, **setting), None)
    count = sim.exp.data.num_clients
    initial = {k: v.clone() for k, v in sim.server["params"].items()}
    models = [dict(initial) for _ in range(count)]  # the server's copies (the teachers)
    flags: dict[int, bool] = {}
    paths = set()
    for t in range(5):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        trained = {}
        for c, i in enumerate(cohort):
            data, teacher = inputs.client(c), models[(i - 1) % count]
            if i not in flags:  # the warm-up, alone
                trained[i] = descend(models[i], MODEL, loss, steps_of(data), lr=ctx.client_lr)
                flags[i] = accuracy(trained[i], data) > options["threshold"]
                paths.add("warm-up")
            elif flags[i]:  # its own model, distilled toward the teacher's features
                step = distillation(teacher)
                trained[i] = descend(models[i], MODEL, step, steps_of(data), lr=ctx.client_lr)
                paths.add("distill")
            else:  # the teacher's model, trained
                trained[i] = descend(teacher, MODEL, loss, steps_of(data), lr=ctx.client_lr)
                paths.add("inherit")
        sim.run_round(t)
        for i, m in trained.items():
            models[i] = m
        for i in range(count):
            assert_close({k: v[i] for k, v in sim.server["models"].items()}, models[i])
        for i, flag in flags.items():
            assert float(sim.store.get(i)["flag"]) == float(flag)
    assert paths == {"warm-up", "distill", "inherit"}
    assert_evaluation(sim, 5, models)
    assert_predictions(sim, 5, models)


def test_a_newcomer_warms_up_and_predicts_with_its_model():
    sim = Simulation(ragged_experiment("metafed", unseen_fraction=0.34), None)
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
    expected = descend(payload, MODEL, loss, steps_of(one), lr=ctx.client_lr)
    own = {k[len("model.") :]: v for k, v in joined.items() if k.startswith("model.")}
    assert_close(own, expected)
    torch.testing.assert_close(predict(payload, joined, one.x), logits(expected, one.x), **exact)


def test_the_backends_agree():
    options = {"lam": LAM, "threshold": 0.55}
    assert_backends_agree("metafed", options, rounds=5, batch_size=4, local_epochs=1.0)


@pytest.mark.parametrize("options", [{"lam": -1.0}, {"threshold": 1.5}])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("metafed", options=options)
